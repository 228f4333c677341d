"""Reward functions, and the registry that names them (and workflows) in config.

A reward function has the signature of :data:`RewardFn`::

    fn(prompt: str, completion: str, prompt_ids: Sequence[int],
       completion_ids: Sequence[int], item: Mapping[str, Any]) -> float

``item`` is the dataset item the episode was run on (e.g. ``{"prompt": ..., "answer": ...}``).
Config names a reward function by short name (``"gsm8k"``, ``"first_char"``, ``"task"``) or by
import path (``"package.module:name"``); :func:`get_reward_fn` resolves either.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

from areal_grpc.tasks import TASKS

RewardFn = Callable[[str, str, Sequence[int], Sequence[int], Mapping[str, Any]], float]


def import_object(path: str) -> Any:
    """The object named by an import path ``"package.module:attr"`` (``attr`` may be dotted)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path of the form 'package.module:name'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def resolve(name: str, registry: Mapping[str, Any], kind: str) -> Any:
    """``registry[name]`` for a short name, else the object at import path ``name``."""
    if name in registry:
        return registry[name]
    if ":" in name:
        return import_object(name)
    known = ", ".join(sorted(registry))
    raise ValueError(f"unknown {kind} {name!r}; known: {known}, or an import path 'pkg.mod:name'")


# --- GSM8K-style math verification ------------------------------------------------------

# A number as people write it in answers: optional sign, thousands separators, decimals, or a
# simple fraction ("3/4").
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+"
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_HASHES = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def extract_final_number(text: str) -> str | None:
    """The final answer in ``text``: after ``####``, else in ``\\boxed{}``, else the last number.

    Commas and a trailing period are removed (``"1,234."`` -> ``"1234"``); None when ``text``
    holds no number.
    """
    hashes = _HASHES.findall(text)
    if hashes:
        return _clean(hashes[-1])
    boxed = _BOXED.findall(text)
    for inner in reversed(boxed):
        found = _ANY_NUMBER.findall(inner)
        if found:
            return _clean(found[-1])
    found = _ANY_NUMBER.findall(text)
    return _clean(found[-1]) if found else None


def _clean(number: str) -> str:
    return number.replace(",", "").rstrip(".")


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact rational ("12", "-0.5", "3/4"); None when it is not a number."""
    try:
        value = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        return None
    return value


def numbers_equal(a: str, b: str, rel_tol: float = 1e-6) -> bool:
    """True when ``a`` and ``b`` are the same number (exactly, or within ``rel_tol``)."""
    x, y = parse_number(a), parse_number(b)
    if x is None or y is None:
        return False
    if x == y:
        return True
    return math.isclose(float(x), float(y), rel_tol=rel_tol, abs_tol=0.0)


def gsm8k_reward(
    prompt: str,
    completion: str,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    item: Mapping[str, Any],
) -> float:
    """1.0 when the completion's final number equals the item's answer, else 0.0.

    ``item["answer"]`` may be a bare number or a full GSM8K solution ending in ``#### 72``.
    """
    reference = extract_final_number(str(item.get("answer", "")))
    predicted = extract_final_number(completion)
    if reference is None or predicted is None:
        return 0.0
    return 1.0 if numbers_equal(predicted, reference) else 0.0


# --- Built-in task rewards ----------------------------------------------------------------


def first_char_reward(
    prompt: str,
    completion: str,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    item: Mapping[str, Any],
) -> float:
    """1.0 when the completion starts with the item's answer, else 0.0.

    The built-in tasks have one-character answers, so only the first generated token is
    judged; whatever follows (EOS or not) neither helps nor hurts, which is what a tiny
    random-init model can learn quickly.
    """
    answer = str(item.get("answer", ""))
    if not answer:
        return 0.0
    return 1.0 if completion.startswith(answer) else 0.0


def exact_match_reward(
    prompt: str,
    completion: str,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    item: Mapping[str, Any],
) -> float:
    """1.0 when the stripped completion equals the stripped answer, else 0.0."""
    return 1.0 if completion.strip() == str(item.get("answer", "")).strip() else 0.0


def task_reward(
    prompt: str,
    completion: str,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    item: Mapping[str, Any],
) -> float:
    """The reward of the task named by ``item["task"]`` (built-in tasks, ``"gsm8k"``).

    Items without a ``task`` are scored like the built-in tasks (:func:`first_char_reward`).
    """
    task = item.get("task")
    fn = reward_fn_for_task(str(task)) if task else first_char_reward
    return fn(prompt, completion, prompt_ids, completion_ids, item)


# Reward functions of task names that are not built in (their data comes from files).
_EXTERNAL_TASK_REWARDS: dict[str, str] = {"gsm8k": "gsm8k"}


def reward_fn_for_task(name: str) -> RewardFn:
    """The reward function of a task name (built-in, or ``"gsm8k"``)."""
    if name in TASKS:
        return get_reward_fn(TASKS[name].reward_fn)
    if name in _EXTERNAL_TASK_REWARDS:
        return get_reward_fn(_EXTERNAL_TASK_REWARDS[name])
    known = ", ".join(sorted([*TASKS, *_EXTERNAL_TASK_REWARDS]))
    raise ValueError(f"no reward function for task {name!r}; tasks with one: {known}")


REWARD_FNS: dict[str, RewardFn] = {
    "gsm8k": gsm8k_reward,
    "first_char": first_char_reward,
    "exact_match": exact_match_reward,
    "task": task_reward,
}


def get_reward_fn(name: str) -> RewardFn:
    """The reward function for a short name or import path; ValueError when unknown."""
    fn = resolve(name, REWARD_FNS, "reward function")
    if not callable(fn):
        raise ValueError(f"reward function {name!r} is not callable")
    return fn


__all__ = [
    "REWARD_FNS",
    "RewardFn",
    "exact_match_reward",
    "extract_final_number",
    "first_char_reward",
    "get_reward_fn",
    "gsm8k_reward",
    "import_object",
    "numbers_equal",
    "parse_number",
    "resolve",
    "reward_fn_for_task",
    "task_reward",
]
