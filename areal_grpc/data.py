"""Prompt data from files, and a generator of a GSM8K-shaped arithmetic set.

Files are read with the Hugging Face ``datasets`` library: JSON Lines (``.jsonl``/``.json``)
or Parquet (``.parquet``), one item per row, in the shape users already have. GSM8K's shape
is ``{"question": ..., "answer": "...#### 72"}``; workflows take the prompt from ``prompt``
(or ``question``, or chat ``messages``) and the ``gsm8k`` reward scores ``answer``. Rows in
verl's Parquet shape (a chat ``prompt``, ``reward_model.ground_truth``) are read as they are
(:func:`from_verl`).

:func:`write_arithmetic` writes a deterministic set in that shape (``train.jsonl`` and
``test.jsonl``, disjoint), from 1-digit sums to one-step word problems::

    python -m areal_grpc.data arith --out data/arith
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from areal_grpc.errors import FieldError

Item = dict[str, Any]

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_file(path: str | Path, field: str = "data.path") -> list[Item]:
    """Every row of a JSONL or Parquet file as a dict (FieldError naming ``field`` if not)."""
    p = Path(path)
    fmt = FILE_FORMATS.get(p.suffix.lower())
    if fmt is None:
        raise FieldError(field, f"{str(p)!r}: use a .jsonl, .json or .parquet file")
    if not p.is_file():
        raise FieldError(field, f"{str(p)!r} does not exist")
    try:
        import datasets
    except ImportError as exc:
        raise FieldError(
            field, "reading data files needs the 'datasets' package (pip install datasets)"
        ) from exc
    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(fmt, data_files=str(p), split="train", keep_in_memory=True)
    except Exception as exc:  # datasets raises many kinds for unreadable files
        raise FieldError(field, f"{str(p)!r} cannot be read: {type(exc).__name__}: {exc}") from None
    items = [from_verl(dict(row), f"{str(p)!r} row {i}", field) for i, row in enumerate(table)]
    if not items:
        raise FieldError(field, f"{str(p)!r} holds no items")
    return items


# Keys a workflow takes a prompt from (servers/rollout/workflows.py).
PROMPT_KEYS = ("prompt", "question", "messages", "input_ids")


def from_verl(row: Item, where: str, field: str = "data.path") -> Item:
    """A row in verl's dataset shape as an item the workflows and rewards read; others unchanged.

    verl's rows hold ``prompt`` (a list of chat messages), ``reward_model`` (``{"style": ...,
    "ground_truth": ...}``), ``data_source``, ``ability`` and ``extra_info``. The messages become
    ``messages`` (the chat prompt) and, joined by newlines, the plain ``prompt`` a model without
    a chat template is given; ``ground_truth`` becomes ``answer`` (a number as its text) unless
    the row has one. The row's own keys stay, for rewards of your own. ``where`` names the row
    in errors.
    """
    chat = row.get("prompt")
    reward_model = row.get("reward_model")
    if not isinstance(chat, list) and reward_model is None:
        return row
    if chat is None and not any(row.get(k) is not None for k in PROMPT_KEYS):
        raise FieldError(
            field,
            f"{where} is in verl's shape (it has reward_model) but has no prompt: "
            "a list of chat messages [{role, content}]",
        )
    item = dict(row)
    if isinstance(chat, list):
        messages = []
        for j, m in enumerate(chat):
            if not (
                isinstance(m, Mapping)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                raise FieldError(field, f"{where}: prompt[{j}] needs role and content strings")
            messages.append({"role": m["role"], "content": m["content"]})
        if not messages:
            raise FieldError(field, f"{where}: prompt holds no messages")
        item["messages"] = messages
        item["prompt"] = "\n".join(m["content"] for m in messages)
    if reward_model is not None:
        if not isinstance(reward_model, Mapping):
            raise FieldError(field, f"{where}: reward_model must be a mapping: {reward_model!r}")
        truth = reward_model.get("ground_truth")
        if truth is not None and item.get("answer") is None:
            # A number as its text: items travel as protobuf Structs, where 72 becomes 72.0.
            numeric = isinstance(truth, (int, float)) and not isinstance(truth, bool)
            item["answer"] = str(truth) if numeric else truth
    return item


# --- the arithmetic set ---------------------------------------------------------------------

NAMES = ["Tom", "Ana", "Sam", "Mia", "Leo", "Zoe", "Max", "Ivy", "Ben", "Eva", "Raj", "Kim"]
THINGS = ["apples", "books", "coins", "stamps", "marbles", "pens", "cards", "shells"]

# Kind -> (question, answer value) built from a random source; the kinds of :data:`MIX`.
Maker = Callable[[random.Random], tuple[str, int]]


def _sum(a_digits: int, b_digits: int, either_order: bool = True) -> Maker:
    def make(rng: random.Random) -> tuple[str, int]:
        a = rng.randrange(10 ** (a_digits - 1) if a_digits > 1 else 0, 10**a_digits)
        b = rng.randrange(10 ** (b_digits - 1) if b_digits > 1 else 0, 10**b_digits)
        if either_order and rng.random() < 0.5:
            a, b = b, a
        return f"What is {a} + {b}?", a + b

    return make


def _word(rng: random.Random) -> tuple[str, int]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a = rng.randrange(10, 100)
    if rng.random() < 0.5:
        b = rng.randrange(2, 50)
        return (
            f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?",
            a + b,
        )
    b = rng.randrange(1, a)
    return (
        f"{name} has {a} {thing} and gives away {b}. How many {thing} does {name} have left?",
        a - b,
    )


KINDS: dict[str, Maker] = {
    "add_1_1": _sum(1, 1),
    # Either operand first: "What is 7 + 34?" is much harder for a small model than
    # "What is 34 + 7?" (measured on SmolLM2-135M, docs/getting-started/real-model.md).
    "add_2_1": _sum(2, 1),
    # The 2-digit number first, always: the plain-loop anchor's sums.
    "add_2_1_ordered": _sum(2, 1, either_order=False),
    "add_2_2": _sum(2, 2),
    "word": _word,
}

# The default difficulty mix (fractions of each split): the 1-digit and 2+1-digit sums a
# plain GRPO loop was measured on, with 40% of harder items (2+2-digit sums, one-step word
# problems) in their place.
MIX: dict[str, float] = {"add_1_1": 0.3, "add_2_1": 0.3, "add_2_2": 0.2, "word": 0.2}


def arithmetic_items(
    n_train: int, n_test: int, seed: int = 0, mix: Mapping[str, float] | None = None
) -> tuple[list[Item], list[Item]]:
    """(train, test) items in GSM8K's shape; no test question occurs in train; seeded."""
    mix = dict(mix or MIX)
    unknown = sorted(set(mix) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown kinds {unknown}; known: {sorted(KINDS)}")
    rng = random.Random(f"areal-arith:{seed}")
    total_weight = sum(mix.values())
    splits: dict[str, list[Item]] = {"train": [], "test": []}
    seen: set[str] = set()
    for split, n in (("test", n_test), ("train", n_train)):
        # Each kind gets its share of the split (rounding remainder to the last kind).
        counts = {k: int(n * w / total_weight) for k, w in mix.items()}
        last = list(mix)[-1]
        counts[last] += n - sum(counts.values())
        for kind, count in counts.items():
            made, tries = 0, 0
            while made < count:
                tries += 1
                if tries > 100 * count + 1000:
                    raise ValueError(f"kind {kind!r} has fewer than {count} distinct questions")
                question, value = KINDS[kind](rng)
                # Test questions are distinct and never in train; train may repeat one
                # (1-digit sums have only 100 questions).
                if question in seen:
                    continue
                if split == "test":
                    seen.add(question)
                splits[split].append(
                    {
                        "question": question,
                        "answer": f"{value}\n#### {value}",
                        "kind": kind,
                        "id": f"arith-{split}-{len(splits[split])}",
                    }
                )
                made += 1
        rng.shuffle(splits[split])
    return splits["train"], splits["test"]


def write_jsonl(items: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Writes ``items`` as JSON Lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(dict(i), sort_keys=True) + "\n" for i in items))


