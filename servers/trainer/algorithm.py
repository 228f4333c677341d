"""GRPO / decoupled-PPO math in one file (AReaL's ``areal/trainer/ppo/actor.py`` and
``areal/utils/functional/functional.py``, at AReaL commit cbff54d6).

Where this file departs from AReaL on purpose, the "Differences from AReaL" table in
docs/guides/algorithms.md says so and why; everything else computes what AReaL computes.

Alignment convention (differs from AReaL's rolled tensors on purpose): every ``[B, S]``
tensor here is *token-aligned*, like the batches of :mod:`areal_grpc.trajectory`: position
``t`` describes token ``t`` (its behaviour log-prob, its loss mask, its advantage). The model's
logits at position ``t`` predict token ``t + 1``, so :func:`token_logprobs` shifts once:
``logp[:, t] = log_softmax(logits[:, t - 1])[input_ids[:, t]]`` for ``t >= 1`` and
``logp[:, 0] = 0``. Token 0 has no predictor and is never trained (:func:`trainable_mask`).

Pieces, in step order:

1. :func:`overlong_penalty` added to the raw reward, then :func:`shape_rewards`:
   ``clip((r + penalty + bias) * scale, -clip, clip)``.
2. :func:`normalize`: mean/std at group or batch level (optionally leave-one-out), float64,
   equal values in a group give exactly zero (never NaN).
3. :func:`compute_advantages`: sequence reward on every generated token, plus the optional
   KL-to-reference reward penalty ``-kl_ctl * clamp(KL, -10, 10)`` summed from the token
   onwards (GAE with gamma = lambda = 1 and no critic), then optional token-level advantage
   normalisation.
4. :func:`ppo_loss`: decoupled PPO surrogate for one micro-batch, normalised by the global
   token count so that summing micro-batches and ranks gives the global token mean.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from areal_grpc.config import NormSettings, PPOSettings, RejectionSettings

# Sums a tensor over the data-parallel ranks (identity on one process).
Reducer = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def overlong_penalty(lengths: torch.Tensor, cfg: PPOSettings) -> torch.Tensor:
    """DAPO's soft overlong punishment of responses of ``lengths`` tokens (float32, [B]).

    With L_max = ``overlong_max_len`` and L_c = ``overlong_cache``: 0 up to L_max - L_c, then
    ``((L_max - L_c) - L) / L_c`` (linear down to -1 at L_max), -1 beyond; times the factor.
    """
    if cfg.overlong_max_len <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    free = cfg.overlong_max_len - cfg.overlong_cache
    n = lengths.float()
    ramp = (free - n) / max(cfg.overlong_cache, 1)
    penalty = torch.where(n <= free, 0.0, torch.where(n <= cfg.overlong_max_len, ramp, -1.0))
    return penalty * cfg.overlong_factor


def shape_rewards(rewards: torch.Tensor, cfg: PPOSettings) -> torch.Tensor:
    """``clip((rewards + reward_bias) * reward_scale, -reward_clip, reward_clip)`` in float32."""
    r = (rewards.float() + cfg.reward_bias) * cfg.reward_scale
    return r.clamp(-cfg.reward_clip, cfg.reward_clip)


def _group_sum(x: torch.Tensor, groups: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Per-group sums of a [B] tensor, gathered back to [B]."""
    sums = torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, groups, x)
    return sums[groups]


def normalizes(cfg: NormSettings) -> bool:
    """Whether ``cfg`` changes anything (levels "none" and "none" leave the values as they are)."""
    return cfg.mean_level != "none" or cfg.std_level != "none"


