"""The named algorithms against each other on the built-in task, for the same wall-clock budget.

Each ``algorithm`` of ``areal_grpc.config.ALGORITHMS`` runs ``python -m areal_grpc.coordinator
algorithm=<name>`` on the built-in default (tiny model and task, local mesh, the same seed),
evaluating held-out greedy accuracy every ``--eval-every`` steps, and is stopped (Ctrl-C, as
a user stops a run) once ``--budget-s`` seconds of its training loop have passed. The curves
(accuracy against loop seconds) go into one PNG; each algorithm ends with

    RESULT bench=algo_<name> value=<last held-out accuracy> unit=accuracy baseline=<grpo's>
           ratio=<value / baseline> target=none

(no target: the runs compare the presets, they do not gate anything).

    .venv/bin/python bench/algorithms.py [--budget-s 120] [--png docs/algorithms.png]
"""

from __future__ import annotations

import argparse
import signal
import tempfile
from pathlib import Path
from typing import Any

from coordinator_run import coordinator, interrupt, metrics_records, watch
from results import result
from teardown import exit_on_sigterm

from areal_grpc.config import ALGORITHMS

ROOT = Path(__file__).resolve().parent.parent


def loop_seconds(recs: list[dict[str, Any]]) -> float:
    """Seconds of training loop so far: steps plus the evaluations between them."""
    return sum(r.get("step_s", 0.0) for r in recs if r["kind"] == "train") + sum(
        r.get("eval_s", 0.0) for r in recs if r["kind"] == "eval"
    )


def run(name: str, args: argparse.Namespace, out: Path) -> list[tuple[float, float]]:
    """(loop seconds, held-out accuracy) of each evaluation of one algorithm's run."""
    overrides = [
        f"algorithm={name}",
        "total_steps=100000",
        f"eval.every_steps={args.eval_every}",
        "checkpoint.every_steps=0",
        "checkpoint.export_hf=false",
        "output.plot=false",
        "output.progress_bar=false",
        f"output.dir={out}",
    ]
    log_path = out.parent / f"{name}.log"
    metrics = out / "metrics.jsonl"
    with coordinator(overrides, log_path) as proc:
        for _ in watch(proc, metrics):
            if loop_seconds(metrics_records(metrics)) >= args.budget_s:
                interrupt(proc)
                break
        proc.wait(timeout=120)
    recs = metrics_records(metrics)
    curve, elapsed = [], 0.0
    for r in recs:
        if r["kind"] == "train":
            elapsed += r.get("step_s", 0.0)
        elif r["kind"] == "eval":
            elapsed += r.get("eval_s", 0.0)
            if elapsed <= args.budget_s + 1e-9:
                curve.append((elapsed, float(r["accuracy"])))
    if not curve:
        raise RuntimeError(f"{name}: no evaluation within the budget; see {log_path}")
    return curve


def plot(curves: dict[str, list[tuple[float, float]]], png: Path, budget_s: float) -> None:
    """One figure, one line per algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for name, curve in curves.items():
        ax.plot([t for t, _ in curve], [a for _, a in curve], "o-", label=name, markersize=3)
    ax.set_xlabel(f"training-loop seconds (budget {budget_s:g} s each)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("algorithm presets on the built-in task (same seed, same budget)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=120.0)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "algorithms.png")
    parser.add_argument("--only", nargs="*", default=list(ALGORITHMS), help="algorithms to run")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    curves: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="algorithms-") as tmp:
        for name in args.only:
            curves[name] = run(name, args, Path(tmp) / name)
            last_t, last_acc = curves[name][-1]
            print(
                f"{name:>12}: {len(curves[name])} evaluations, accuracy "
                f"{curves[name][0][1]:.3f} -> {last_acc:.3f} at {last_t:.0f} s of loop",
                flush=True,
            )
    plot(curves, args.png, args.budget_s)
    print(f"plot: {args.png}", flush=True)
    base = curves["grpo"][-1][1] if "grpo" in curves else float("nan")
    for name, curve in curves.items():
        result(f"algo_{name}", curve[-1][1], "accuracy", base, "none")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
