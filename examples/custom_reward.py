"""A reward function of your own, named in config by import path.

Run it on the built-in ``echo`` task (``"x="`` -> ``"x"``)::

    python -m areal_grpc.coordinator data.task=echo \
        rollout.reward=examples.custom_reward:partial_credit

The rollout servers import ``examples.custom_reward`` (run from the repository root, or put
your module on ``PYTHONPATH``) and call the function once per sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# The scores the function gives, named so that a test (or a reader of the rollouts) can tell
# this reward's values from the built-in 0/1 rewards.
RIGHT = 1.0
RIGHT_KIND = 0.25
WRONG = 0.0


def partial_credit(
    prompt: str,
    completion: str,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    item: Mapping[str, Any],
) -> float:
    """1.0 for the item's answer as the first character, 0.25 for a character of the right
    kind (a letter for a letter, a digit for a digit), else 0.0.

    ``item`` is the dataset item (``prompt``, ``answer``, ``task``, ``id``); a reward may also
    be ``async def`` (a call to a judge, say): the workflow awaits it.
    """
    answer = str(item.get("answer", ""))
    if not answer or not completion:
        return WRONG
    first = completion[0]
    if first == answer[0]:
        return RIGHT
    if first.isdigit() == answer[0].isdigit() and first.isalnum():
        return RIGHT_KIND
    return WRONG