def normalize(
    x: torch.Tensor,
    cfg: NormSettings,
    *,
    mask: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    reduce: Reducer = _identity,
) -> torch.Tensor:
    """Normalises ``x`` ([B] or [B, S]) over the valid elements of ``mask``.

    ``group_index`` [B] names each row's group (group statistics are local: a group never spans
    ranks); batch statistics are summed over ranks with ``reduce``. Computed in float64;
    returns float32 with zeros outside the mask. Collectives run only for "batch" levels, so
    every rank must pass the same config.
    """
    xd = x.double()
    m = torch.ones_like(xd) if mask is None else mask.to(torch.float64)
    b = xd.shape[0]
    if group_index is None:
        group_index = torch.zeros(b, dtype=torch.int64, device=x.device)
    n_groups = int(group_index.max()) + 1 if b else 0
    rowdims = tuple(range(1, xd.dim()))

    def stats(level: str, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum, count) of masked ``values`` at ``level``, broadcastable to ``x``."""
        v = values * m
        if level == "batch":
            both = reduce(torch.stack([v.sum(), m.sum()]))
            return both[0], both[1]
        row_v = v.sum(dim=rowdims) if rowdims else v
        row_n = m.sum(dim=rowdims) if rowdims else m
        gs, gn = _group_sum(row_v, group_index, n_groups), _group_sum(row_n, group_index, n_groups)
        shape = (b,) + (1,) * len(rowdims)
        return gs.view(shape), gn.view(shape)

    if cfg.mean_level == "none":
        mean = torch.zeros_like(xd)
    else:
        total, n = stats(cfg.mean_level, xd)
        if cfg.mean_leave1out:
            # Mean of the other valid elements. An element alone in its set has no baseline;
            # AReaL centres it by 0, we centre it by itself so a lone (hence "all equal")
            # group gets a zero advantage like any group of equal rewards.
            others = n - 1
            mean = torch.where(others > 0, (total - xd) / others.clamp(min=1), xd)
        else:
            mean = torch.where(n > 0, total / n.clamp(min=1), 0.0)
    centred = (xd - mean) * m
    if cfg.std_level == "none":
        return centred.float()
    sq, n = stats(cfg.std_level, centred * centred)
    denom = n - 1 if cfg.std_unbiased else n
    # Too few elements for a std: divide by 1 (AReaL's rule), never by 0.
    std = torch.where(denom > 0, (sq / denom.clamp(min=1)).sqrt(), 1.0)
    return (centred / (std + cfg.eps)).float()


def kl_estimate(
    logp: torch.Tensor, logp_ref: torch.Tensor, estimator: Literal["k1", "k2", "k3"]
) -> torch.Tensor:
    """Per-token KL estimate with ``x = logp - logp_ref``: k1 = x, k2 = x²/2, k3 = e^-x - 1 + x."""
    x = logp.float() - logp_ref.float()
    if estimator == "k1":
        return x
    if estimator == "k2":
        return x * x / 2
    if estimator == "k3":
        return torch.expm1(-x) + x
    raise ValueError(f"unknown KL estimator {estimator!r}")


def compute_advantages(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: PPOSettings,
    *,
    group_index: torch.Tensor | None = None,
    behave_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    reduce: Reducer = _identity,
) -> torch.Tensor:
    """Token-aligned advantages [B, S] (zero outside ``loss_mask``).

    With no KL penalty every generated token of row i carries the shaped (and normalised)
    reward r_i. With ``kl_ctl > 0`` each generated token t adds the reward
    ``-kl_ctl * clamp(KL(behave[t], ref[t]), -10, 10)`` and the advantage is the sum of
    rewards from t to the end (undiscounted return-to-go, no critic).
    """
    mask = loss_mask.to(torch.bool)
    # The overlong penalty joins the raw reward, so bias and scale apply to it as well
    # (AReaL's order; DAPO's example scales rewards by 10).
    penalty = overlong_penalty(mask.sum(dim=-1), cfg)
    r = shape_rewards(rewards.float() + penalty, cfg)
    if normalizes(cfg.reward_norm):
        r = normalize(r, cfg.reward_norm, group_index=group_index, reduce=reduce)
    adv = r[:, None].expand(mask.shape).clone()
    if cfg.kl_ctl != 0.0:
        if behave_logp is None or ref_logp is None:
            raise ValueError("kl_ctl != 0 needs behaviour and reference log-probs")
        # The estimate is clamped, not the reward: kl_ctl scales the bounded KL (AReaL's).
        kl = kl_estimate(behave_logp, ref_logp, cfg.kl_estimator).clamp(-10.0, 10.0)
        kl_r = -cfg.kl_ctl * kl * mask
        # Return-to-go: reverse cumulative sum over positions t..S-1.
        adv = adv + kl_r.flip(-1).cumsum(-1).flip(-1)
    adv = adv * mask
    if normalizes(cfg.adv_norm):
        adv = normalize(adv, cfg.adv_norm, mask=mask, group_index=group_index, reduce=reduce)
    return adv.float()


def trainable_mask(loss_mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The tokens the loss covers: loss-mask tokens that have a predicting position (t >= 1)."""
    mask = loss_mask.to(torch.bool) & attention_mask.to(torch.bool)
    mask = mask.clone()
    if mask.shape[-1]:
        mask[:, 0] = False
    return mask


