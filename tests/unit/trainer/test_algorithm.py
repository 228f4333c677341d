"""The GRPO / decoupled-PPO math against element-by-element reference computations.

The references are written here from AReaL's formulas (``areal/trainer/ppo/actor.py`` and
``areal/utils/functional/functional.py`` at commit cbff54d6) with Python loops over plain
floats, independent of the vectorised code under test.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from areal_servers.trainer.algorithm import (
    behaviour_weights,
    compute_advantages,
    gap_stats,
    kl_estimate,
    loglinear_prox_logp,
    logp_gap,
    masked_token_logprobs,
    normalize,
    overlong_penalty,
    ppo_loss,
    shape_rewards,
    token_logprobs,
    trainable_mask,
)

from areal_grpc.config import NormSettings, PPOSettings, RejectionSettings, load_config
from areal_grpc.errors import FieldError

# Off switches as the run config spells them.
NO_NORM = NormSettings("none", "none")
NO_REJECTION = RejectionSettings(metric="none")


def ref_normalize(xs, masks, groups, cfg: NormSettings):
    """Loop version of AReaL's Normalization over rows ``xs`` (lists) with ``masks``."""
    rows = len(xs)

    def members(i, level):
        return [j for j in range(rows) if level == "batch" or groups[j] == groups[i]]

    def valid(rows_):
        return [(j, t) for j in rows_ for t in range(len(xs[j])) if masks[j][t]]

    out = [[0.0] * len(x) for x in xs]
    for i in range(rows):
        for t in range(len(xs[i])):
            if not masks[i][t]:
                continue
            if cfg.mean_level == "none":
                mean = 0.0
            else:
                vals = [xs[j][u] for j, u in valid(members(i, cfg.mean_level))]
                if cfg.mean_leave1out:
                    n = len(vals)
                    mean = (sum(vals) - xs[i][t]) / (n - 1) if n > 1 else xs[i][t]
                else:
                    mean = sum(vals) / len(vals)
            if cfg.std_level == "none":
                out[i][t] = xs[i][t] - mean
                continue
            # The std of the centred values of the std level's set, each centred by its own
            # mean (leave-one-out means differ per element).
            sq, n = 0.0, 0
            for j, u in valid(members(i, cfg.std_level)):
                if cfg.mean_level == "none":
                    mj = 0.0
                else:
                    vals_j = [xs[k][w] for k, w in valid(members(j, cfg.mean_level))]
                    if cfg.mean_leave1out:
                        mj = (
                            (sum(vals_j) - xs[j][u]) / (len(vals_j) - 1)
                            if len(vals_j) > 1
                            else xs[j][u]
                        )
                    else:
                        mj = sum(vals_j) / len(vals_j)
                sq += (xs[j][u] - mj) ** 2
                n += 1
            denom = n - 1 if cfg.std_unbiased else n
            std = math.sqrt(sq / denom) if denom > 0 else 1.0
            out[i][t] = (xs[i][t] - mean) / (std + cfg.eps)
    return out


LEVELS = [
    NormSettings("group", "group"),
    NormSettings("batch", "batch"),
    NormSettings("group", "batch"),
    NormSettings("group", "none"),
    NormSettings("group", "none", mean_leave1out=True),
    NormSettings("batch", "group", std_unbiased=False),
    NormSettings("none", "batch"),
]


@pytest.mark.parametrize("cfg", LEVELS, ids=lambda c: f"{c.mean_level}-{c.std_level}")
def test_normalize_matches_reference_on_rows_and_tokens(cfg):
    gen = torch.Generator().manual_seed(1)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3])
    x = torch.randn(8, 5, generator=gen)
    mask = torch.rand(8, 5, generator=gen) > 0.3
    mask[6] = False  # a row with no valid tokens
    got = normalize(x, cfg, mask=mask, group_index=groups)
    want = ref_normalize(x.tolist(), mask.tolist(), groups.tolist(), cfg)
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-5, rtol=1e-5)
    # Sequence-level ([B]) normalisation of rewards, no mask.
    r = torch.randn(8, generator=gen)
    got_r = normalize(r, cfg, group_index=groups)
    want_r = ref_normalize([[v] for v in r.tolist()], [[True]] * 8, groups.tolist(), cfg)
    torch.testing.assert_close(got_r, torch.tensor([w[0] for w in want_r]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cfg", LEVELS, ids=lambda c: f"{c.mean_level}-{c.std_level}")
def test_equal_rewards_in_a_group_give_zero_advantage_never_nan(cfg):
    # Group 0: all equal; group 1: a single member; group 2: varied.
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.5, 0.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 2, 2])
    out = normalize(rewards, cfg, group_index=groups)
    assert torch.isfinite(out).all()
    if cfg.mean_level == "group":
        assert out[:4].abs().max() == 0.0
        assert out[4] < 0 < out[5]


