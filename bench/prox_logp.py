"""Proximal log-probs: ``loglinear`` (no forward pass) vs ``recompute``, on the default run.

Two runs of ``python -m areal_grpc.coordinator`` on the built-in default (tiny model and
task, local mesh), the same seed and settings except ``trainer.ppo.prox_logp_method``.
Each batch is trained in ``--minibatches`` PPO mini-batches (several updates per batch are
what make the proximal log-probs cost a forward pass: with one update they are free) and
``--staleness`` lets rollouts run ahead so that tokens are off-policy and the approximation
has something to approximate.

Measured per run: the trainer's seconds per step as the coordinator sees it (``train_s``:
TrainStep on every rank, mean over the steps after ``--warmup``), and held-out accuracy at
the end. On the default 0.16M-parameter model a forward pass is a small part of a step (gRPC,
collectives and four optimizer steps dominate), so the trainer alone is also timed in this
process on ``--engine-model`` (default ``builtin:tiny``, about 1M parameters) with a batch of
``--groups`` x ``--group-size`` sequences of about ``--tokens`` tokens whose behaviour tokens
are 0-2 versions stale, the two methods' steps interleaved (``--engine-steps`` each).

    .venv/bin/python bench/prox_logp.py [--steps 200] [--minibatches 4] [--staleness 2]

Ends with ``RESULT bench=prox_logp_loglinear`` (trainer s/step in this process, loglinear vs
recompute, target <= 0.8), ``RESULT bench=prox_logp_loglinear_mesh`` (the same through the
mesh) and ``RESULT bench=prox_logp_accuracy`` (final held-out accuracy, loglinear vs
recompute, target >= 0.95).
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Any

from coordinator_run import coordinator, metrics_records
from results import result
from teardown import exit_on_sigterm


def run(method: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One coordinator run with ``method``: its train records, evals and wall time."""
    overrides = [
        f"total_steps={args.steps}",
        f"trainer.ppo.n_minibatches={args.minibatches}",
        f"trainer.ppo.prox_logp_method={method}",
        f"staleness.max_staleness={args.staleness}",
        f"eval.every_steps={args.steps}",
        "checkpoint.every_steps=0",
        "checkpoint.export_hf=false",
        "output.plot=false",
        "output.progress_bar=false",
        f"output.dir={out}",
    ]
    start = time.monotonic()
    log_path = out.parent / f"{method}.log"
    with coordinator(overrides, log_path) as proc:
        proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"the {method} run failed ({proc.returncode}): see {log_path}")
    records = metrics_records(out / "metrics.jsonl")
    return {
        "wall_s": time.monotonic() - start,
        "train": [r for r in records if r["kind"] == "train"],
        "evals": [r for r in records if r["kind"] == "eval"],
    }


def engine_step_times(args: argparse.Namespace) -> dict[str, float]:
    """Median seconds of one TrainerEngine step per method, steps interleaved."""
    import torch
    from areal_servers.trainer.algorithm import token_logprobs
    from areal_servers.trainer.engine import TrainerEngine

    from areal_grpc.config import ModelConfig, OptimizerSettings, PPOSettings, TrainerConfig

    torch.manual_seed(0)
    rows, width, prompt = args.groups * args.group_size, args.tokens, args.tokens // 4
    engines: dict[str, TrainerEngine] = {}
    for method in ("recompute", "loglinear"):
        engines[method] = TrainerEngine(
            TrainerConfig(
                fsdp=False,
                device="cpu",
                ppo=PPOSettings(n_minibatches=args.minibatches, prox_logp_method=method),
                max_tokens_per_mb=4096,
                optimizer=OptimizerSettings(lr=1e-4),
            ),
            ModelConfig(source=args.engine_model),
        )
    ids = torch.randint(3, 256, (rows, width))
    attn = torch.ones(rows, width, dtype=torch.bool)
    loss = torch.zeros(rows, width, dtype=torch.bool)
    loss[:, prompt:] = True
    with torch.no_grad():
        logp, _ = token_logprobs(
            engines["recompute"].model(input_ids=ids, attention_mask=attn).logits, ids
        )
    times: dict[str, list[float]] = {m: [] for m in engines}
    for step in range(args.engine_steps + 1):
        for method, engine in engines.items():
            version = engine.version
            stale = torch.randint(0, 3, (rows, 1))
            batch = {
                "input_ids": ids,
                "attention_mask": attn,
                "loss_mask": loss,
                "logprobs": ((logp + 0.05 * torch.randn(rows, width)).clamp(max=0) * loss).float(),
                "versions": torch.where(loss, (version - stale).clamp(min=0), -1),
                "rewards": torch.randint(0, 2, (rows,)).float(),
                "group_index": torch.arange(args.groups).repeat_interleave(args.group_size),
            }
            start = time.perf_counter()
            engine.train_step(batch)
            if step:  # the first step of each pays one-off set-up
                times[method].append(time.perf_counter() - start)
    return {m: sorted(t)[len(t) // 2] for m, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of s/step")
    parser.add_argument("--engine-model", default="builtin:tiny")
    parser.add_argument("--engine-steps", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    engine = engine_step_times(args)
    print(
        f"trainer engine ({args.engine_model}, {args.minibatches} mini-batches, "
        f"{args.groups}x{args.group_size} sequences of {args.tokens} tokens): recompute "
        f"{engine['recompute']:.3f} s/step, loglinear {engine['loglinear']:.3f} s/step",
        flush=True,
    )
    got: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="prox-logp-") as tmp:
        for method in ("recompute", "loglinear"):
            got[method] = run(method, args, Path(tmp) / method)
    summary: dict[str, dict[str, float]] = {}
    for method, r in got.items():
        steady = r["train"][args.warmup :]
        summary[method] = {
            "train_s": mean(t["train_s"] for t in steady),
            "step_s": mean(t["step_s"] for t in steady),
            "accuracy": r["evals"][-1]["accuracy"],
            "first_accuracy": r["evals"][0]["accuracy"],
            "wall_s": r["wall_s"],
        }
        print(
            f"{method:>9}: trainer {summary[method]['train_s']:.3f} s/step, whole step "
            f"{summary[method]['step_s']:.3f} s, held-out accuracy "
            f"{summary[method]['first_accuracy']:.3f} -> {summary[method]['accuracy']:.3f}, "
            f"run {summary[method]['wall_s']:.0f} s",
            flush=True,
        )
    rec, log = summary["recompute"], summary["loglinear"]
    result("prox_logp_loglinear", engine["loglinear"], "s/step", engine["recompute"], "<=0.8")
    result("prox_logp_loglinear_mesh", log["train_s"], "s/step", rec["train_s"], "<=0.8")
    result("prox_logp_accuracy", log["accuracy"], "accuracy", rec["accuracy"], ">=0.95")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
