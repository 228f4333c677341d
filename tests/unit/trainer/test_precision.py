"""bf16 compute in the trainer (``trainer.mixed_precision``): weights and optimizer state stay
fp32, log-probs are fp32 arithmetic on bf16 logits, and the train/rollout gap shows it."""

from __future__ import annotations

import math

import pytest
import torch
from areal_servers.trainer.engine import TrainerEngine

from areal_grpc.config import load_config
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


def test_icepop_drops_no_token_for_the_bf16_gap_and_still_drops_those_outside_its_band(
    make_batch,
):
    """IcePop acts on the train/rollout ratio exp(prox - behaviour): bf16 compute moves it by
    at most e^(bf16 tolerance) (inside IcePop's [0.5, 5] band for these logits), so no fresh
    token is dropped for rounding; tokens whose behaviour probability is 10x off either way
    still are, exactly those (algorithms.md's description of the preset)."""
    cfg = config(fsdp=False, mixed_precision="on")
    cfg.ppo.rejection = load_config(None, ["algorithm=icepop"]).trainer.ppo.rejection
    assert (cfg.ppo.rejection.lower, cfg.ppo.rejection.upper) == (0.5, 5.0)
    engine = TrainerEngine(cfg, POLICY)
    batch, max_logit = with_exact_behaviour(engine.model, make_batch(seed=5))
    tol = bf16_logprob_tol(max_logit)
    assert math.exp(-tol) > 0.5 and math.exp(tol) < 5.0
    rows, cols = batch["loss_mask"].nonzero(as_tuple=True)
    assert TrainerEngine(cfg, POLICY).train_step(dict(batch)).extra["capped_tokens"] == 0
    shifted = {k: v.clone() for k, v in batch.items()}
    # Behaviour 10x more likely (ratio 0.1) on 5 tokens, 10x less likely (ratio 10) on 5.
    shifted["logprobs"][rows[:5], cols[:5]] += math.log(10)
    shifted["logprobs"][rows[5:10], cols[5:10]] -= math.log(10)
    assert bool((shifted["logprobs"] <= 0).all())
    assert engine.train_step(shifted).extra["capped_tokens"] == 10