def test_batch_level_statistics_are_summed_over_ranks():
    # Two "ranks" with halves of a batch: reducing their sums must equal the whole batch.
    x = torch.tensor([0.0, 1.0, 3.0, 7.0])
    cfg = NormSettings("batch", "batch")
    whole = normalize(x, cfg)
    # The mean pass gives the other half's (sum, count); the std pass needs its squared sum,
    # so emulate the second collective with the known global mean.
    mean = x.double().mean()
    calls = []

    def reduce_left(t):
        calls.append(t)
        if len(calls) == 1:
            return t + torch.stack([x[2:].double().sum(), torch.tensor(2.0, dtype=torch.float64)])
        return t + torch.stack(
            [((x[2:].double() - mean) ** 2).sum(), torch.tensor(2.0, dtype=torch.float64)]
        )

    left = normalize(x[:2], cfg, reduce=reduce_left)
    torch.testing.assert_close(left, whole[:2])


def test_shape_rewards_bias_scale_clip():
    r = torch.tensor([0.0, 1.0, 5.0, -5.0])
    got = shape_rewards(r, PPOSettings(reward_bias=-0.5, reward_scale=10.0, reward_clip=20.0))
    assert got.tolist() == [-5.0, 5.0, 20.0, -20.0]
    assert shape_rewards(r, PPOSettings(reward_clip=math.inf)).tolist() == r.tolist()


def test_advantages_put_the_normalised_reward_on_every_generated_token():
    loss_mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 1])
    cfg = PPOSettings(reward_scale=2.0, reward_clip=math.inf)
    adv = compute_advantages(rewards, loss_mask, cfg, group_index=groups)
    r = [2.0, 0.0]
    mean, std = 1.0, math.sqrt(((2 - 1) ** 2 + (0 - 1) ** 2) / 1)
    want = torch.zeros(3, 5)
    want[0, 2:4] = (r[0] - mean) / (std + 1e-5)
    want[1, 1:5] = (r[1] - mean) / (std + 1e-5)
    torch.testing.assert_close(adv, want)  # group 2 has one member: zero advantage


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_is_a_return_to_go_reward(estimator):
    gen = torch.Generator().manual_seed(3)
    loss_mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    behave = -torch.rand(2, 5, generator=gen) * 3
    ref = -torch.rand(2, 5, generator=gen) * 3
    rewards = torch.tensor([1.0, -1.0])
    cfg = PPOSettings(kl_ctl=0.3, kl_estimator=estimator, reward_norm=NO_NORM)
    adv = compute_advantages(rewards, loss_mask, cfg, behave_logp=behave, ref_logp=ref)
    for i in range(2):
        for t in range(5):
            if not loss_mask[i, t]:
                assert adv[i, t] == 0
                continue
            total = float(rewards[i])
            for u in range(t, 5):
                if loss_mask[i, u]:
                    x = float(behave[i, u] - ref[i, u])
                    kl = {"k1": x, "k2": x * x / 2, "k3": math.exp(-x) - 1 + x}[estimator]
                    # The estimate is clamped to [-10, 10], then scaled.
                    total += -0.3 * max(-10.0, min(10.0, kl))
            assert adv[i, t].item() == pytest.approx(total, abs=1e-5)


def test_kl_estimators_match_their_formulas():
    a, b = torch.tensor([-0.2, -1.5]), torch.tensor([-0.7, -0.1])
    x = (a - b).tolist()
    assert kl_estimate(a, b, "k1").tolist() == pytest.approx(x)
    assert kl_estimate(a, b, "k2").tolist() == pytest.approx([v * v / 2 for v in x])
    assert kl_estimate(a, b, "k3").tolist() == pytest.approx([math.exp(-v) - 1 + v for v in x])


def test_token_logprobs_shift_logits_to_the_token_they_predict():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 7, generator=gen)
    ids = torch.randint(0, 7, (2, 4), generator=gen)
    logp, ent = token_logprobs(logits, ids, temperature=0.5)
    for i in range(2):
        assert logp[i, 0] == 0 and ent[i, 0] == 0
        for t in range(1, 4):
            probs = torch.softmax(logits[i, t - 1] / 0.5, -1)
            assert logp[i, t].item() == pytest.approx(math.log(probs[ids[i, t]]), abs=1e-5)
            want_h = -sum(p * math.log(p) for p in probs.tolist())
            assert ent[i, t].item() == pytest.approx(want_h, abs=1e-5)


