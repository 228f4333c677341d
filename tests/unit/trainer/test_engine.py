"""The trainer engine in one plain process: plain steps, gradient accumulation, PPO
mini-batches and epochs, KL terms, the proximal pass (the 2-rank FSDP2 comparisons:
tests/e2e/trainer/test_engine.py)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from areal_servers.trainer.algorithm import compute_advantages, token_logprobs, trainable_mask
from areal_servers.trainer.engine import (
    TrainerEngine,
    lr_factor,
)

from areal_grpc.config import OptimizerSettings, PPOSettings, TrainerConfig
from tests.support.trainer import (
    POLICY,
    config,
    max_diff,
    params,
    ppo_config,
)


def test_warmup_schedule():
    cfg = TrainerConfig(optimizer=OptimizerSettings(lr=1.0, warmup_steps=4, lr_schedule="linear"))
    assert [lr_factor(s, cfg.optimizer, 8) for s in range(9)] == [
        0.25,
        0.5,
        0.75,
        1.0,
        1.0,
        0.75,
        0.5,
        0.25,
        0,
    ]


def test_plain_step_accumulating_microbatches_equals_one_big_microbatch(make_batch):
    # float64: Adam's g / (|g| + eps) turns float32 rounding of near-zero gradient entries
    # into visible parameter noise; in float64 any difference left would be a real bug.
    batch = make_batch()
    whole = TrainerEngine(config(fsdp=False, dtype="float64"), POLICY)
    split = TrainerEngine(config(fsdp=False, max_tokens=24, dtype="float64"), POLICY)
    before = params(whole)
    r1 = whole.train_step(batch)
    r2 = split.train_step(batch)
    assert r1.microbatches == 1 and r2.microbatches >= 4
    assert max_diff(params(whole), params(split)) <= 1e-9
    assert max_diff(params(whole), before) > 1e-4  # the step did change the weights
    assert r1.trained_tokens == r2.trained_tokens == int((batch["loss_mask"][:, 1:]).sum())
    assert r1.loss == pytest.approx(r2.loss, abs=1e-6)
    assert (whole.version, whole.global_step) == (1, 1)
    assert r1.sequences == 8 and r1.reward_mean == pytest.approx(float(batch["rewards"].mean()))


def test_one_minibatch_one_epoch_skips_the_proximal_forward_and_more_updates_do_not(make_batch):
    """With one update the proximal log-probs are the training forward's own (no extra
    pass); with several, later updates run on moved weights, so the proximal pass runs."""
    batch = make_batch(seed=6)
    for n, epochs, extra_pass in [(1, 1, False), (2, 1, True), (1, 2, True)]:
        phases: list[str] = []
        engine = TrainerEngine(ppo_config(fsdp=False, n_minibatches=n, epochs=epochs), POLICY)
        r = engine.train_step(batch, lambda phase, done, total, seen=phases: seen.append(phase))
        assert ("logprobs" in phases) == extra_pass, (n, epochs)
        assert engine.version == 1 and r.policy_version == 1
        assert phases.count("update") == r.microbatches * epochs


def test_kl_penalty_uses_the_initial_policy_as_reference(make_batch):
    def engine(kl: float) -> TrainerEngine:
        cfg = config(fsdp=False, dtype="float64")
        cfg.ppo = PPOSettings(kl_ctl=kl)
        return TrainerEngine(cfg, POLICY)

    batch = make_batch(seed=5)
    # Behaviour log-probs equal to the initial policy's: KL to the reference is 0 everywhere,
    # so the penalty changes nothing.
    with torch.no_grad():
        probe = engine(0.0)
        logp, _ = token_logprobs(
            probe.model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits,
            batch["input_ids"],
        )
    on_policy = dict(batch, logprobs=(logp * batch["loss_mask"]).float())
    plain, penalised = engine(0.0), engine(0.5)
    plain.train_step(on_policy)
    penalised.train_step(on_policy)
    assert max_diff(params(plain), params(penalised)) <= 1e-9
    # Off-policy behaviour log-probs: the penalty now shapes the advantages.
    plain, penalised = engine(0.0), engine(0.5)
    r0, r1 = plain.train_step(batch), penalised.train_step(batch)
    assert max_diff(params(plain), params(penalised)) > 1e-6
    assert r0.extra["advantage_mean"] != pytest.approx(r1.extra["advantage_mean"], abs=1e-6)


def test_kl_loss_pulls_toward_the_initial_policy_from_the_second_step_on(make_batch):
    """k3's value and gradient are 0 where the policy equals the reference: the first step
    with the KL loss is the plain step; after it the policies differ and the loss acts."""

    def engine(beta: float) -> TrainerEngine:
        cfg = config(fsdp=False, dtype="float64")
        cfg.ppo = PPOSettings(kl_loss_coef=beta, kl_loss_estimator="k3")
        return TrainerEngine(cfg, POLICY)

    batch = make_batch(seed=5)
    plain, pulled = engine(0.0), engine(0.5)
    assert plain.ref_model is None and pulled.ref_model is not None
    plain.train_step(batch)
    first = pulled.train_step(batch)
    assert first.extra["kl_loss_mean"] == pytest.approx(0.0, abs=1e-12)
    assert max_diff(params(plain), params(pulled)) <= 1e-9
    plain.train_step(batch)
    second = pulled.train_step(batch)
    assert second.extra["kl_loss_mean"] > 0.0
    assert max_diff(params(plain), params(pulled)) > 1e-9


def test_skipping_the_proximal_forward_changes_nothing_without_dropout(make_batch):
    """The proximal policy is the weights before the step: with no dropout the training
    forward's detached log-probs equal a separate no-grad forward's, so two steps with and
    without that forward end at the same weights (and the skip is taken by default)."""
    torch.manual_seed(0)
    batch = make_batch(n_groups=4, group_size=2, seed=3)
    skipping = TrainerEngine(config(fsdp=False, max_tokens=32), POLICY)
    recomputing = TrainerEngine(config(fsdp=False, max_tokens=32), POLICY)
    assert not skipping._has_dropout
    recomputing._has_dropout = True
    phases: list[str] = []
    for _ in range(2):
        a = skipping.train_step(batch, lambda phase, done, total: phases.append(phase))
        b = recomputing.train_step(batch)
        assert abs(a.loss - b.loss) < 1e-6 and abs(a.grad_norm - b.grad_norm) < 1e-5
    assert "logprobs" not in phases
    assert max_diff(params(skipping), params(recomputing)) < 1e-6


def test_loglinear_skips_the_proximal_pass_and_metrics_trains_as_recompute_and_measures_it(
    make_batch,
):
    """Several updates: "loglinear" approximates the proximal log-probs without the extra
    forward pass (a different, nearby result); "metrics" trains exactly as "recompute" and
    reports how far loglinear would have been."""
    batch = make_batch(seed=7)

    def run(method: str) -> tuple[TrainerEngine, object, list[str]]:
        cfg = ppo_config(fsdp=False, n_minibatches=2, epochs=1)
        cfg.ppo.prox_logp_method = method  # type: ignore[assignment]
        engine = TrainerEngine(cfg, POLICY)
        phases: list[str] = []
        r = engine.train_step(batch, lambda phase, done, total, seen=phases: seen.append(phase))
        return engine, r, phases

    recompute, r_rec, p_rec = run("recompute")
    loglinear, r_log, p_log = run("loglinear")
    metrics, r_met, p_met = run("metrics")
    assert "logprobs" in p_rec and "logprobs" in p_met and "logprobs" not in p_log
    assert max_diff(params(metrics), params(recompute)) == 0.0
    assert 0 < max_diff(params(loglinear), params(recompute)) < 1e-2
    # Version-0 tokens trained by version-0 weights: loglinear takes the behaviour log-probs
    # as proximal (alpha 0), which the test batch perturbed by 0.05 noise.
    assert 0.005 < r_met.extra["prox_approx_abs_error"] < 0.2
    assert r_met.extra["prox_approx_weight_error"] > 0
    assert "prox_approx_abs_error" not in r_rec.extra and "prox_approx_abs_error" not in r_log.extra


@pytest.mark.parametrize(
    "transformers_slices_masks",
    [
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                not hasattr(transformers.modeling_utils, "slice_logits_to_keep"),
                reason=f"transformers {transformers.__version__} takes no boolean "
                "logits_to_keep (vLLM's extra pins transformers < 5.20; the default install "
                "runs this case)",
            ),
        ),
        False,
    ],
)
def test_masked_logits_are_the_full_logits_at_the_kept_positions(
    monkeypatch: pytest.MonkeyPatch, transformers_slices_masks: bool
) -> None:
    """The trainer's logits at the trained positions, on a transformers that slices a boolean
    ``logits_to_keep`` itself and on an older one that raises IndexError on one (5.17 did)."""
    import areal_grpc.model as model_mod

    monkeypatch.setattr(model_mod, "_MASK_LOGITS_TO_KEEP", transformers_slices_masks)
    torch.manual_seed(0)
    model = model_mod.load_model("builtin:micro").eval()
    ids = torch.randint(5, 300, (3, 9))
    attn = torch.ones_like(ids)
    attn[2, :3] = 0  # one left-padded row
    keep = torch.rand(3, 9) > 0.5
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
        got = model_mod.masked_logits(model, ids, attn, keep)
    assert got.shape == (int(keep.sum()), full.shape[-1])
    torch.testing.assert_close(got, full[keep])


# -- the step's phases, one at a time ----------------------------------------------------------


def test_plan_step_counts_the_global_batch_and_cuts_every_row_into_one_microbatch(make_batch):
    batch = make_batch(n_groups=4, group_size=2, seed=5)
    engine = TrainerEngine(ppo_config(fsdp=False, n_minibatches=2, epochs=3, max_tokens=20), POLICY)
    plan = engine.plan_step(batch)
    trained = batch["loss_mask"][:, 1:]
    assert plan.total_tokens == float(trained.sum()) and plan.total_rows == 8.0
    assert plan.total_seqs == float((trained.sum(dim=1) > 0).sum())
    assert plan.reward_sum == pytest.approx(float(batch["rewards"].sum()))
    assert (len(plan.minis), plan.epochs, plan.updates) == (2, 3, 6)
    rows = sorted(r for rows_k, _ in plan.microbatches for r in rows_k)
    assert rows == list(range(8))
    # Each mini-batch's counts are its own rows' (one process: no other rank adds to them).
    for part, (tokens, seqs) in zip(plan.minis, plan.mini_counts, strict=True):
        mine = [r for rows_k, _ in part for r in rows_k]
        assert tokens == float(trained[mine].sum()) and seqs == float(len(mine))
    assert sum(t for t, _ in plan.mini_counts) == plan.total_tokens
    # A micro-batch stays within its token budget (real tokens of its rows).
    for _, mb in plan.microbatches:
        assert int(mb["attention_mask"].sum()) <= 20 or mb["input_ids"].shape[0] == 1


def test_proximal_mode_skips_the_extra_forward_only_when_one_update_has_exact_logprobs(
    make_batch,
):
    batch = make_batch(seed=6)
    one = TrainerEngine(ppo_config(fsdp=False, n_minibatches=1, epochs=1), POLICY)
    assert one.proximal_mode(one.plan_step(batch)) == "exact"
    several = ppo_config(fsdp=False, n_minibatches=2, epochs=1)
    several.ppo.prox_logp_method = "loglinear"
    engine = TrainerEngine(several, POLICY)
    plan = engine.plan_step(batch)
    assert engine.proximal_mode(plan) == "loglinear"
    engine.proximal_logprobs(plan, "loglinear")  # approximated later: no pass, nothing added
    assert all("prox_logp" not in mb for _, mb in plan.microbatches)
    engine.proximal_logprobs(plan, "recompute")
    for _, mb in plan.microbatches:
        want = engine._forward_logprobs(engine.model, mb)[0]
        torch.testing.assert_close(mb["prox_logp"], want)


def test_advantages_phase_gives_each_microbatch_the_rows_of_the_whole_shards_advantages(
    make_batch,
):
    batch = make_batch(n_groups=3, group_size=4, seed=7)
    engine = TrainerEngine(config(fsdp=False, max_tokens=16), POLICY)
    plan = engine.plan_step(batch)
    assert len(plan.microbatches) > 1
    total, squares = engine.advantages(plan)
    train_mask = trainable_mask(batch["loss_mask"], batch["attention_mask"])
    whole = compute_advantages(
        batch["rewards"], train_mask, engine.cfg.ppo, group_index=batch["group_index"]
    )
    assert total == pytest.approx(float((whole.double() * train_mask).sum()), abs=1e-9)
    assert squares == pytest.approx(float((whole.double() ** 2 * train_mask).sum()), rel=1e-9)
    for rows_k, mb in plan.microbatches:
        width = mb["input_ids"].shape[1]
        torch.testing.assert_close(mb["advantages"], whole[rows_k, :width])


def test_update_phase_takes_one_optimizer_step_per_minibatch_and_epoch_and_one_version(
    make_batch,
):
    batch = make_batch(seed=8)
    engine = TrainerEngine(ppo_config(fsdp=False, n_minibatches=2, epochs=2), POLICY)
    plan = engine.plan_step(batch)
    mode = engine.proximal_mode(plan)
    engine.proximal_logprobs(plan, mode)
    engine.advantages(plan)
    steps: list[int] = []
    before = params(engine)
    original = engine.optimizer.step

    def counted(*args, **kwargs):
        steps.append(1)
        return original(*args, **kwargs)

    engine.optimizer.step = counted  # type: ignore[method-assign]
    stats, _, grad_norm = engine.update(plan, mode)
    assert len(steps) == plan.updates == 4
    assert (engine.version, engine.global_step) == (1, 1)
    assert stats.tokens == 2 * plan.total_tokens  # every trained token, once per epoch
    assert grad_norm > 0 and max_diff(params(engine), before) > 0


@pytest.mark.parametrize("n_minibatches", [1, 2])
def test_the_logp_gap_is_measured_on_the_tokens_the_trained_weights_sampled(
    make_batch, n_minibatches
):
    """The engine's log-probs set to the model's own on the tokens of the trained version, one
    of them off by 0.25, and far off on tokens of another version: the gap is that one token's,
    over the fresh tokens only (read off the training forward in one update, off the proximal
    pass with mini-batches)."""
    batch = make_batch()
    engine = TrainerEngine(ppo_config(fsdp=False, n_minibatches=n_minibatches, epochs=1), POLICY)
    model = engine.model
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    exact, _ = token_logprobs(logits.double(), batch["input_ids"])
    mask = trainable_mask(batch["loss_mask"], batch["attention_mask"])
    other = torch.zeros_like(mask)
    other[::2] = mask[::2]  # every other row: sampled by another version
    batch["versions"] = torch.where(other, 7, torch.where(mask, engine.version, -1))
    fresh = mask & ~other
    behave = torch.where(other, exact - 3.0, exact)
    off = fresh.nonzero()[0].tolist()
    behave[off[0], off[1]] -= 0.25
    batch["logprobs"] = behave.float() * batch["loss_mask"]
    extra = engine.train_step(batch).extra
    assert extra["logp_gap_tokens"] == int(fresh.sum())
    # The rest agree to float32 rounding of the engine's log-probs (|logp| < 10: < 1e-6).
    assert extra["logp_gap_max"] == pytest.approx(0.25, abs=1e-5)
    assert extra["logp_gap_mean"] == pytest.approx(0.25 / int(fresh.sum()), abs=1e-5)
    d = 0.25  # k3 = e^d - 1 - d of the one token off
    assert extra["logp_gap_kl"] == pytest.approx((math.exp(d) - 1 - d) / int(fresh.sum()), rel=1e-3)
