"""Token-budget micro-batch planning: budget respected, rows kept, counts agreed over ranks."""

from __future__ import annotations

import threading

import pytest
import torch
from areal_servers.trainer.microbatch import (
    MicroBatchSpec,
    dummy_microbatch,
    padding_waste,
    plan_microbatches,
    plan_minibatches,
    select_rows,
    split_microbatches,
)


def test_plan_respects_the_budget_and_covers_every_row_once():
    seqlens = [30, 7, 12, 25, 5, 18, 9, 40, 3, 11]
    plan = plan_microbatches(seqlens, MicroBatchSpec(max_tokens_per_mb=50))
    assert sorted(i for mb in plan for i in mb) == list(range(len(seqlens)))
    assert all(sum(seqlens[i] for i in mb) <= 50 for mb in plan)
    assert len(plan) == 4  # 160 tokens need at least 4 micro-batches of 50
    assert all(mb == sorted(mb) for mb in plan)


def test_plan_without_budget_is_one_microbatch_unless_more_are_asked_for():
    assert plan_microbatches([4, 5, 6], MicroBatchSpec()) == [[0, 1, 2]]
    plan = plan_microbatches([4, 5, 6], MicroBatchSpec(min_mbs=2))
    assert len(plan) == 2 and sorted(i for mb in plan for i in mb) == [0, 1, 2]


def test_a_sequence_longer_than_the_budget_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        plan_microbatches([10, 60], MicroBatchSpec(max_tokens_per_mb=50))


def run_ranks(shards, spec):
    """Plans each shard on its own thread with a max-reducer shared like an all-reduce."""
    world = len(shards)
    barrier = threading.Barrier(world)
    slots: list[list[int] | None] = [None] * world
    results: list[list[list[int]] | None] = [None] * world
    lock = threading.Lock()

    def worker(rank):
        def reduce_max(values):
            with lock:
                slots[rank] = values
            barrier.wait()
            out = [max(s[k] for s in slots) for k in range(len(values))]
            barrier.wait()
            return out

        results[rank] = plan_microbatches(shards[rank], spec, reduce_max)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_every_rank_gets_the_same_number_of_microbatches():
    spec = MicroBatchSpec(max_tokens_per_mb=20)
    shards = [[19, 18, 17, 2], [5, 5], []]
    plans = run_ranks(shards, spec)
    assert [len(p) for p in plans] == [3, 3, 3]
    for shard, plan in zip(shards, plans, strict=True):
        assert sorted(i for mb in plan for i in mb) == list(range(len(shard)))
        assert all(sum(shard[i] for i in mb) <= 20 for mb in plan)
    assert plans[2] == [[], [], []]


def test_split_gives_trimmed_microbatches_and_dummies_for_an_empty_shard():
    batch = {
        "input_ids": torch.arange(12).view(3, 4),
        "attention_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]).bool(),
        "loss_mask": torch.tensor([[0, 1, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0]]).bool(),
        "rewards": torch.tensor([1.0, 2.0, 3.0]),
    }
    mbs = split_microbatches(batch, MicroBatchSpec(max_tokens_per_mb=4))
    assert [rows for rows, _ in mbs] == [[1], [0, 2]]
    _, small = mbs[1]
    assert small["input_ids"].tolist() == [[0, 1], [8, 9]]  # trimmed to width 2
    assert small["rewards"].tolist() == [1.0, 3.0]
    empty = split_microbatches(None, MicroBatchSpec(min_mbs=2))
    assert [rows for rows, _ in empty] == [[], []]
    assert not empty[0][1]["loss_mask"].any()
    assert select_rows(batch, [2])["input_ids"].tolist() == [[8]]
    assert dummy_microbatch()["input_ids"].shape == (1, 2)


def test_padding_waste_counts_pad_slots():
    assert padding_waste([4, 2, 3], [[0, 1], [2]]) == pytest.approx(1 - 9 / 11)
    assert padding_waste([4, 4], [[0, 1]]) == 0.0


def test_minibatches_are_contiguous_token_balanced_and_one_list_each():
    assert plan_minibatches([5, 5, 5, 5], 2) == [[0, 1], [2, 3]]
    # Balanced by tokens, not rows: the long row gets a mini-batch of its own.
    assert plan_minibatches([30, 5, 5, 5, 5], 2) == [[0], [1, 2, 3, 4]]
    # Fewer rows than mini-batches: some are empty, but there are always n lists.
    assert plan_minibatches([4, 4], 4) == [[], [0], [], [1]]
    assert plan_minibatches([], 3) == [[], [], []]
    # No trainable tokens at all: split by rows.
    assert plan_minibatches([0, 0, 0, 0], 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError):
        plan_minibatches([1], 0)
