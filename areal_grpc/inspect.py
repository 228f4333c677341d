"""``python -m areal_grpc.inspect <output.dir> [-n N]``: the last samples a run trained on, as
text, with their reward, advantage, finish reason and the policy versions that generated them.

It reads the run's ``rollouts/`` (written by :mod:`areal_grpc.coordinator.rollouts`). Samples
written without text have their token ids decoded with the tokenizer of the run's
``model.source`` (from its ``config.yaml``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

__all__ = ["ROLLOUTS_DIR", "last_samples", "main", "render"]

# Where a run's samples are, under its output.dir (written by the coordinator's RolloutLog).
ROLLOUTS_DIR = "rollouts"


def last_samples(run_dir: Path, n: int) -> list[dict[str, Any]]:
    """The run's last ``n`` written samples, oldest first."""
    files = sorted((run_dir / ROLLOUTS_DIR).glob("step-*.jsonl"))
    out: list[dict[str, Any]] = []
    for path in reversed(files):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line]
        out = lines + out
        if len(out) >= n:
            break
    return out[-n:] if n else []


def render(sample: dict[str, Any], decode: Any) -> str:
    """One sample as text: a header line, then the prompt and the completion."""
    versions = sample["versions"]
    spread = f"{min(versions)}..{max(versions)}" if versions else "-"
    # Null with a KL penalty (per-token), absent in samples of older runs.
    advantage = sample.get("advantage")
    head = (
        f"step {sample['step']}  version {sample['version']}  reward {sample['reward']:g}  "
        f"advantage {'-' if advantage is None else f'{advantage:.4g}'}  "
        f"{sample['finish_reason']}  tokens generated at versions {spread}  "
        f"{sample['task_id']} #{sample['sample']}"
    )
    prompt = _text(sample, "prompt", decode)
    completion = _text(sample, "completion", decode)
    return f"{head}\n  prompt: {prompt!r}\n  reply:  {completion!r}\n"


def _text(sample: dict[str, Any], key: str, decode: Any) -> str:
    """The sample's ``key`` text as written, else its token ids decoded."""
    text = sample.get(key)
    return text if isinstance(text, str) else str(decode(sample[f"{key}_ids"]))


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the last samples of a run."""
    parser = argparse.ArgumentParser(
        prog="python -m areal_grpc.inspect", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("run_dir", type=Path, help="the run's output.dir")
    parser.add_argument("-n", type=int, default=8, help="how many samples (default: %(default)s)")
    args = parser.parse_args(argv)
    config = args.run_dir / "config.yaml"
    if not config.is_file():
        print(f"error: {config} not found: is {args.run_dir} a run's output.dir?", file=sys.stderr)
        return 2
    samples = last_samples(args.run_dir, args.n)
    if not samples:
        print(f"{args.run_dir / ROLLOUTS_DIR} holds no samples (output.rollouts_per_step: 0?)")
        return 0
    tokenizer: Any = None

    def decode(ids: list[int]) -> str:
        # Loaded at the first sample written without text: seconds of torch and transformers.
        nonlocal tokenizer
        if tokenizer is None:
            from areal_grpc.model import load_tokenizer

            tokenizer = load_tokenizer(yaml.safe_load(config.read_text())["model"]["source"])
        return str(tokenizer.decode(ids, skip_special_tokens=False))

    for sample in samples:
        print(render(sample, decode))
    return 0


if __name__ == "__main__":
    sys.exit(main())
