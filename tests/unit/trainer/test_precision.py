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


def binary_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(KL(p||q), KL(q||p)) of Bernoulli p, q (KPop's metric, algorithms.md)."""

    def kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * (a / b).log() + (1 - a) * ((1 - a) / (1 - b)).log()

    return torch.maximum(kl(p, q), kl(q, p))


def test_kpop_drops_no_token_for_the_bf16_gap_and_still_drops_the_behaviour_it_calls_off(
    make_batch,
):
    """KPop's binary KL between the trainer's and the engine's token probabilities stays far
    under its bound 2 for the bf16 gap (checked from the arithmetic for every trained token);
    5 tokens the engine reports as near-certain (p = 0.999) but the model gives under 0.05 are
    dropped, exactly those."""
    cfg = config(fsdp=False, mixed_precision="on")
    cfg.ppo.rejection = load_config(None, ["algorithm=kpop"]).trainer.ppo.rejection
    assert (cfg.ppo.rejection.metric, cfg.ppo.rejection.upper) == ("binary_kl", 2.0)
    engine = TrainerEngine(cfg, POLICY)
    batch, max_logit = with_exact_behaviour(engine.model, make_batch(seed=5))
    tol = bf16_logprob_tol(max_logit)
    rows, cols = batch["loss_mask"].nonzero(as_tuple=True)
    exact = batch["logprobs"][rows, cols].double().exp()
    for shift in (-tol, tol):
        moved = (exact.log() + shift).exp().clamp(max=1 - 1e-7)
        assert float(binary_kl(moved, exact).max()) < 2.0
    assert TrainerEngine(cfg, POLICY).train_step(dict(batch)).extra["capped_tokens"] == 0
    unlikely = (exact < 0.05).nonzero().flatten()[:5]
    assert len(unlikely) == 5
    shifted = {k: v.clone() for k, v in batch.items()}
    shifted["logprobs"][rows[unlikely], cols[unlikely]] = math.log(0.999)
    assert engine.train_step(shifted).extra["capped_tokens"] == 5


def test_the_clamp_action_leaves_the_bf16_gap_alone_and_clamps_weights_outside_its_bounds(
    make_batch,
):
    """action clamp on IcePop's band: in bf16 the largest behaviour weight is within
    e^(bf16 tolerance) of 1 (nothing clamped); a token whose behaviour probability is 10x too
    small gets weight exactly the upper bound, and nothing is dropped either way."""
    cfg = config(fsdp=False, mixed_precision="on")
    rejection = load_config(None, ["algorithm=icepop"]).trainer.ppo.rejection
    rejection.action = "clamp"
    cfg.ppo.rejection = rejection
    engine = TrainerEngine(cfg, POLICY)
    batch, max_logit = with_exact_behaviour(engine.model, make_batch(seed=5))
    tol = bf16_logprob_tol(max_logit)
    fresh = TrainerEngine(cfg, POLICY).train_step(dict(batch))
    assert fresh.extra["capped_tokens"] == 0
    assert 1.0 <= fresh.importance_weight_max <= math.exp(tol) < rejection.upper
    rows, cols = batch["loss_mask"].nonzero(as_tuple=True)
    shifted = {k: v.clone() for k, v in batch.items()}
    shifted["logprobs"][rows[:5], cols[:5]] -= math.log(10)
    clamped = engine.train_step(shifted)
    assert clamped.extra["capped_tokens"] == 0
    assert clamped.importance_weight_max == pytest.approx(rejection.upper, rel=1e-6)
