"""LoRA against full fine-tuning on the real model: what a weight update moves, what a step
costs, and how far the same budget gets.

Runs the documented example (``examples/smollm2_arith.yaml``: SmolLM2-135M-Instruct, the
arithmetic set, one rollout server and one trainer rank on 2 CPU cores) twice for the same
number of steps, as a user would with ``python -m areal_grpc.coordinator``: once as it is
(every weight trains and travels) and once with ``model.lora.rank`` set (adapters on every
linear layer; only they train and travel). Each case prints

    RESULT bench=lora_<case> value=<LoRA's> unit=<u> baseline=<full fine-tuning's>
           ratio=<value / baseline> target=<t>

for ``sync_bytes`` (bytes per weight update, target 0.05), ``sync_s`` (seconds per update),
``train_s`` (trainer seconds per step), ``trainer_memory`` (the trainer's peak RSS) and
``accuracy`` (held-out greedy accuracy at the end of the budget).

    .venv/bin/python bench/lora.py [--steps 16] [--rank 16] [--lora-lr 2e-4]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
from pathlib import Path
from typing import Any

from real_model import example_config, run_mesh
from results import result
from teardown import exit_on_sigterm


def summary(mesh: dict[str, Any]) -> dict[str, float]:
    """The per-step medians, the trainer's peak RSS and the last evaluation of one run."""
    steps = mesh["train"][1:] or mesh["train"]  # the first step also warms everything up
    trainer = [v for k, v in mesh["per_process_gib"].items() if "trainer" in k]
    return {
        "sync_bytes": statistics.median(r["sync_bytes"] for r in steps),
        "sync_s": statistics.median(r["sync_s"] for r in steps),
        "train_s": statistics.median(r["train_s"] for r in steps),
        "trainer_memory": max(trainer) if trainer else float("nan"),
        "accuracy": mesh["evals"][-1]["accuracy"] if mesh["evals"] else float("nan"),
        "accuracy_start": mesh["evals"][0]["accuracy"] if mesh["evals"] else float("nan"),
        "wall_s": mesh["wall_s"],
    }


def main() -> int:
    """Runs both cases (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=8)
    parser.add_argument("--eval-prompts", type=int, default=100)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    # Adapters start at zero and have few parameters: they need a larger step than the
    # full model's 2e-5 to move as far.
    parser.add_argument("--lora-lr", type=float, default=2e-4)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    common = {
        "total_steps": args.steps,
        "eval.every_steps": args.eval_every,
        "eval.max_prompts": args.eval_prompts,
    }
    cases = {
        "full": common,
        "lora": common
        | {
            "model.lora.rank": args.rank,
            "model.lora.alpha": args.alpha,
            "trainer.optimizer.lr": args.lora_lr,
        },
    }
    got: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp_name:
        for name, overrides in cases.items():
            tmp = Path(tmp_name) / name
            mesh = run_mesh(example_config(tmp, overrides), tmp / "run")
            got[name] = summary(mesh)
            s = got[name]
            print(
                f"{name:>4}: {s['wall_s']:.0f} s wall; median update {s['sync_bytes'] / 2**20:.2f} "
                f"MiB in {s['sync_s']:.2f} s; median train {s['train_s']:.1f} s/step; trainer "
                f"peak {s['trainer_memory']:.2f} GiB; accuracy {s['accuracy_start']:.3f} -> "
                f"{s['accuracy']:.3f}",
                flush=True,
            )
    lora, full = got["lora"], got["full"]
    units = {
        "sync_bytes": ("bytes", "0.05"),
        "sync_s": ("s", "none"),
        "train_s": ("s", "none"),
        "trainer_memory": ("GiB", "none"),
        "accuracy": ("accuracy", "none"),
    }
    for case, (unit, target) in units.items():
        result(f"lora_{case}", lora[case], unit, full[case], target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
