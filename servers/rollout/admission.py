"""Which waiting requests join the hf engine's running batch: first come, first served, while
the batch has rows left and its KV cache stays within budget."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["admit", "fits"]

R = TypeVar("R")


def fits(rows: Sequence[R], req: R, budget: int | None, slots: Callable[[R], int]) -> bool:
    """Whether ``req`` joins ``rows`` within ``budget`` KV slots: rows are padded to the
    longest, so the batch holds (rows + 1) x its longest row's ``slots``. A lone row always
    fits (one that never could is refused when it arrives); no budget: always."""
    if budget is None or not rows:
        return True
    longest = max(slots(r) for r in [*rows, req])
    return (len(rows) + 1) * longest <= budget


def admit(
    pending: deque[R],
    running: Sequence[R],
    max_running: int,
    budget: int | None,
    slots: Callable[[R], int],
) -> list[R]:
    """Pops from the front of ``pending`` the requests that join ``running`` this round, in
    arrival order: at most ``max_running`` rows in all, within ``budget`` (see :func:`fits`);
    the first that does not fit waits, and so does everything behind it."""
    admitted: list[R] = []
    room = max_running - len(running)
    while pending and room > 0 and fits([*running, *admitted], pending[0], budget, slots):
        admitted.append(pending.popleft())
        room -= 1
    return admitted