def test_trainable_mask_drops_token_zero_and_padding():
    loss = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    attn = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)
    assert trainable_mask(loss, attn).tolist() == [
        [False, True, True, False],
        [False, True, True, False],
    ]


def ref_token_loss(theta, prox, behave, adv, cfg: PPOSettings):
    """(loss, kept, clipped, w) of one token straight from AReaL's ``ppo_actor_loss_fn``."""
    ratio = math.exp(theta - prox)
    hi = cfg.eps_clip if cfg.eps_clip_higher is None else cfg.eps_clip_higher
    clipped_ratio = min(max(ratio, 1 - cfg.eps_clip), 1 + hi)
    pg1, pg2 = -adv * ratio, -adv * clipped_ratio
    loss = max(pg1, pg2)
    if cfg.c_clip is not None:
        loss = min(loss, cfg.c_clip * abs(adv))
    w, kept = 1.0, True
    rej = cfg.rejection
    if rej.metric != "none":
        w = math.exp(prox - behave)
        lower = rej.lower if rej.lower is not None else 0.0
        if rej.action == "mask" and not lower <= w <= rej.upper:
            kept, w = False, 0.0
        elif rej.action == "clamp":
            w = min(max(w, lower), rej.upper)
        loss *= w
    return (loss if kept else 0.0), kept, pg2 > pg1, w


PPO_CONFIGS = [
    PPOSettings(),
    PPOSettings(eps_clip=0.1, eps_clip_higher=0.3),
    PPOSettings(c_clip=3.0),
    PPOSettings(rejection=RejectionSettings(upper=1.5, action="clamp")),
    PPOSettings(rejection=RejectionSettings(upper=1.2), c_clip=2.0),
    # IcePop: both bounds, masked.
    PPOSettings(rejection=RejectionSettings(lower=0.8, upper=1.2)),
    PPOSettings(rejection=RejectionSettings(lower=0.8, upper=1.3, action="clamp")),
    PPOSettings(rejection=NO_REJECTION),
]


@pytest.mark.parametrize("cfg", PPO_CONFIGS, ids=range(len(PPO_CONFIGS)))
def test_ppo_loss_matches_reference_and_its_gradient(cfg):
    gen = torch.Generator().manual_seed(7)
    b, s = 3, 6
    prox = -torch.rand(b, s, generator=gen) * 2
    theta = (prox + torch.randn(b, s, generator=gen) * 0.4).requires_grad_(True)
    behave = prox + torch.randn(b, s, generator=gen) * 0.4
    adv = torch.randn(b, s, generator=gen)
    mask = torch.rand(b, s, generator=gen) > 0.3
    mask[2] = False
    # Padding positions may hold anything, even values whose exp overflows.
    theta.data[~mask] += 200.0
    entropy = torch.rand(b, s, generator=gen)
    total = 40.0  # global token count (other ranks / micro-batches hold the rest)
    loss, stats = ppo_loss(theta, prox, behave, adv, mask, cfg, total, entropy)
    loss.backward()
    want_loss, clipped, w_sum, w_max, kept_n = 0.0, 0, 0.0, 0.0, 0
    want_grad = torch.zeros(b, s)
    h = 1e-3
    for i in range(b):
        for t in range(s):
            if not mask[i, t]:
                continue
            args = (
                float(theta.detach()[i, t]),
                float(prox[i, t]),
                float(behave[i, t]),
                float(adv[i, t]),
            )
            ell, kept, was_clipped, w = ref_token_loss(*args, cfg)
            want_loss += ell / total
            clipped += int(was_clipped)
            if kept:
                kept_n += 1
                w_sum += w
                w_max = max(w_max, w)
            up = ref_token_loss(args[0] + h, *args[1:], cfg)[0]
            down = ref_token_loss(args[0] - h, *args[1:], cfg)[0]
            want_grad[i, t] = (up - down) / (2 * h) / total
    assert loss.item() == pytest.approx(want_loss, abs=1e-6)
    assert stats.loss == pytest.approx(want_loss, abs=1e-6)
    assert stats.tokens == int(mask.sum())
    assert stats.clipped_tokens == clipped
    assert stats.imp_weight_max == pytest.approx(w_max if kept_n else 0.0, abs=1e-6)
    if cfg.rejection.metric != "none":
        assert stats.imp_weight_mean == pytest.approx(w_sum / kept_n, abs=1e-6)
    assert stats.entropy_sum == pytest.approx(float((entropy * mask).sum()), abs=1e-5)
    assert torch.isfinite(theta.grad).all()
    torch.testing.assert_close(theta.grad, want_grad, atol=2e-4, rtol=1e-3)


