"""Soak: the default run for many steps; does any process's memory or file count grow?

Runs ``python -m areal_grpc.coordinator`` on the built-in default configuration with
``total_steps=--steps`` (default 2000; stopped with Ctrl-C semantics after ``--minutes`` if
that comes first) and samples every process of the mesh (the coordinator and each child) once
a second: RSS and open file descriptors. The early sample of each process is the first one
taken once 10% of the run is done (steps, or time when the time limit ends the run first);
the end sample is the last one before the run stops. A process restarted meanwhile (a new
pid under the same name) is compared from its own early sample.

One line per measure, the worst process's end/early ratio (target: at most 1.1)::

    RESULT bench=soak_rss value=<end/early, worst process> unit=ratio baseline=1 ...
    RESULT bench=soak_fds value=<end/early, worst process> unit=ratio baseline=1 ...

    .venv/bin/python bench/soak.py [--steps 2000] [--minutes 20]
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from coordinator_run import coordinator, interrupt, metrics_records, watch
from results import result

TARGET = 1.1


@dataclass
class Samples:
    """One process's samples: (rss bytes, open fds) early and at the end."""

    name: str
    early: tuple[int, int] | None = None
    end: tuple[int, int] | None = None
    peak_rss: int = 0


def main() -> int:
    """Runs the soak and prints the RESULT lines."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--minutes", type=float, default=20.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        out = Path(tmp) / "run"
        overrides = [f"output.dir={out}", "output.progress_bar=false", f"total_steps={args.steps}"]
        log_path = Path(tmp) / "coordinator.log"
        start = time.monotonic()
        limit_s = args.minutes * 60
        procs: dict[int, Samples] = {}
        with coordinator(overrides, log_path) as run:
            root = psutil.Process(run.pid)
            stopped_by_time = False
            done = 0  # train records written so far
            for new in watch(run, out / "metrics.jsonl", every_s=1.0):
                elapsed = time.monotonic() - start
                done += sum(r["kind"] == "train" for r in new)
                if elapsed > limit_s and not stopped_by_time:
                    stopped_by_time = True
                    interrupt(run)
                # 10% of the run: of its steps, or of its time when time ends it first.
                past_early = done >= args.steps // 10 or elapsed >= limit_s / 10
                try:
                    tree = [root, *root.children(recursive=True)]
                except psutil.Error:
                    break
                for p in tree:
                    try:
                        with p.oneshot():
                            cmd = p.cmdline()
                            rss, fds = p.memory_info().rss, p.num_fds()
                    except psutil.Error:
                        continue
                    s = procs.setdefault(p.pid, Samples(" ".join(cmd[1:3])))
                    sample = (rss, fds)
                    s.peak_rss = max(s.peak_rss, rss)
                    if past_early and s.early is None and done > 0:
                        s.early = sample
                    # The end sample is the last one taken while steps still ran: the
                    # run's close (final export, plot) is not the steady state.
                    if not stopped_by_time and done < args.steps:
                        s.end = sample
            run.wait()
        wall = time.monotonic() - start
        done = sum(r["kind"] == "train" for r in metrics_records(out / "metrics.jsonl"))
        print(f"soak: {done} steps in {wall:.0f} s (exit {run.returncode}); log {log_path}")
        if run.returncode not in (0, 128 + signal.SIGINT):
            print(log_path.read_text()[-3000:])
            return 1
        worst_rss = worst_fds = 0.0
        for pid, s in sorted(procs.items()):
            if s.early is None or s.end is None:
                continue
            r_rss = s.end[0] / s.early[0]
            r_fds = s.end[1] / max(s.early[1], 1)
            worst_rss, worst_fds = max(worst_rss, r_rss), max(worst_fds, r_fds)
            print(
                f"  pid {pid:>7} {s.name:<40} rss {s.early[0] / 2**20:7.1f} -> "
                f"{s.end[0] / 2**20:7.1f} MiB ({r_rss:.3f}x, peak {s.peak_rss / 2**20:.1f}), "
                f"fds {s.early[1]} -> {s.end[1]} ({r_fds:.3f}x)"
            )
        result("soak_rss", worst_rss, "ratio", 1.0, str(TARGET))
        result("soak_fds", worst_fds, "ratio", 1.0, str(TARGET))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
