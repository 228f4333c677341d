"""Bin packing and partitioning of weighted items (token counts) into groups.

Three algorithms, all returning lists of item indices:

* :func:`ffd_allocate`: AReaL's packing used for micro-batches and dispatch. Despite the name it
  is not classic first-fit: each item (largest first) goes to the fitting group with the
  *fewest items*, and a new group opens only when fewer than ``min_groups`` exist or no group
  can take the item. The output matches AReaL's value for value (the same groups in the same
  order, each with the same values in the same order); which of several *equal* values' indices
  lands where may differ, since ties are taken in index order here and in the order of
  numpy's unstable default sort in AReaL.
* :func:`first_fit_decreasing`: the textbook algorithm (first group in creation order that fits).
* :func:`lpt_partition`: greedy "least loaded" (longest processing time first) into exactly
  ``k`` bins, no capacity.
* :func:`refine_partition`: local search (moves and swaps out of the fullest bin) that lowers
  the largest bin of a partition such as LPT's.

Ordering is deterministic everywhere: items are visited by descending value, ties by ascending
index (a stable sort), so every rank computing the same plan gets the same answer.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ffd_allocate", "first_fit_decreasing", "lpt_partition", "refine_partition"]


def _check_values(values: Sequence[int]) -> list[int]:
    out = [int(v) for v in values]
    for i, v in enumerate(out):
        if v < 0:
            raise ValueError(f"values[{i}] = {v} is negative; sizes must be >= 0")
    return out


def _descending_order(values: Sequence[int]) -> list[int]:
    # Stable: equal values keep ascending index order, so two ranks never disagree on a plan.
    # AReaL's np.argsort(-values) uses numpy's default, unstable sort: its order among equal
    # values depends on the numpy build (numpy 2.4 reorders ties even among 8 items).
    return sorted(range(len(values)), key=lambda i: -values[i])


def _fewest_items_pass(values: list[int], capacity: int, min_groups: int) -> list[list[int]]:
    groups: list[list[int]] = []
    sums: list[int] = []
    for i in _descending_order(values):
        v = values[i]
        if len(groups) < min_groups or min(sums) + v > capacity:
            groups.append([i])
            sums.append(v)
            continue
        # Fewest items first, then lowest sum, then oldest group: AReaL's tie-breaking.
        best = min(
            (g for g in range(len(groups)) if sums[g] + v <= capacity),
            key=lambda g: (len(groups[g]), sums[g], g),
        )
        groups[best].append(i)
        sums[best] += v
    return groups


def ffd_allocate(
    values: Sequence[int], capacity: int, min_groups: int, n_groups_divisor: int = 1
) -> list[list[int]]:
    """Packs item indices into groups of total value <= ``capacity`` (AReaL's "fewest-items fit").

    At least ``min_groups`` groups are made and the group count is a multiple of
    ``n_groups_divisor``. Groups come back in creation order, each group's indices in the
    order they were placed. Raises ValueError when an item exceeds ``capacity`` or there are
    too few items to fill the required number of groups.
    """
    if n_groups_divisor < 1:
        raise ValueError(f"n_groups_divisor must be >= 1, got {n_groups_divisor}")
    if capacity <= 0:
        raise ValueError(f"capacity must be > 0, got {capacity}")
    vals = _check_values(values)
    min_groups = max(min_groups or 0, n_groups_divisor)
    for i, v in enumerate(vals):
        if v > capacity:
            raise ValueError(f"values[{i}] = {v} is larger than capacity {capacity}")
    if len(vals) < min_groups:
        raise ValueError(
            f"number of values ({len(vals)}) is smaller than min_groups ({min_groups}): "
            "every group needs at least one item"
        )
    while True:
        groups = _fewest_items_pass(vals, capacity, min_groups)
        if len(groups) % n_groups_divisor == 0:
            return groups
        # Next multiple of the divisor strictly above the current minimum.
        min_groups += n_groups_divisor - min_groups % n_groups_divisor
        if len(vals) < min_groups:
            raise ValueError(
                f"cannot make a multiple of {n_groups_divisor} groups: {len(vals)} values "
                f"are fewer than the {min_groups} groups needed"
            )


def first_fit_decreasing(values: Sequence[int], capacity: int) -> list[list[int]]:
    """Classic first-fit decreasing: each item (largest first) goes to the first group that fits."""
    if capacity <= 0:
        raise ValueError(f"capacity must be > 0, got {capacity}")
    vals = _check_values(values)
    groups: list[list[int]] = []
    sums: list[int] = []
    for i in _descending_order(vals):
        v = vals[i]
        if v > capacity:
            raise ValueError(f"values[{i}] = {v} is larger than capacity {capacity}")
        for g, s in enumerate(sums):
            if s + v <= capacity:
                groups[g].append(i)
                sums[g] += v
                break
        else:
            groups.append([i])
            sums.append(v)
    return groups


def lpt_partition(values: Sequence[int], k: int) -> list[list[int]]:
    """Greedy least-loaded partition into exactly ``k`` bins (some may be empty).

    Items go largest first to the bin with the smallest sum (ties: lowest bin index); the
    largest bin is at most 4/3 of the optimum (Graham's LPT bound).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    vals = _check_values(values)
    bins: list[list[int]] = [[] for _ in range(k)]
    sums = [0] * k
    for i in _descending_order(vals):
        b = min(range(k), key=lambda j: (sums[j], j))
        bins[b].append(i)
        sums[b] += vals[i]
    return bins


def refine_partition(
    values: Sequence[int], bins: Sequence[Sequence[int]], max_rounds: int = 1000
) -> list[list[int]]:
    """Lowers the fullest bin by moving one item out of it, or swapping one item with another bin.

    Each round applies the single move or swap (with any other bin) that gives the pair the
    lowest new maximum, if that is below the fullest bin's load; it stops when none helps or
    after ``max_rounds``. The largest load never grows and the sum of squared loads falls every
    round, so it terminates. Each bin's indices come back in ascending order.
    """
    vals = _check_values(values)
    plan = [list(b) for b in bins]
    seen = sorted(i for b in plan for i in b)
    if seen != list(range(len(vals))):
        raise ValueError("bins must hold every index of values exactly once")
    loads = [sum(vals[i] for i in b) for b in plan]
    for _ in range(max_rounds):
        if len(plan) < 2:
            break
        hi = max(range(len(plan)), key=lambda b: (loads[b], -b))
        best: tuple[int, int, int, int | None] | None = None  # (new pair max, bin, out, in)
        for lo in range(len(plan)):
            gap = loads[hi] - loads[lo]
            if lo == hi or gap <= 1:
                continue
            for a in plan[hi]:
                # Moving d from hi to lo helps only when 0 < d < gap.
                if 0 < vals[a] < gap:
                    new_max = max(loads[hi] - vals[a], loads[lo] + vals[a])
                    if best is None or new_max < best[0]:
                        best = (new_max, lo, a, None)
                for b in plan[lo]:
                    d = vals[a] - vals[b]
                    if 0 < d < gap:
                        new_max = max(loads[hi] - d, loads[lo] + d)
                        if best is None or new_max < best[0]:
                            best = (new_max, lo, a, b)
        if best is None:
            break
        _, lo, a, b = best
        plan[hi].remove(a)
        plan[lo].append(a)
        loads[hi] -= vals[a]
        loads[lo] += vals[a]
        if b is not None:
            plan[lo].remove(b)
            plan[hi].append(b)
            loads[lo] -= vals[b]
            loads[hi] += vals[b]
    return [sorted(b) for b in plan]
