"""What the run trained on, as samples you can read: ``<output.dir>/rollouts/step-<s>.jsonl``.

Each step writes the trajectories of its batch's first ``output.rollouts_per_step`` groups,
one JSON object per trajectory: the step (numbered as in ``batches.jsonl``, from 0), the
trainer's version, the group's task and producer, the sample's index, its reward, advantage
and finish reason, the prompt and completion as text and as token ids, and each completion
token's policy version and behaviour log-probability. The directory is bounded by
``output.rollouts_max_mb``.

The text is decoded here without transformers (the coordinator imports neither torch nor
transformers): the built-in models' byte vocabulary directly, a checkpoint's through its
``tokenizer.json`` with the ``tokenizers`` library; null where neither applies
(``python -m areal_grpc.inspect`` decodes the ids with the model's own tokenizer). The
advantage is the trainer's for the sample's trained tokens, computed from the whole batch's
rewards with the run's ``trainer.ppo`` settings (:func:`sequence_advantages`); null with a KL
penalty (``kl_ctl``), where it differs per token and needs the reference policy.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from arealgrpc.v1 import common_pb2

from areal_grpc.config import NormSettings, PPOSettings
from areal_grpc.coordinator.pool import Finished
from areal_grpc.inspect import ROLLOUTS_DIR
from areal_grpc.model_source import builtin_spec, is_builtin, ready_source

__all__ = ["RolloutLog", "rollout_records", "sequence_advantages", "text_decoder"]

Decode = Callable[[Sequence[int]], str]

# ByT5's byte vocabulary (the built-in models'): three specials, 256 bytes, then extra ids.
_BYT5_SPECIALS = ("<pad>", "</s>", "<unk>")
_BYT5_BYTES = 256

log = logging.getLogger(__name__)


def _finish(reason: int) -> str:
    name = common_pb2.FinishReason.Name(reason)
    return name.removeprefix("FINISH_REASON_").lower()


def _byt5_decode(ids: Sequence[int]) -> str:
    """ByT5Tokenizer's ``decode(ids, skip_special_tokens=False)``, without transformers."""
    out = bytearray()
    for i in ids:
        if 0 <= i < len(_BYT5_SPECIALS):
            out += _BYT5_SPECIALS[i].encode()
        elif i < len(_BYT5_SPECIALS) + _BYT5_BYTES:
            out.append(i - len(_BYT5_SPECIALS))
        else:
            out += f"<extra_id_{i - len(_BYT5_SPECIALS) - _BYT5_BYTES}>".encode()
    # A completion cut inside a character ends in an incomplete byte sequence (dropped, as
    # ByT5Tokenizer drops it).
    return out.decode("utf-8", errors="ignore")


def text_decoder(source: str) -> Decode | None:
    """Decodes token ids of the model ``source`` to text, or None when that needs the
    model's own tokenizer class (a source not converted yet, no tokenizer.json)."""
    if is_builtin(source):
        builtin_spec(source)
        return _byt5_decode
    ready = ready_source(source)
    if ready is None or not (Path(ready) / "tokenizer.json").is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    tokenizer = Tokenizer.from_file(str(Path(ready) / "tokenizer.json"))
    return lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=False))


def _overlong(n: int, ppo: PPOSettings) -> float:
    # servers/trainer/algorithm.py's overlong_penalty, for one response of n trained tokens.
    if ppo.overlong_max_len <= 0:
        return 0.0
    free = ppo.overlong_max_len - ppo.overlong_cache
    if n <= free:
        return 0.0
    if n <= ppo.overlong_max_len:
        return (free - n) / max(ppo.overlong_cache, 1) * ppo.overlong_factor
    return -ppo.overlong_factor


def _normalize(
    values: list[float], weights: list[int], groups: list[int], cfg: NormSettings
) -> list[float]:
    """servers/trainer/algorithm.py's normalize for rows of ``weights`` equal elements each
    (1 per row for rewards, the trained tokens for token advantages)."""

    def stats(level: str, xs: list[float]) -> tuple[list[float], list[float]]:
        # (sum, count) of each row's set: its group, or the whole batch.
        if level == "batch":
            total = sum(w * x for w, x in zip(weights, xs, strict=True))
            return [total] * len(xs), [float(sum(weights))] * len(xs)
        sums: dict[int, float] = {}
        counts: dict[int, float] = {}
        for g, w, x in zip(groups, weights, xs, strict=True):
            sums[g] = sums.get(g, 0.0) + w * x
            counts[g] = counts.get(g, 0.0) + w
        return [sums[g] for g in groups], [counts[g] for g in groups]

    if cfg.mean_level == "none":
        mean = [0.0] * len(values)
    else:
        total, n = stats(cfg.mean_level, values)
        if cfg.mean_leave1out:
            mean = [
                (t - x) / (c - 1) if c - 1 > 0 else x
                for t, x, c in zip(total, values, n, strict=True)
            ]
        else:
            mean = [t / c if c > 0 else 0.0 for t, c in zip(total, n, strict=True)]
    centred = [x - m for x, m in zip(values, mean, strict=True)]
    if cfg.std_level == "none":
        return centred
    sq, n = stats(cfg.std_level, [c * c for c in centred])
    out = []
    for c, s, k in zip(centred, sq, n, strict=True):
        denom = k - 1 if cfg.std_unbiased else k
        std = math.sqrt(s / denom) if denom > 0 else 1.0
        out.append(c / (std + cfg.eps))
    return out