def test_microbatch_losses_sum_to_the_global_token_mean():
    gen = torch.Generator().manual_seed(11)
    prox = -torch.rand(4, 5, generator=gen)
    theta = prox + 0.1 * torch.randn(4, 5, generator=gen)
    adv = torch.randn(4, 5, generator=gen)
    mask = torch.rand(4, 5, generator=gen) > 0.2
    cfg = PPOSettings(rejection=NO_REJECTION)
    total = float(mask.sum())
    whole, _ = ppo_loss(theta, prox, prox, adv, mask, cfg, total)
    parts = [
        ppo_loss(theta[r], prox[r], prox[r], adv[r], mask[r], cfg, total)[0]
        for r in (slice(0, 1), slice(1, 3), slice(3, 4))
    ]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), abs=1e-6)
    per_token = torch.maximum(
        -adv * torch.exp(theta - prox), -adv * torch.exp(theta - prox).clamp(0.8, 1.2)
    )
    assert whole.item() == pytest.approx(float(per_token[mask].mean()), abs=1e-6)


def test_masked_token_logprobs_equal_the_full_ones_where_trained_with_the_same_gradient():
    """Only the trained positions go through the vocabulary: their log-probs, entropies and
    gradients equal the full computation's; every other position is 0."""
    torch.manual_seed(0)
    b, s, v, h = 3, 7, 11, 5
    hidden = torch.randn(b, s, h, requires_grad=True)
    head = torch.randn(v, h)
    ids = torch.randint(0, v, (b, s))
    mask = torch.rand(b, s) > 0.4
    mask[:, 0] = True  # position 0 is never trained, even when masked in

    full_lp, full_ent = token_logprobs(hidden @ head.T, ids, temperature=0.7)
    calls = []

    def forward(keep):
        calls.append(keep.clone())
        return hidden[keep] @ head.T

    lp, ent = masked_token_logprobs(forward, ids, mask, temperature=0.7)
    trained = mask.clone()
    trained[:, 0] = False
    assert int(calls[0].sum()) == int(trained.sum())
    torch.testing.assert_close(lp[trained], full_lp[trained])
    torch.testing.assert_close(ent[trained], full_ent[trained])
    assert not lp[~trained].any() and not ent[~trained].any()
    (g_masked,) = torch.autograd.grad((lp * 1.3).sum(), hidden)
    (g_full,) = torch.autograd.grad((full_lp * trained * 1.3).sum(), hidden)
    torch.testing.assert_close(g_masked, g_full)


def test_loglinear_prox_moves_each_token_toward_the_current_policy_by_its_staleness():
    # Proximal weights are version 3. Tokens: a prompt token (no version), one made by
    # version 3 itself, one by 2, one by 0, and one claiming a newer version 4.
    versions = torch.tensor([[-1, 3, 2, 0, 4]])
    behave = torch.full((1, 5), -1.0)
    current = torch.full((1, 5), -2.0)
    got = loglinear_prox_logp(behave, current, versions, version=3)
    # alpha = (3 - v) / (4 - v): -, 0, 1/2, 3/4, - -> -1 + alpha * (-2 - -1)
    assert got.tolist() == [[-1.0, -1.0, -1.5, -1.75, -1.0]]
    # Geometric in probabilities: exp(prox) = p_behave^(1 - alpha) * p_current^alpha.
    p = torch.exp(
        loglinear_prox_logp(
            torch.tensor([[-0.5]]), torch.tensor([[-2.5]]), torch.tensor([[1]]), version=2
        )
    )
    assert float(p) == pytest.approx(math.exp(-0.5) ** 0.5 * math.exp(-2.5) ** 0.5)


def test_overlong_penalty_is_dapos_soft_punishment():
    cfg = PPOSettings(overlong_max_len=10, overlong_cache=4, overlong_factor=0.5)
    lengths = torch.tensor([3, 6, 7, 8, 10, 11])
    # Free up to 10 - 4 = 6 tokens; then (6 - L) / 4 down to -1 at 10; -1 beyond; x 0.5.
    want = [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
    assert overlong_penalty(lengths, cfg).tolist() == pytest.approx(want)
    assert overlong_penalty(lengths, PPOSettings()).tolist() == [0.0] * 6
    # It enters the rewards before normalisation: a group of equal rewards whose members
    # differ in length gets advantages by length alone.
    ppo = replace(cfg, reward_norm=NO_NORM)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, :6], mask[1, :10] = True, True
    adv = compute_advantages(torch.tensor([1.0, 1.0]), mask, ppo)
    assert adv[0, 0] == pytest.approx(1.0) and adv[1, 0] == pytest.approx(0.5)


