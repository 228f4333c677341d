"""Run metrics: JSONL (always), TensorBoard (when installed), a PNG of the curves at the end.

With TensorBoard, each step's rollout samples (``rollouts/``) go there too, as text under
``samples``.

``metrics.jsonl`` has one JSON object per line with a ``kind``: ``"train"`` (one per step),
``"eval"`` (one per evaluation). ``batches.jsonl`` records, per step, which prompts were
trained (task ids, dataset ids, head versions): the audit trail of "each prompt trained once,
within the staleness bound".
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["MetricsWriter", "plot_curves", "read_jsonl", "sample_markdown"]

log = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf; null keeps the file parseable by every reader.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends records to ``<dir>/metrics.jsonl`` and, optionally, TensorBoard."""

    def __init__(
        self, out_dir: Path, tensorboard: bool = True, keep_until: int | None = None
    ) -> None:
        """``keep_until``: on resume, drop records of steps after it (they are redone)."""
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = out_dir / "metrics.jsonl"
        self.batches_path = out_dir / "batches.jsonl"
        if keep_until is not None:
            for path in (self.metrics_path, self.batches_path):
                kept = [r for r in read_jsonl(path) if r["step"] <= keep_until]
                # batches.jsonl numbers a step by its start (0-based): step s ends at s + 1.
                if path == self.batches_path:
                    kept = [r for r in kept if r["step"] < keep_until]
                path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._metrics = self.metrics_path.open("a")
        self._batches = self.batches_path.open("a")
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(out_dir / "tensorboard"))
            except ImportError:
                log.info("tensorboard is not installed; metrics go to %s only", self.metrics_path)

    def log(self, kind: str, step: int, values: Mapping[str, Any]) -> dict[str, Any]:
        """Writes one record; numbers also go to TensorBoard as ``<kind>/<name>``."""
        record = {"kind": kind, "step": step, **{k: _clean(v) for k, v in values.items()}}
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(f"{kind}/{k}", v, step)
        return record

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """Step ``step``'s samples (rollout records, numbered from 0 as in ``batches.jsonl``)
        as TensorBoard text under ``samples``, at the step of the scalars they were trained
        in (``step + 1``); nothing without TensorBoard."""
        if self._tb is None or not samples:
            return
        self._tb.add_text("samples", "\n\n".join(sample_markdown(s) for s in samples), step + 1)
        self._tb.flush()

    def log_batch(self, step: int, version: int, entries: Sequence[Mapping[str, Any]]) -> None:
        """Records what step ``step`` trained (one entry per group)."""
        self._batches.write(
            json.dumps({"step": step, "version": version, "groups": list(entries)}) + "\n"
        )
        self._batches.flush()

    def close(self) -> None:
        """Flushes and closes the files."""
        self._metrics.close()
        self._batches.close()
        if self._tb is not None:
            self._tb.close()


def sample_markdown(sample: Mapping[str, Any]) -> str:
    """One rollout record as TensorBoard's markdown: a header line (task, sample, reward,
    advantage, finish reason, versions), then the prompt and the completion as code blocks
    (token ids when there is no text)."""
    versions = sample.get("versions") or []
    spread = f"{min(versions)}..{max(versions)}" if versions else "-"
    advantage = sample.get("advantage")
    head = (
        f"**{sample['task_id']} #{sample['sample']}**: reward {sample['reward']:g}, "
        f"advantage {'-' if advantage is None else f'{advantage:.4g}'}, "
        f"{sample['finish_reason']}, generated at versions {spread}"
    )

    def block(text: str | None, ids: Sequence[int]) -> str:
        body = text if text is not None else " ".join(map(str, ids))
        # Indented code: markdown shows it verbatim, whatever fences or markup it holds.
        return "\n".join("    " + line for line in (body or " ").splitlines() or [" "])

    return (
        f"{head}\n\nprompt:\n\n{block(sample.get('prompt'), sample['prompt_ids'])}\n\n"
        f"completion:\n\n{block(sample.get('completion'), sample['completion_ids'])}"
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSONL file (an unfinished last line is skipped)."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def plot_curves(metrics_path: Path, png_path: Path) -> Path | None:
    """Draws sampled reward per step and eval accuracy; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed; no plot written")
        return None
    records = read_jsonl(metrics_path)
    train = [r for r in records if r["kind"] == "train" and r.get("reward_mean") is not None]
    evals = [r for r in records if r["kind"] == "eval" and r.get("accuracy") is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(
            [r["step"] for r in train],
            [r["reward_mean"] for r in train],
            label="reward (sampled, per step)",
            linewidth=1,
            alpha=0.8,
        )
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["accuracy"] for r in evals],
            "o-",
            label="eval accuracy (greedy, held out)",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
