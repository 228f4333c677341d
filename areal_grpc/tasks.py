"""Built-in procedurally generated tasks: datasets deterministic by seed, with their rewards.

Chosen from measurements of what a tiny random-init byte-level model learns with GRPO on a
CPU (32 prompts x 8 samples, temperature 1, lr 1e-3, max 2 new
tokens, reward on the first generated token):

``first3`` (the default)
    Prompt ``"abc="`` (three random lowercase letters), answer ``"a"`` (the first letter).
    26^3 = 17,576 strings, shuffled by seed; the first 200 are the **eval** split and never
    appear in **train**, so eval accuracy measures generalisation to held-out prompts. The
    156K-parameter model reached 0.8 greedy eval accuracy in 30-40 s on one core.
``echo``
    Prompt ``"x="`` with x in 0-9a-z, answer ``"x"``. Only 36 prompts, so eval is the same
    36 prompts (memorisation, no held-out set); it learns fastest (0.8 in about 15 s).

Measured through this package (HFEngine + RLVRWorkflow + a plain in-process GRPO step, 32
prompts x 8, lr 1e-3, max 2 new tokens, one CPU thread shared with other work; greedy eval):
``builtin:micro`` learns ``first3`` to 0.89 held-out accuracy at step 250 (52 s of training)
and 0.97 by step 350; ``echo`` to 0.94 at step 200 (37 s). ``builtin:tiny`` (0.9M) is slower:
``echo`` 0.78 at step 200 (54 s), ``first3`` only 0.39 after 400 steps (200 s). So pair
``first3`` with ``builtin:micro`` when it must learn in about a minute.

Items are plain dicts of strings (``prompt``, ``answer``, ``task``, ``id``), so they fit in a
``google.protobuf.Struct`` unchanged. Both tasks are scored by
:func:`areal_grpc.rewards.first_char_reward`; ``"gsm8k"`` items (from a file, not built in) by
:func:`areal_grpc.rewards.gsm8k_reward`.
"""

from __future__ import annotations

import itertools
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Item = dict[str, Any]

DEFAULT_TASK = "first3"


@dataclass(frozen=True)
class TaskSplits:
    """The two splits of a task; eval prompts never occur in train unless documented."""

    train: list[Item]
    eval: list[Item]


@dataclass(frozen=True)
class TaskInfo:
    """A built-in task: how to build it, how to score it, and how long answers are."""

    name: str
    description: str
    # Short name in areal_grpc.rewards.REWARD_FNS.
    reward_fn: str
    # Enough new tokens for an answer (the reward only reads the first character).
    max_new_tokens: int
    build: Callable[[int], TaskSplits]


def _item(task: str, split: str, index: int, prompt: str, answer: str) -> Item:
    return {"prompt": prompt, "answer": answer, "task": task, "id": f"{task}-{split}-{index}"}


def build_first3(seed: int = 0, n_eval: int = 200) -> TaskSplits:
    """``"abc="`` -> ``"a"``; eval is ``n_eval`` held-out strings chosen by ``seed``."""
    words = ["".join(t) for t in itertools.product(string.ascii_lowercase, repeat=3)]
    random.Random(seed).shuffle(words)
    held_out, rest = words[:n_eval], words[n_eval:]
    return TaskSplits(
        train=[_item("first3", "train", i, f"{w}=", w[0]) for i, w in enumerate(rest)],
        eval=[_item("first3", "eval", i, f"{w}=", w[0]) for i, w in enumerate(held_out)],
    )


def build_echo(seed: int = 0) -> TaskSplits:
    """``"x="`` -> ``"x"`` for x in 0-9a-z; train is seed-shuffled, eval is all 36 in order."""
    chars = string.digits + string.ascii_lowercase
    shuffled = list(chars)
    random.Random(seed).shuffle(shuffled)
    return TaskSplits(
        train=[_item("echo", "train", i, f"{c}=", c) for i, c in enumerate(shuffled)],
        eval=[_item("echo", "eval", i, f"{c}=", c) for i, c in enumerate(chars)],
    )


TASKS: dict[str, TaskInfo] = {
    "first3": TaskInfo(
        name="first3",
        description="'abc=' -> first letter; 200 held-out eval prompts",
        reward_fn="first_char",
        max_new_tokens=2,
        build=build_first3,
    ),
    "echo": TaskInfo(
        name="echo",
        description="'x=' -> x for x in 0-9a-z; eval = the same 36 prompts",
        reward_fn="first_char",
        max_new_tokens=2,
        build=build_echo,
    ),
}


def get_task(name: str) -> TaskInfo:
    """The built-in task called ``name``; ValueError when unknown."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def load_task(name: str = DEFAULT_TASK, seed: int = 0) -> TaskSplits:
    """Both splits of a built-in task, identical for the same ``seed``."""
    return get_task(name).build(seed)


def task_dataset(name: str = DEFAULT_TASK, split: str = "train", seed: int = 0) -> list[Item]:
    """One split (``"train"`` or ``"eval"``) of a built-in task."""
    splits = load_task(name, seed)
    if split == "train":
        return splits.train
    if split == "eval":
        return splits.eval
    raise ValueError(f"unknown split {split!r}; use 'train' or 'eval'")


__all__ = [
    "DEFAULT_TASK",
    "TASKS",
    "Item",
    "TaskInfo",
    "TaskSplits",
    "build_echo",
    "build_first3",
    "get_task",
    "load_task",
    "task_dataset",
]