def _loss_case(cfg: PPOSettings, total_tokens: float, total_seqs: float) -> float:
    """Two sequences: 2 and 3 trained tokens, log-ratios and advantages chosen by hand."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    log_ratio = torch.tensor([[0.1, 0.3, 0.0], [0.0, 0.0, 0.0]])
    prox = torch.full((2, 3), -1.0)
    logp = prox + log_ratio
    adv = torch.tensor([[1.0, 3.0, 0.0], [-1.0, -1.0, -1.0]])
    loss, _ = ppo_loss(logp, prox, prox, adv, mask, cfg, total_tokens, total_seqs=total_seqs)
    return float(loss)


def test_sequence_level_ratios_and_loss_aggregations_match_hand_computations():
    base = {"eps_clip": 0.2, "rejection": NO_REJECTION}
    # Token level, token mean: row 0 tokens r = e^0.1, e^0.3 (clipped to 1.2 for A > 0:
    # min of -A r and -A 1.2 is the larger loss, max(-A r, -A clip) = -A * min(r, 1.2)),
    # row 1 r = 1 with A = -1 -> loss 1 each.
    t0 = -1.0 * min(math.exp(0.1), 1.2)
    t1 = -3.0 * min(math.exp(0.3), 1.2)
    token = (t0 + t1 + 3 * 1.0) / 5
    assert _loss_case(PPOSettings(**base), 5, 2) == pytest.approx(token, rel=1e-6)
    # Sequence level (GSPO): row 0's ratio is e^{mean(0.1, 0.3)} = e^0.2, clipped to 1.2,
    # and its tokens carry the mean advantage 2; row 1 unchanged.
    seq = PPOSettings(**base, importance_sampling_level="sequence")
    s0 = -2.0 * min(math.exp(0.2), 1.2)
    assert _loss_case(seq, 5, 2) == pytest.approx((2 * s0 + 3 * 1.0) / 5, rel=1e-6)
    # Sequence mean of token means, over the 2 sequences.
    seq_mean = PPOSettings(**base, loss_agg="seq_mean")
    assert _loss_case(seq_mean, 5, 2) == pytest.approx(((t0 + t1) / 2 + 1.0) / 2, rel=1e-6)
    # Dr.GRPO's constant: the token sum over 4 (length budget) x 2 sequences.
    const = PPOSettings(**base, loss_agg="constant", loss_constant_len=4)
    assert _loss_case(const, 5, 2) == pytest.approx((t0 + t1 + 3.0) / 8, rel=1e-6)


def _bkl(p: float, q: float) -> float:
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def test_rejection_metrics_match_hand_computations_per_token():
    """One row of four tokens (the last is padding), each metric against its formula."""
    prox = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.2), 0.0]])
    behave = torch.tensor([[math.log(0.4), math.log(0.3), math.log(0.25), 5.0]])
    mask = torch.tensor([[True, True, True, False]])
    p, q = [0.5, 0.9, 0.2], [0.4, 0.3, 0.25]
    log_r = [math.log(a / b) for a, b in zip(p, q, strict=True)]  # 0.223, 1.099, -0.223
    cases = {
        # ratio: r = 1.25, 3, 0.8 against [0.9, 2]: the 3 and the 0.8 go.
        "ratio": (0.9, 2.0, [False, True, True]),
        # k1 = log r against [-0.1, 0.5]: 1.099 and -0.223 go.
        "kl_k1": (-0.1, 0.5, [False, True, True]),
        # k2 = (log r)^2 / 2 = 0.0249, 0.603, 0.0249 against upper 0.1.
        "kl_k2": (None, 0.1, [False, True, False]),
        # k3 = 1/r - 1 + log r = 0.0231, 0.432, 0.0269 against upper 0.025.
        "kl_k3": (None, 0.025, [False, True, True]),
        # binary KL, both directions: 0.0204/0.0201, 0.794/1.033, 0.0070/0.0074.
        "binary_kl": (None, 0.02, [True, True, False]),
    }
    assert _bkl(p[0], q[0]) > 0.02 and _bkl(p[2], q[2]) < 0.02  # the cases straddle 0.02
    for metric, (lower, upper, rejected) in cases.items():
        cfg = RejectionSettings(metric=metric, lower=lower, upper=upper)  # type: ignore[arg-type]
        w, rej = behaviour_weights(prox, behave, mask, cfg)
        assert rej[0, :3].tolist() == rejected, metric
        assert not rej[0, 3]
        want = [0.0 if r else math.exp(x) for r, x in zip(rejected, log_r, strict=True)]
        torch.testing.assert_close(w[0, :3], torch.tensor(want), rtol=1e-5, atol=1e-6)
        assert w[0, 3] == 0.0
    # Clamp keeps every token, its weight pulled into [0.9, 2].
    w, rej = behaviour_weights(
        prox, behave, mask, RejectionSettings(action="clamp", lower=0.9, upper=2.0)
    )
    assert not rej.any()
    torch.testing.assert_close(w[0, :3], torch.tensor([1.25, 2.0, 0.9]), rtol=1e-5, atol=1e-6)
    # No rule: every trained token weighs 1.
    w, rej = behaviour_weights(prox, behave, mask, NO_REJECTION)
    assert w.tolist() == [[1.0, 1.0, 1.0, 0.0]] and not rej.any()


def test_sequence_level_rejection_judges_whole_rows_by_their_aggregate():
    """Row 0: log r = 0.2, 0.4 (mean 0.3, sum 0.6, max 0.4); row 1: log r = 1.0, -1.0."""
    log_r = torch.tensor([[0.2, 0.4], [1.0, -1.0]])
    behave = torch.full((2, 2), -2.0)
    prox = behave + log_r
    mask = torch.ones(2, 2, dtype=torch.bool)

    def run(agg: str, upper: float) -> tuple[list[list[bool]], torch.Tensor]:
        cfg = RejectionSettings(level="sequence", agg=agg, upper=upper)  # type: ignore[arg-type]
        w, rej = behaviour_weights(prox, behave, mask, cfg)
        return rej.tolist(), w

    # Geometric mean: row 0 e^0.3 = 1.35 > 1.3 goes, row 1 e^0 = 1 stays with weight 1.
    rej, w = run("mean", 1.3)
    assert rej == [[True, True], [False, False]]
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    # Product: row 0 e^0.6 = 1.82 stays under 2; its tokens weigh the geometric mean e^0.3.
    rej, w = run("sum", 2.0)
    assert rej == [[False, False], [False, False]]
    torch.testing.assert_close(w[0], torch.full((2,), math.exp(0.3)))
    # Max: row 1's e^1 = 2.72 > 2 drops it although its mean ratio is 1.
    rej, _ = run("max", 2.0)
    assert rej == [[False, False], [True, True]]


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_loss_term_adds_beta_times_the_estimate_with_its_gradient(estimator):
    """Two trained tokens with log pi - log ref = 0.5 and -0.3, zero advantages."""
    logp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -1.5, -1.7]])
    mask = torch.tensor([[False, True, True]])
    zeros = torch.zeros(1, 3)
    beta = 0.1
    cfg = PPOSettings(kl_loss_coef=beta, kl_loss_estimator=estimator, rejection=NO_REJECTION)
    loss, stats = ppo_loss(logp, logp.detach(), logp.detach(), zeros, mask, cfg, 2.0, ref_logp=ref)
    loss.backward()
    est = {
        "k1": (lambda x: x, lambda x: 1.0),
        "k2": (lambda x: x * x / 2, lambda x: x),
        "k3": (lambda x: math.exp(-x) - 1 + x, lambda x: 1 - math.exp(-x)),
    }[estimator]
    xs = [0.5, -0.3]
    assert loss.item() == pytest.approx(beta * sum(est[0](x) for x in xs) / 2, rel=1e-5)
    assert stats.kl_sum == pytest.approx(sum(est[0](x) for x in xs), rel=1e-5)
    want_grad = [0.0] + [beta * est[1](x) / 2 for x in xs]
    torch.testing.assert_close(logp.grad[0], torch.tensor(want_grad), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="reference"):
        ppo_loss(logp, logp.detach(), logp.detach(), zeros, mask, cfg, 2.0)


# [algorithms-2]: where our math differed from AReaL's (AReaL's values computed by hand).


def test_kl_reward_clamps_the_estimate_before_kl_ctl_scales_it():
    """D1: k3 of behaviour -5.0 against reference -0.1 is e^4.9 - 1 - 4.9 = 128.4, clamped to
    10, times kl_ctl 0.1: the token's reward is -1.0 (clamping the product gave -10.0)."""
    assert math.exp(4.9) - 1 - 4.9 == pytest.approx(128.4, abs=0.05)
    loss_mask = torch.tensor([[False, True]])
    behave, ref = torch.tensor([[0.0, -5.0]]), torch.tensor([[0.0, -0.1]])
    cfg = PPOSettings(kl_ctl=0.1, kl_estimator="k3", reward_norm=NO_NORM)
    adv = compute_advantages(torch.tensor([0.0]), loss_mask, cfg, behave_logp=behave, ref_logp=ref)
    assert adv[0, 1].item() == pytest.approx(-1.0, abs=1e-6)