def sequence_advantages(batch: Sequence[Finished], ppo: PPOSettings) -> list[list[float | None]]:
    """Each trajectory's advantage, per group of ``batch`` (the whole step's batch, for batch
    statistics): the value every trained token of it gets from the trainer's
    compute_advantages. None for a trajectory with no trained token, and for every one with a
    KL penalty (kl_ctl), where it differs per token."""
    rows = [t for f in batch for t in f.group.trajectories]
    groups = [g for g, f in enumerate(batch) for _ in f.group.trajectories]
    if ppo.kl_ctl != 0.0:
        return [[None] * len(f.group.trajectories) for f in batch]
    # The trainer's trained tokens: the loss mask past position 0 (which no logit predicts).
    tokens = [sum(1 for m in t.loss_mask[1:] if m) for t in rows]
    rewards = [
        max(
            -ppo.reward_clip,
            min(
                ppo.reward_clip,
                (t.reward + _overlong(n, ppo) + ppo.reward_bias) * ppo.reward_scale,
            ),
        )
        for t, n in zip(rows, tokens, strict=True)
    ]
    norm = ppo.reward_norm
    if norm.mean_level != "none" or norm.std_level != "none":
        rewards = _normalize(rewards, [1] * len(rows), groups, norm)
    norm = ppo.adv_norm
    if norm.mean_level != "none" or norm.std_level != "none":
        rewards = _normalize(rewards, tokens, groups, norm)
    flat: list[float | None] = [r if n else None for r, n in zip(rewards, tokens, strict=True)]
    out, i = [], 0
    for f in batch:
        k = len(f.group.trajectories)
        out.append(flat[i : i + k])
        i += k
    return out


def rollout_records(
    step: int,
    version: int,
    batch: Sequence[Finished],
    advantages: Sequence[Sequence[float | None]] | None = None,
    decode: Decode | None = None,
) -> list[dict[str, Any]]:
    """One record per trajectory of ``batch`` (see the module docstring); ``advantages`` per
    group (:func:`sequence_advantages`), ``decode`` for the text (None: null text)."""
    out = []
    for g, f in enumerate(batch):
        for i, t in enumerate(f.group.trajectories):
            n = t.prompt_length
            prompt, completion = list(t.token_ids[:n]), list(t.token_ids[n:])
            advantage = advantages[g][i] if advantages is not None else None
            out.append(
                {
                    "step": step,
                    "version": version,
                    "task_id": f.work.task_id,
                    "producer": f.work.producer,
                    "sample": i,
                    "reward": t.reward,
                    "advantage": None if advantage is None else round(advantage, 6),
                    "finish_reason": _finish(t.finish_reason),
                    "prompt": decode(prompt) if decode is not None else None,
                    "completion": decode(completion) if decode is not None else None,
                    "prompt_ids": prompt,
                    "completion_ids": completion,
                    "versions": list(t.versions[n:]),
                    "logprobs": [round(x, 6) for x in t.logprobs[n:]],
                }
            )
    return out


class RolloutLog:
    """Writes each step's samples under ``<out_dir>/rollouts``, within a size bound."""

    def __init__(
        self,
        out_dir: Path,
        groups_per_step: int,
        max_mb: float,
        *,
        ppo: PPOSettings | None = None,
        model_source: str | None = None,
    ) -> None:
        """``ppo``: the trainer's settings, for the advantages (None: null advantages);
        ``model_source``: the policy, for the text (None: null text)."""
        self.dir = out_dir / ROLLOUTS_DIR
        self.groups_per_step = groups_per_step
        self.max_bytes = int(max_mb * (1 << 20))
        self.ppo = ppo
        self.model_source = model_source
        self._decode: Decode | None = None
        self._decoder_made = False
        self._full = False
        # Bytes under dir, counted from disk once (a resumed run's files count too), then kept
        # up to date here instead of re-reading every file's size at every step.
        self._used: int | None = None

    def _files(self) -> list[Path]:
        return sorted(self.dir.glob("step-*.jsonl")) if self.dir.is_dir() else []

    def forget_after(self, keep_until: int) -> None:
        """Drops the files of steps from ``keep_until`` on (a resume or recovery redoes them)."""
        for path in self._files():
            if int(path.stem.removeprefix("step-")) >= keep_until:
                path.unlink()
        self._used = None

    def decoder(self) -> Decode | None:
        """The policy's text decoder, made at the first use (None: no text)."""
        if not self._decoder_made:
            self._decoder_made = True
            if self.model_source is not None:
                try:
                    self._decode = text_decoder(self.model_source)
                except Exception as exc:  # a sample without text is still worth writing
                    log.warning("rollouts: no text for %s (%s)", self.model_source, exc)
        return self._decode

    def records(self, step: int, version: int, batch: Sequence[Finished]) -> list[dict[str, Any]]:
        """The records of step ``step``'s first ``groups_per_step`` groups; the advantages
        come from the whole batch (batch-level statistics)."""
        advantages = sequence_advantages(batch, self.ppo) if self.ppo is not None else None
        keep = batch[: self.groups_per_step]
        return rollout_records(
            step, version, keep, advantages[: len(keep)] if advantages else None, self.decoder()
        )

    def write(self, step: int, version: int, batch: Sequence[Finished]) -> list[dict[str, Any]]:
        """Writes step ``step``'s samples (nothing once the directory is full); returns the
        records written."""
        if self.groups_per_step <= 0 or self._full:
            return []
        records = self.records(step, version, batch)
        data = "".join(json.dumps(r) + "\n" for r in records).encode()
        if self._used is None:
            self._used = sum(p.stat().st_size for p in self._files())
        used = self._used
        if used + len(data) > self.max_bytes:
            self._full = True
            log.warning(
                "%s holds %.1f MiB (output.rollouts_max_mb): no more samples are written",
                self.dir,
                used / (1 << 20),
            )
            return []
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"step-{step:06d}.jsonl").write_bytes(data)
        self._used = used + len(data)
        return records