def logprobs_of(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each target, entropy of its distribution) for aligned logits [..., V]."""
    logp_all = F.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-aligned (log-prob of token t, entropy of the distribution predicting t), [B, S].

    Position 0 has no predicting logits and gets 0 in both.
    """
    logp, entropy = logprobs_of(logits[:, :-1], input_ids[:, 1:], temperature)
    return F.pad(logp, (1, 0)), F.pad(entropy, (1, 0))


def masked_token_logprobs(
    forward: Callable[[torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs` at the positions of ``mask`` only (0 elsewhere), [B, S].

    ``forward(keep)`` returns the logits of the positions where the boolean ``keep`` [B, S]
    is set, flattened [N, V] (transformers' ``logits_to_keep``). Only the tokens trained on
    go through the vocabulary projection and the log-softmax: with prompts most of each
    sequence, that is most of the step's vocabulary work and memory.
    """
    target = mask.bool().clone()
    target[:, 0] = False  # token 0 has no predictor
    keep = torch.zeros_like(target)
    keep[:, :-1] = target[:, 1:]
    rows, cols = target.nonzero(as_tuple=True)
    logp, entropy = logprobs_of(forward(keep), input_ids[rows, cols], temperature)
    zeros = torch.zeros(input_ids.shape, dtype=logp.dtype, device=logp.device)
    return zeros.index_put((rows, cols), logp), zeros.index_put((rows, cols), entropy)


@dataclass
class LossStats:
    """Sums over one or more micro-batches (and ranks); divide by ``tokens`` for means."""

    loss: float = 0.0
    clipped_tokens: float = 0.0
    imp_weight_sum: float = 0.0
    imp_weight_max: float = 0.0
    entropy_sum: float = 0.0
    tokens: float = 0.0
    # Tokens dropped by the rejection rule (its "mask" action).
    capped_tokens: float = 0.0
    # Sum of the KL-loss estimate over the kept tokens (0 without a KL loss).
    kl_sum: float = 0.0
    # The train/rollout log-prob gap (logp_gap) over the tokens it was measured on: the sum
    # and max of |trainer - engine|, the sum of the KL estimate, and their count.
    gap_abs_sum: float = 0.0
    gap_abs_max: float = 0.0
    gap_kl_sum: float = 0.0
    gap_tokens: float = 0.0

    @property
    def imp_weight_mean(self) -> float:
        """Mean behaviour importance weight over the tokens kept after the cap."""
        kept = self.tokens - self.capped_tokens
        return self.imp_weight_sum / kept if kept > 0 else 0.0

    def add(self, other: LossStats) -> None:
        """Accumulates ``other`` into ``self``."""
        self.loss += other.loss
        self.clipped_tokens += other.clipped_tokens
        self.imp_weight_sum += other.imp_weight_sum
        self.imp_weight_max = max(self.imp_weight_max, other.imp_weight_max)
        self.entropy_sum += other.entropy_sum
        self.tokens += other.tokens
        self.capped_tokens += other.capped_tokens
        self.kl_sum += other.kl_sum
        self.gap_abs_sum += other.gap_abs_sum
        self.gap_abs_max = max(self.gap_abs_max, other.gap_abs_max)
        self.gap_kl_sum += other.gap_kl_sum
        self.gap_tokens += other.gap_tokens


def logp_gap(
    trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor
) -> LossStats:
    """The train/rollout gap on the ``mask``ed tokens: the trainer's log-prob of each sampled
    token (at the version that sampled it) against the one the inference engine reported.

    Sums of |d| and of the KL estimate ``k3 = e^d - 1 - d`` (d = trainer - engine: an unbiased,
    non-negative estimate of KL(engine || trainer) from the engine's own samples), the
    largest |d|, and the token count, in float64.
    """
    d = trainer_logp.double() - engine_logp.double()
    m = mask.bool()
    if not bool(m.any()):
        return LossStats()
    d = d[m]
    return LossStats(
        gap_abs_sum=float(d.abs().sum()),
        gap_abs_max=float(d.abs().max()),
        gap_kl_sum=float((d.exp() - 1.0 - d).sum()),
        gap_tokens=float(d.numel()),
    )


def gap_stats(abs_sum: float, abs_max: float, kl_sum: float, tokens: float) -> dict[str, float]:
    """The step's ``logp_gap_*`` statistics (StepStats.extra) from the global sums of
    :func:`logp_gap`; the mean, max and KL only when some token was measured."""
    if tokens <= 0:
        return {"logp_gap_tokens": 0.0}
    return {
        "logp_gap_mean": abs_sum / tokens,
        "logp_gap_max": abs_max,
        "logp_gap_kl": kl_sum / tokens,
        "logp_gap_tokens": tokens,
    }


def loglinear_prox_logp(
    behave_logp: torch.Tensor, logp: torch.Tensor, versions: torch.Tensor, version: int
) -> torch.Tensor:
    """The proximal log-probs approximated without a forward pass (AReaL's "loglinear").

    The model: a token's log-prob moves linearly with the policy version, from its behaviour
    value at the version ``v`` that sampled it to the current weights' value at ``v_cur``; the
    proximal log-prob is read off that line at the proximal version ``V``:
    ``prox = behave + alpha * (current - behave)``, ``alpha = (V - v) / (v_cur - v)``.

    ``version`` is ``V``: the proximal weights are the ones before this step, the weights
    "recompute" runs, and they carry the version the trainer holds during the step. The
    current weights start the step at ``V`` and reach ``V + 1`` after its last update (the
    k-th of n updates runs on about ``V + k/n``); ``v_cur = V + 1`` is taken, the end of the
    step: ``alpha = (V - v) / (V + 1 - v)``, 0 for a token of the proximal weights themselves
    (its behaviour log-prob is exact), 1/2 for one a version older, toward 1 for very stale
    ones. Tokens with no version (< 0) or a newer one keep the behaviour log-prob.

    AReaL (``compute_prox_logp_approximations`` in ``areal/trainer/ppo/actor.py``) passes the
    same ``V`` (the engine's version during ``ppo_update``) as ``v_cur`` and takes
    ``V - 1`` as the proximal version, so it reads the line one version early: a token of
    version ``V - 1`` gets alpha 0, its behaviour log-prob, though the proximal weights
    (what its "recompute" computes) are a version newer. Here the proximal version is ``V``.
    """
    v = versions.to(torch.float64)
    fresh = (versions >= 0) & (versions <= version)
    alpha = torch.where(fresh, (version - v) / (version + 1 - v), torch.zeros_like(v))
    alpha = alpha.clamp(0.0, 1.0).to(logp.dtype)
    behave = behave_logp.to(logp.dtype)
    return behave + alpha * (logp - behave)


# Beyond e^30 a weight is meaningless and e^89 overflows float32: the log-weights of the KL
# metrics (which bound the divergence, not the ratio) are clamped here.
_MAX_LOG_WEIGHT = 30.0
# Probabilities of exactly 0 or 1 make a Bernoulli KL infinite.
_PROB_EPS = 1e-7


def _bernoulli_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(Bernoulli(p) || Bernoulli(q)), elementwise."""
    return p * (p.log() - q.log()) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))


def _row_agg(values: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """``agg`` of each row's masked ``values``, broadcast back over the row."""
    if agg == "max":
        row = torch.where(mask, values, float("-inf")).amax(dim=-1)
        row = torch.where(mask.any(dim=-1), row, 0.0)
    else:
        row = torch.where(mask, values, 0.0).sum(dim=-1)
        if agg == "mean":
            row = row / mask.sum(dim=-1).clamp(min=1)
        elif agg != "sum":
            raise ValueError(f"unknown rejection agg {agg!r}")
    return row[:, None].expand_as(values)


def behaviour_weights(
    prox_logp: torch.Tensor,
    behave_logp: torch.Tensor,
    mask: torch.Tensor,
    cfg: RejectionSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(importance weight exp(prox - behaviour), rejected) for token-aligned [B, S] inputs.

    The weight is 0 outside ``mask`` and on rejected tokens; ``rejected`` is the boolean
    mask of tokens of ``mask`` that ``cfg`` drops. A non-finite log-ratio gets weight 0 (it
    would poison the loss) without counting as rejected. With metric "none" every token of
    ``mask`` weighs 1.
    """
    mask = mask.to(torch.bool)
    if cfg.metric == "none":
        return mask.float(), torch.zeros_like(mask)
    log_r = torch.where(mask, prox_logp.float() - behave_logp.float(), 0.0)
    log_r = torch.where(torch.isfinite(log_r), log_r, float("-inf"))
    finite = torch.isfinite(log_r)
    safe = torch.where(finite, log_r, 0.0)
    if cfg.metric in ("ratio", "kl_k1"):
        value = log_r
    elif cfg.metric == "kl_k2":
        value = safe * safe / 2
    elif cfg.metric == "kl_k3":
        # AReaL's k3 of (prox, behaviour): e^-log r - 1 + log r = 1/r - 1 + log r.
        value = torch.expm1(-safe) + safe
    elif cfg.metric == "binary_kl":
        p = prox_logp.float().exp().clamp(_PROB_EPS, 1 - _PROB_EPS)
        q = behave_logp.float().exp().clamp(_PROB_EPS, 1 - _PROB_EPS)
        value = torch.maximum(_bernoulli_kl(p, q), _bernoulli_kl(q, p))
    else:
        raise ValueError(f"unknown rejection metric {cfg.metric!r}")
    log_w = log_r
    if cfg.level == "sequence":
        if cfg.metric == "ratio":
            # Every token of a sequence weighs its geometric mean ratio, whatever ``agg``:
            # a product (or max) of ratios as a weight would grow with the length.
            geo = _row_agg(log_r, mask & finite, "mean")
            log_w = torch.where(finite, geo, float("-inf"))
        value = _row_agg(value, mask & finite, cfg.agg)
    elif cfg.level != "token":
        raise ValueError(f"unknown rejection level {cfg.level!r}")
    in_log = cfg.metric == "ratio"
    upper = math.log(cfg.upper) if in_log else cfg.upper
    lower = None if cfg.lower is None else (math.log(cfg.lower) if in_log else cfg.lower)
    out = value > upper
    if lower is not None:
        out = out | (value < lower)
    if cfg.action == "clamp":
        if not in_log:
            raise ValueError(f"rejection action 'clamp' needs metric 'ratio', got {cfg.metric!r}")
        # Only what ``agg`` put out of bounds is clamped: at the sequence level a weight
        # (the geometric mean) may lie outside the bounds while its sequence is within them.
        log_w = torch.where(out, log_w.clamp(min=lower, max=upper), log_w)
        rejected = torch.zeros_like(mask)
    elif cfg.action == "mask":
        rejected = mask & finite & out
        log_w = log_w.clamp(max=upper if in_log else _MAX_LOG_WEIGHT)
    else:
        raise ValueError(f"unknown rejection action {cfg.action!r}")
    w = torch.where(mask & ~rejected, torch.exp(log_w), 0.0)
    return w, rejected


def ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behave_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: PPOSettings,
    total_tokens: float,
    entropy: torch.Tensor | None = None,
    total_seqs: float = 0.0,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Decoupled PPO loss of one micro-batch, normalised by *global* counts.

    All inputs are token-aligned [B, S]; ``mask`` is the trainable mask. Summing the returned
    loss over micro-batches and ranks gives, by ``cfg.loss_agg``: ``sum over all tokens of l /
    total_tokens`` (token mean of the global batch), the mean over the ``total_seqs``
    sequences of each one's token mean, or ``sum of l / (loss_constant_len * total_seqs)``.
    Counts are of the mask before the importance-weight cap.

    ``l = w * max(-A r, -A clamp(r, 1 - eps, 1 + eps_high))`` with ``r = exp(logp - prox)``
    per token (or, at the sequence level, ``exp`` of the sequence's mean log-ratio with the
    sequence's mean advantage, both over the tokens the rejection kept), optionally
    dual-clipped ``min(l, c_clip |A|)``, and ``w`` the behaviour weight of
    :func:`behaviour_weights` (0 on rejected tokens). With
    ``kl_loss_coef`` each kept token adds ``kl_loss_coef * KL(logp, ref_logp)``.
    """
    mask = mask.to(torch.bool)
    maskf = mask.float()
    prox = prox_logp.float().detach()
    adv = advantages.float().detach()
    w, capped = behaviour_weights(prox, behave_logp, mask, cfg.rejection)
    final_mask = mask & ~capped
    if cfg.importance_sampling_level == "sequence":
        # GSPO: one ratio per sequence from its mean token log-ratio (masked first, so
        # padding never reaches exp), and the sequence's mean advantage on every token, both
        # over the tokens the rejection kept (a dropped token is out of the sequence too).
        kept = final_mask.float()
        n_tok = kept.sum(dim=-1).clamp(min=1.0)
        seq_log_ratio = ((logp.float() - prox) * kept).sum(dim=-1) / n_tok
        ratio = torch.where(final_mask, torch.exp(seq_log_ratio)[:, None].expand_as(kept), 0.0)
        adv = torch.where(final_mask, ((adv * kept).sum(dim=-1) / n_tok)[:, None], 0.0)
    else:
        # Masked before exp: padding positions must not produce inf (inf * 0 grads are NaN).
        ratio = torch.where(mask, torch.exp((logp.float() - prox) * maskf), 0.0)
    eps_high = cfg.eps_clip if cfg.eps_clip_higher is None else cfg.eps_clip_higher
    clipped_ratio = ratio.clamp(1.0 - cfg.eps_clip, 1.0 + eps_high)
    pg1 = -adv * ratio
    pg2 = -adv * clipped_ratio
    pg = torch.maximum(pg1, pg2)
    clipped = (pg2 > pg1) & mask
    if cfg.c_clip is not None:
        pg = torch.minimum(pg, cfg.c_clip * adv.abs())
    pg = pg * w
    kl = torch.zeros_like(pg)
    if cfg.kl_loss_coef != 0.0:
        if ref_logp is None:
            raise ValueError("kl_loss_coef != 0 needs the reference log-probs")
        # Not importance-weighted: the penalty is on the current policy itself. The log-ratio
        # is clamped before k2/k3 exponentiate it (an inf there is a NaN gradient).
        delta = (logp.float() - ref_logp.float()).clamp(-20.0, 20.0)
        est = kl_estimate(delta, torch.zeros_like(delta), cfg.kl_loss_estimator)
        kl = torch.where(final_mask, est, 0.0)
        pg = pg + cfg.kl_loss_coef * kl
    pg = torch.where(final_mask, pg, 0.0)
    if cfg.loss_agg == "token_mean":
        loss = pg.sum() / max(float(total_tokens), 1.0)
    elif cfg.loss_agg == "seq_mean":
        per_seq = pg.sum(dim=-1) / maskf.sum(dim=-1).clamp(min=1.0)
        loss = per_seq.sum() / max(float(total_seqs), 1.0)
    elif cfg.loss_agg == "constant":
        if cfg.loss_constant_len <= 0:
            raise ValueError("loss_agg 'constant' needs loss_constant_len > 0")
        loss = pg.sum() / max(float(cfg.loss_constant_len) * float(total_seqs), 1.0)
    else:
        raise ValueError(f"unknown loss_agg {cfg.loss_agg!r}")
    with torch.no_grad():
        stats = LossStats(
            loss=float(loss),
            clipped_tokens=float(clipped.sum()),
            imp_weight_sum=float(w.sum()),
            imp_weight_max=float(w.max()) if w.numel() else 0.0,
            entropy_sum=float((entropy.float() * maskf).sum()) if entropy is not None else 0.0,
            tokens=float(maskf.sum()),
            capped_tokens=float(capped.sum()),
            kl_sum=float(kl.detach().sum()),
        )
    return loss, stats