def test_overlong_penalty_joins_the_raw_reward_before_bias_and_scale():
    """D2: 7 generated tokens, budget 8 with a cache of 4: penalty (4 - 7) / 4 = -0.75 on the
    raw reward 1, then (1 - 0.75 - 0.5) * 10 = -2.5 (adding it after shaping gave 4.25)."""
    reward = PPOSettings(
        reward_bias=-0.5,
        reward_scale=10.0,
        overlong_max_len=8,
        overlong_cache=4,
        reward_norm=NO_NORM,
    )
    mask = torch.zeros(1, 10, dtype=torch.bool)
    mask[0, 2:9] = True
    adv = compute_advantages(torch.tensor([1.0]), mask, reward)
    assert adv[0, 2:9].tolist() == pytest.approx([-2.5] * 7)


def test_kl_k3_rejection_metric_is_one_over_r_minus_one_plus_log_r():
    """D3: log r = -2 gives e^2 - 1 - 2 = 4.39 > 2 (rejected); log r = +2 gives
    e^-2 - 1 + 2 = 1.135 (kept). r - 1 - log r had them the other way round."""
    behave = torch.full((1, 2), -3.0)
    prox = behave + torch.tensor([[-2.0, 2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    w, rej = behaviour_weights(prox, behave, mask, RejectionSettings(metric="kl_k3", upper=2.0))
    assert rej.tolist() == [[True, False]]
    # A KL metric only decides what is dropped: the kept token weighs its ratio e^2.
    torch.testing.assert_close(w, torch.tensor([[0.0, math.exp(2.0)]]))


def test_sequence_ratio_weight_is_the_geometric_mean_whatever_the_agg():
    """D4: log-ratios 0.5, 0.5, 0.5 with agg "sum" and upper 5: the product e^1.5 = 4.48 keeps
    the sequence and each token weighs the geometric mean e^0.5 = 1.65 (it weighed 4.48)."""
    behave = torch.full((1, 3), -2.0)
    prox = behave + 0.5
    mask = torch.ones(1, 3, dtype=torch.bool)
    for agg in ("sum", "max", "mean"):
        cfg = RejectionSettings(level="sequence", agg=agg, upper=5.0)  # type: ignore[arg-type]
        w, rej = behaviour_weights(prox, behave, mask, cfg)
        assert not rej.any(), agg
        torch.testing.assert_close(w, torch.full((1, 3), math.exp(0.5)))
    # "clamp" clamps only the sequences agg puts out of [0.5, 2]. Row 0: log r 0, -2, its max
    # e^0 = 1 is inside, so it keeps its geometric mean e^-1 = 0.37 although that is below
    # 0.5. Row 1: log r 1.0, 0.6, max e^1 = 2.72 is outside: its e^0.8 = 2.23 is clamped to 2.
    behave = torch.full((2, 2), -3.0)
    prox = behave + torch.tensor([[0.0, -2.0], [1.0, 0.6]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    cfg = RejectionSettings(level="sequence", agg="max", action="clamp", lower=0.5, upper=2.0)
    w, rej = behaviour_weights(prox, behave, mask, cfg)
    assert not rej.any()
    want = torch.tensor([[math.exp(-1.0)] * 2, [2.0, 2.0]])
    torch.testing.assert_close(w, want)


def test_gspo_sequence_ratio_and_advantage_use_the_tokens_rejection_kept():
    """D5: logp - prox = 0, 0.4; the second token's behaviour ratio e^2 = 7.4 is over the cap
    of 5. The sequence is its first token alone: ratio e^0 = 1, advantage 1, weight 1, over
    the 2 tokens counted before rejection: -0.5 (the mask before rejection gave the ratio
    e^0.2 and -e^0.2 / 2 = -0.6107)."""
    prox = torch.full((1, 2), -1.0)
    logp = (prox + torch.tensor([[0.0, 0.4]])).requires_grad_(True)
    behave = prox - torch.tensor([[0.0, 2.0]])
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    # eps_clip 0.3 leaves e^0.2 unclipped, so the old value shows whole.
    cfg = PPOSettings(eps_clip=0.3, importance_sampling_level="sequence")
    loss, stats = ppo_loss(logp, prox, behave, adv, mask, cfg, 2.0)
    assert loss.item() == pytest.approx(-0.5, abs=1e-6)
    assert stats.capped_tokens == 1
    loss.backward()
    # d/dlogp of -exp(logp_0 - prox_0) / 2 at logp_0 = prox_0; the dropped token gets none.
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, 0.0]]))


def test_one_sample_per_prompt_with_group_centring_is_refused():
    """D6: a group of one centred on its own mean erases every reward (all advantages 0)."""
    rewards = torch.tensor([1.0, 0.0, 1.0])
    assert normalize(rewards, NormSettings(), group_index=torch.arange(3)).tolist() == [0.0] * 3
    for name, other in (("reward_norm", "adv_norm"), ("adv_norm", "reward_norm")):
        overrides = [f"trainer.ppo.{name}.mean_level=group", f"trainer.ppo.{other}.mean_level=none"]
        with pytest.raises(FieldError) as err:
            load_config(None, ["staleness.group_size=1", *overrides])
        assert err.value.field == "staleness.group_size"
        assert f"trainer.ppo.{name}.mean_level" in err.value.description
    # Batch centring keeps the rewards; external producers choose their own group sizes.
    no_group = ["staleness.group_size=1", "trainer.ppo.reward_norm.mean_level=batch"]
    assert load_config(None, no_group).staleness.group_size == 1
    external = ["staleness.group_size=1", "data.task=external", "eval.every_steps=0"]
    assert load_config(None, external).staleness.group_size == 1


def test_rejection_agg_at_the_token_level_is_refused():
    """``agg`` aggregates a sequence's values; at the token level it would do nothing."""
    with pytest.raises(FieldError) as err:
        load_config(None, ["trainer.ppo.rejection.agg=sum"])
    assert err.value.field == "trainer.ppo.rejection.agg"
    assert "trainer.ppo.rejection.level" in err.value.description
    seq = ["trainer.ppo.rejection.agg=sum", "trainer.ppo.rejection.level=sequence"]
    assert load_config(None, seq).trainer.ppo.rejection.agg == "sum"


def test_loglinear_reads_the_pre_step_version_off_a_line_through_behaviour_and_current():
    """Log-probs linear in the version, log pi_u = -0.5 - 0.25 u, are the approximation's
    exact case. Pre-step (proximal) weights are version V = 3, the current ones end the step
    at 4. A token of version 1: behaviour -0.75, current -1.5, alpha = (3 - 1) / (4 - 1) = 2/3,
    so -0.75 + 2/3 * (-0.75) = -1.25 = log pi_3, what "recompute" would give. (AReaL's alpha,
    (V - 1 - v) / (V - v) = 1/2 with current = log pi_3 = -1.25, gives -1.0 = log pi_2: the
    version before the proximal one.)"""

    def logp_at(u: float) -> float:
        return -0.5 - 0.25 * u

    version = 3
    for v in (0, 1, 2, 3):
        got = loglinear_prox_logp(
            torch.tensor([[logp_at(v)]]),
            torch.tensor([[logp_at(version + 1)]]),
            torch.tensor([[v]]),
            version=version,
        )
        assert got.item() == pytest.approx(logp_at(version), abs=1e-6), v
    got = loglinear_prox_logp(
        torch.tensor([[-0.75]]), torch.tensor([[-1.5]]), torch.tensor([[1]]), version=3
    )
    assert got.item() == pytest.approx(-1.25, abs=1e-6)


def test_the_logp_gaps_kl_estimate_is_the_kl_from_the_engines_distribution_to_the_trainers():
    """Tokens the engine sampled from q, log-probs of both: the mean k3 estimate converges to
    KL(q || p), within four standard errors of its own sample, and |d| is what it says."""
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
    p = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1], dtype=torch.float64)
    n = 200_000
    x = torch.multinomial(q, n, replacement=True, generator=gen)
    engine, trainer = q.log()[x], p.log()[x]
    stats = logp_gap(trainer, engine, torch.ones(n, dtype=torch.bool))
    assert stats.gap_tokens == n
    d = trainer - engine
    assert stats.gap_abs_sum == pytest.approx(float(d.abs().sum()))
    assert stats.gap_abs_max == pytest.approx(float(d.abs().max()))
    k3 = d.exp() - 1 - d
    kl = float((q * (q.log() - p.log())).sum())
    standard_error = float(k3.std()) / math.sqrt(n)
    assert stats.gap_kl_sum / n == pytest.approx(kl, abs=4 * standard_error)
    # Masked-out tokens count for nothing, and no token gives no statistics.
    half = logp_gap(trainer, engine, torch.arange(n) % 2 == 0)
    assert half.gap_tokens == n // 2
    assert logp_gap(trainer, engine, torch.zeros(n, dtype=torch.bool)).gap_tokens == 0
    assert gap_stats(0.0, 0.0, 0.0, 0.0) == {"logp_gap_tokens": 0.0}
