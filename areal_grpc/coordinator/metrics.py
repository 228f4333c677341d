"""Run metrics: JSONL (always), TensorBoard and Weights & Biases (when on), a PNG of the
curves at the end.

Both trackers get the same records (``<kind>/<name>``) and each step's rollout samples
(``rollouts/``) under ``samples``: TensorBoard as text, W&B as a table.

``metrics.jsonl`` has one JSON object per line with a ``kind``: ``"train"`` (one per step),
``"eval"`` (one per evaluation). ``batches.jsonl`` records, per step, which prompts were
trained (task ids, dataset ids, head versions): the audit trail of "each prompt trained once,
within the staleness bound".
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from areal_grpc.config import RunConfig

__all__ = [
    "SAMPLE_COLUMNS",
    "MetricsWriter",
    "plot_curves",
    "read_jsonl",
    "sample_markdown",
    "start_wandb",
]

# The columns of W&B's samples table, one row per rollout record.
SAMPLE_COLUMNS = (
    "task_id",
    "sample",
    "reward",
    "advantage",
    "finish_reason",
    "versions",
    "prompt",
    "completion",
)

log = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf; null keeps the file parseable by every reader.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _numbers(values: Mapping[str, Any]) -> dict[str, float]:
    # What the trackers chart: finite numbers (no flags, no text).
    return {
        k: v
        for k, v in values.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def start_wandb(cfg: RunConfig, out_dir: Path) -> Any:
    """A W&B run for ``cfg`` (output.wandb_*, else W&B's environment variables), with the
    resolved config; its metrics are charted against ``step``, which a recovery may repeat."""
    import wandb

    from areal_grpc.config import to_json

    out = cfg.output
    # W&B's own variables fill what the config leaves open (an argument would override them).
    env = os.environ
    mode = (env.get("WANDB_MODE") or "offline") if out.wandb_mode == "auto" else out.wandb_mode
    run = wandb.init(
        project=out.wandb_project or env.get("WANDB_PROJECT") or "areal-grpc",
        name=out.wandb_name,
        mode=mode,
        dir=env.get("WANDB_DIR") or str(out_dir),
        config=json.loads(to_json(cfg)),
    )
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    return run


class MetricsWriter:
    """Appends records to ``<dir>/metrics.jsonl`` and, optionally, TensorBoard and W&B."""

    def __init__(
        self,
        out_dir: Path,
        tensorboard: bool = True,
        keep_until: int | None = None,
        wandb_run: Any = None,
    ) -> None:
        """``keep_until``: on resume, drop records of steps after it (they are redone).
        ``wandb_run``: a run from :func:`start_wandb`, which the caller finishes."""
        self.out_dir = out_dir
        self._wandb = wandb_run
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
        """Writes one record; numbers also go to the trackers as ``<kind>/<name>``."""
        record = {"kind": kind, "step": step, **{k: _clean(v) for k, v in values.items()}}
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        numbers = {f"{kind}/{k}": v for k, v in _numbers(values).items()}
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log({"step": step, **numbers})
        return record

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """Step ``step``'s samples (rollout records, numbered from 0 as in ``batches.jsonl``)
        under ``samples`` (TensorBoard text, a W&B table of :data:`SAMPLE_COLUMNS`), at the
        step of the scalars they were trained in (``step + 1``); nothing without a tracker."""
        if not samples:
            return
        if self._tb is not None:
            text = "\n\n".join(sample_markdown(s) for s in samples)
            self._tb.add_text("samples", text, step + 1)
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            rows = [[_sample_cell(s, c) for c in SAMPLE_COLUMNS] for s in samples]
            table = wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows)
            self._wandb.log({"step": step + 1, "samples": table})

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


def _sample_cell(sample: Mapping[str, Any], column: str) -> Any:
    if column == "versions":
        return _versions(sample)
    if column in ("prompt", "completion"):
        return _text(sample, column)
    return sample.get(column)


def _versions(sample: Mapping[str, Any]) -> str:
    # The policy versions that generated the completion, as "first..last".
    versions = sample.get("versions") or []
    return f"{min(versions)}..{max(versions)}" if versions else "-"


def _text(sample: Mapping[str, Any], part: str) -> str:
    # The prompt or completion as text; its token ids where there was no tokenizer.
    text = sample.get(part)
    return text if text is not None else " ".join(map(str, sample[f"{part}_ids"]))


def sample_markdown(sample: Mapping[str, Any]) -> str:
    """One rollout record as TensorBoard's markdown: a header line (task, sample, reward,
    advantage, finish reason, versions), then the prompt and the completion as code blocks
    (token ids when there is no text)."""
    advantage = sample.get("advantage")
    head = (
        f"**{sample['task_id']} #{sample['sample']}**: reward {sample['reward']:g}, "
        f"advantage {'-' if advantage is None else f'{advantage:.4g}'}, "
        f"{sample['finish_reason']}, generated at versions {_versions(sample)}"
    )

    def block(part: str) -> str:
        # Indented code: markdown shows it verbatim, whatever fences or markup it holds.
        body = _text(sample, part)
        return "\n".join("    " + line for line in (body or " ").splitlines() or [" "])

    return f"{head}\n\nprompt:\n\n{block('prompt')}\n\ncompletion:\n\n{block('completion')}"


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
