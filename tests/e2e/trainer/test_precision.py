"""bf16 compute on two FSDP2 ranks (``trainer.mixed_precision=on``): the policy casts the
parameters to bf16 for the forward and backward only."""

from __future__ import annotations

import pytest

from areal_grpc.model import load_model
from tests.support.precision import FP32_GAP, bf16_logprob_tol
from tests.support.trainer import (
    POLICY,
    config,
    two_ranks,
    with_exact_behaviour,
)


def test_bf16_compute_on_two_fsdp2_ranks_reduces_and_steps_in_fp32(make_batch):
    """FSDP2's policy casts the parameters to bf16 for the forward and backward only: the
    gathered weights after the step are fp32, the gap is bf16 rounding, and both ranks agree
    on the step."""
    model = load_model(POLICY.source, seed=POLICY.seed)
    batch, max_logit = with_exact_behaviour(model, make_batch(seed=4))
    half = batch["input_ids"].shape[0] // 2
    shards = [[{k: v[:half] for k, v in batch.items()}, {k: v[half:] for k, v in batch.items()}]]
    for shard in shards[0]:
        shard["group_index"] = shard["group_index"] - shard["group_index"].min()
    got = two_ranks(shards, config(fsdp=True, mixed_precision="on"))
    (r0,), state = got[0]
    (r1,), _ = got[1]
    assert state is not None and {v.dtype.name for v in state.values()} == {"float32"}
    assert r0.loss == pytest.approx(r1.loss)
    assert FP32_GAP < r0.extra["logp_gap_max"] <= bf16_logprob_tol(max_logit)
