"""Token-budget micro-batches (AReaL's ``split_padded_tensor_dict_into_mb_list``,
``areal/utils/data.py``).

A rank's shard is packed with :func:`areal_grpc.ffd.ffd_allocate` into micro-batches of at
most ``max_tokens_per_mb`` real tokens. FSDP runs collectives in every forward and backward,
so all ranks must run the *same number* of micro-batches: the count is agreed with an
all-reduce (max) and ranks with fewer sequences (or none) run empty micro-batches, which
are a dummy row whose loss is exactly zero but still takes part in every collective.

Gradient accumulation scales each micro-batch loss by ``1 / N`` with ``N`` the trainable
tokens of the *global* batch (all ranks, all micro-batches), see
:func:`areal_servers.trainer.algorithm.ppo_loss`, so the accumulated gradient is that of the
global token mean whatever the packing.

With prefix sharing (``MicroBatchSpec.share_prefixes``) the packed items are groups, not
rows: a group's rows stay in one micro-batch, where their shared prefix is computed once, and
the budget counts what that computes, the nodes of the group's trie
(:func:`areal_grpc.prefixes.prefix_nodes`); a group over the budget is packed row by row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from areal_grpc.ffd import ffd_allocate
from areal_grpc.prefixes import prefix_nodes

Batch = dict[str, torch.Tensor]

# Element-wise max of small int lists over ranks (identity on one process).
ReduceMax = Callable[[list[int]], list[int]]

# Keys with one value per token ([B, S]); everything else with a batch dim is per row ([B]).
TOKEN_KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions")


@dataclass
class MicroBatchSpec:
    """How a shard is cut into micro-batches."""

    # Real (attention-mask) tokens per micro-batch; None: no budget (one micro-batch).
    max_tokens_per_mb: int | None = None
    # At least this many micro-batches per rank.
    min_mbs: int = 1
    # Keep each group's rows together and count its trie's nodes against the budget (the
    # trainer computes each shared prefix once).
    share_prefixes: bool = False


def _no_reduce(values: list[int]) -> list[int]:
    return values


def plan_microbatches(
    seqlens: Sequence[int], spec: MicroBatchSpec, reduce_max: ReduceMax = _no_reduce
) -> list[list[int]]:
    """Row indices of each micro-batch; the count is equal on every rank (empty lists pad).

    Every rank must call this once per step with the same ``spec`` (it runs collectives).
    Raises ValueError when a sequence is longer than the budget.
    """
    capacity = spec.max_tokens_per_mb if spec.max_tokens_per_mb is not None else 1 << 62
    n = max(spec.min_mbs, 1)
    while True:
        groups = ffd_allocate(list(seqlens), capacity, min(n, len(seqlens))) if seqlens else []
        groups = [sorted(g) for g in groups] + [[] for _ in range(n - len(groups))]
        # One collective per round: the max count and (negated) the min count.
        hi, neg_lo = reduce_max([len(groups), -len(groups)])
        if hi == -neg_lo:
            return groups
        # Some rank needs more micro-batches: everyone retries with at least that many.
        n = hi


def dummy_microbatch(pad_token_id: int = 0, device: torch.device | None = None) -> Batch:
    """A one-row micro-batch with nothing to train: joins the collectives, adds zero loss."""
    return {
        "input_ids": torch.full((1, 2), pad_token_id, dtype=torch.int64, device=device),
        "attention_mask": torch.ones(1, 2, dtype=torch.bool, device=device),
        "loss_mask": torch.zeros(1, 2, dtype=torch.bool, device=device),
        "logprobs": torch.zeros(1, 2, dtype=torch.float32, device=device),
        "versions": torch.full((1, 2), -1, dtype=torch.int64, device=device),
    }


def select_rows(batch: Batch, rows: Sequence[int]) -> Batch:
    """The given rows of a padded batch, trimmed to their longest sequence.

    Per-token tensors are cut to ``[len(rows), S']``; per-row tensors ([B]) follow the rows;
    other per-token tensors the caller added (advantages, proximal log-probs) too.
    """
    index = torch.as_tensor(list(rows), dtype=torch.int64)
    b, s = batch["attention_mask"].shape
    width = int(batch["attention_mask"][index].sum(dim=1).max()) if len(rows) else 0
    out: Batch = {}
    for key, value in batch.items():
        if value.dim() >= 2 and value.shape[:2] == (b, s):
            out[key] = value[index, :width]
        elif value.dim() >= 1 and value.shape[0] == b:
            out[key] = value[index]
        else:
            out[key] = value
    return out


def plan_minibatches(tokens: Sequence[int], n: int) -> list[list[int]]:
    """Row indices of ``n`` PPO mini-batches: contiguous runs of rows, balanced by tokens.

    Row ``i`` goes to mini-batch ``floor(n * (tokens before i + tokens[i] / 2) / total)``, so
    each gets about ``total / n`` tokens and the rows keep their order; with no tokens the
    rows are split by count. Some mini-batches may be empty (fewer rows than ``n``); every
    rank gets ``n`` lists.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    weights = [float(t) for t in tokens]
    total = sum(weights)
    if total <= 0:
        weights, total = [1.0] * len(weights), float(len(weights))
    out: list[list[int]] = [[] for _ in range(n)]
    before = 0.0
    for i, w in enumerate(weights):
        out[min(n - 1, int(n * (before + w / 2) / total))].append(i)
        before += w
    return out


def _units(
    batch: Batch, subset: list[int], seqlens: list[int], share: bool, capacity: int | None
) -> tuple[list[list[int]], list[int]]:
    """What micro-batches are packed from, and what each costs: the rows by their tokens; with
    prefix sharing the rows of each group together, by their trie's nodes (what the packed
    forward computes), a group over the budget row by row."""
    if not share or "group_index" not in batch:
        return [[i] for i in subset], [seqlens[i] for i in subset]
    groups: dict[int, list[int]] = {}
    for i, g in zip(subset, batch["group_index"][subset].tolist(), strict=True):
        groups.setdefault(int(g), []).append(i)
    units, costs = [], []
    ids = batch["input_ids"]
    for members in groups.values():
        cost = prefix_nodes([ids[i, : seqlens[i]].tolist() for i in members])
        if capacity is not None and cost > capacity and len(members) > 1:
            units += [[i] for i in members]
            costs += [seqlens[i] for i in members]
        else:
            units.append(members)
            costs.append(cost)
    return units, costs


def split_microbatches(
    batch: Batch | None,
    spec: MicroBatchSpec,
    reduce_max: ReduceMax = _no_reduce,
    pad_token_id: int = 0,
    rows: Sequence[int] | None = None,
) -> list[tuple[list[int], Batch]]:
    """(rows, micro-batch) pairs for a shard (``None``: an empty shard), same count on all ranks.

    ``rows``: only those rows of the shard (a PPO mini-batch); the pairs name shard rows.
    Empty micro-batches come back as ``([], dummy_microbatch())``.
    """
    seqlens = [] if batch is None else [int(n) for n in batch["attention_mask"].sum(dim=1)]
    subset = list(range(len(seqlens))) if rows is None else list(rows)
    units: list[list[int]] = []
    costs: list[int] = []
    if batch is not None:
        units, costs = _units(batch, subset, seqlens, spec.share_prefixes, spec.max_tokens_per_mb)
    plan = plan_microbatches(costs, spec, reduce_max)
    out: list[tuple[list[int], Batch]] = []
    for picked in plan:
        chosen = sorted(row for u in picked for row in units[u])
        if chosen:
            assert batch is not None
            out.append((chosen, select_rows(batch, chosen)))
        else:
            out.append(([], dummy_microbatch(pad_token_id)))
    return out


def padding_waste(seqlens: Sequence[int], plan: Sequence[Sequence[int]]) -> float:
    """Fraction of padded token slots (rows x longest row per micro-batch) that are padding."""
    slots = sum(len(rows) * max((seqlens[i] for i in rows), default=0) for rows in plan)
    real = sum(seqlens[i] for rows in plan for i in rows)
    return 1.0 - real / slots if slots else 0.0