def write_arithmetic(
    out: str | Path,
    n_train: int = 4000,
    n_test: int = 200,
    seed: int = 0,
    mix: Mapping[str, float] | None = None,
) -> tuple[Path, Path]:
    """Writes ``train.jsonl`` and ``test.jsonl`` under ``out``; returns their paths."""
    train, test = arithmetic_items(n_train, n_test, seed, mix)
    out = Path(out)
    write_jsonl(train, out / "train.jsonl")
    write_jsonl(test, out / "test.jsonl")
    return out / "train.jsonl", out / "test.jsonl"


def _parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in text.split(","):
        kind, _, weight = part.partition("=")
        mix[kind.strip()] = float(weight) if weight else 1.0
    return mix


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m areal_grpc.data arith --out DIR``: writes the arithmetic set."""
    parser = argparse.ArgumentParser(prog="python -m areal_grpc.data", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    arith = sub.add_parser("arith", help="write the GSM8K-shaped arithmetic set")
    arith.add_argument("--out", required=True, help="directory for train.jsonl and test.jsonl")
    arith.add_argument("--train", type=int, default=4000, help="train items")
    arith.add_argument("--test", type=int, default=200, help="test items (held out)")
    arith.add_argument("--seed", type=int, default=0)
    arith.add_argument(
        "--mix",
        default=",".join(f"{k}={v}" for k, v in MIX.items()),
        help=f"kind=weight,... of {', '.join(KINDS)}",
    )
    args = parser.parse_args(argv)
    try:
        train, test = write_arithmetic(
            args.out, args.train, args.test, args.seed, _parse_mix(args.mix)
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {train} ({args.train} items) and {test} ({args.test} items)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
