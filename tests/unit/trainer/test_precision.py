"""bf16 compute in the trainer (``trainer.mixed_precision``): weights and optimizer state stay
fp32, log-probs are fp32 arithmetic on bf16 logits, and the train/rollout gap shows it."""

from __future__ import annotations

import math

import pytest
import torch
from areal_servers.trainer.engine import TrainerEngine

from areal_grpc.precision import bf16_compute
from tests.support.precision import FP32_GAP, bf16_logprob_tol
from tests.support.trainer import POLICY, config, with_exact_behaviour


@pytest.mark.parametrize(
    ("setting", "dtype", "device", "on"),
    [
        ("on", "float32", "cpu", True),
        ("off", "float32", "cpu", False),
        ("auto", "float64", "cpu", False),
    ],
)
def test_mixed_precision_settings_that_do_not_depend_on_the_hardware(setting, dtype, device, on):
    assert bf16_compute(setting, dtype, device)[0] is on


def test_bf16_compute_without_fsdp_keeps_fp32_weights_and_state_and_shows_its_gap(make_batch):
    """One plain process (autocast): after a step every weight and Adam moment is fp32, and
    the log-probs the step computed differ from fp32 ones by bf16 rounding, not more, and not
    by float32 rounding only."""
    engine = TrainerEngine(config(fsdp=False, mixed_precision="on"), POLICY)
    assert engine.mixed_precision
    batch, max_logit = with_exact_behaviour(engine.model, make_batch(seed=3))
    result = engine.train_step(batch)
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    moments = [t for st in engine.optimizer.state.values() for t in st.values() if t.ndim > 0]
    assert moments and {t.dtype for t in moments} == {torch.float32}
    assert FP32_GAP < result.extra["logp_gap_max"] <= bf16_logprob_tol(max_logit)
    assert math.isfinite(result.loss)


def test_the_same_step_in_fp32_finds_no_gap(make_batch):
    engine = TrainerEngine(config(fsdp=False, mixed_precision="off"), POLICY)
    batch, _ = with_exact_behaviour(engine.model, make_batch(seed=3))
    assert engine.train_step(batch).extra["logp_gap_max"] <= FP32_GAP
