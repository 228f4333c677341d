"""``python -m areal_grpc.coordinator.submit [--config FILE] [key=value ...] [--dry-run]``:
writes the sbatch script of a run from its config and submits it.

The job runs ``python -m areal_grpc.coordinator`` with ``launcher.mode=slurm`` on the first
node of its allocation; the coordinator starts the servers as job steps
(:mod:`areal_grpc.coordinator.slurm`). The run's config is written beside the script (under
``output.dir``), so the job reads exactly what was submitted. ``launcher.slurm.*`` give the
job's nodes, time limit, partition, account and gres. ``--dry-run`` prints the script and
submits nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from areal_grpc.config import RunConfig, load_config, to_yaml
from areal_grpc.errors import FieldError

__all__ = ["main", "sbatch_script"]


def sbatch_script(cfg: RunConfig, config_path: Path) -> str:
    """The batch script of the run ``cfg`` (its config file at ``config_path``)."""
    la = cfg.launcher
    out = Path(cfg.output.dir).resolve()
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={cfg.name}",
        f"#SBATCH --nodes={la.slurm.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --time={la.slurm.time}",
        f"#SBATCH --output={out}/slurm-%j.out",
    ]
    if la.slurm.partition:
        lines.append(f"#SBATCH --partition={la.slurm.partition}")
    if la.slurm.account:
        lines.append(f"#SBATCH --account={la.slurm.account}")
    if la.slurm.gres:
        lines.append(f"#SBATCH --gres={la.slurm.gres}")
    command = [sys.executable, "-m", "areal_grpc.coordinator", "--config", str(config_path)]
    lines += [
        "",
        "# The coordinator runs here, on the first node; the servers run as job steps.",
        f"cd {shlex.quote(str(Path.cwd()))}",
        "exec " + " ".join(shlex.quote(a) for a in command),
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: write the script and config, then sbatch them (or print with --dry-run)."""
    parser = argparse.ArgumentParser(prog="python -m areal_grpc.coordinator.submit")
    parser.add_argument("--config", help="the run's YAML config")
    parser.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        cfg = dataclasses.replace(cfg, launcher=dataclasses.replace(cfg.launcher, mode="slurm"))
    except FieldError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    out = Path(cfg.output.dir).resolve()
    config_path = out / "submitted-config.yaml"
    script = sbatch_script(cfg, config_path)
    if args.dry_run:
        print(script, end="")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    config_path.write_text(to_yaml(cfg))
    script_path = out / "submit.sbatch"
    script_path.write_text(script)
    done = subprocess.run(
        ["sbatch", "--parsable", str(script_path)], capture_output=True, text=True
    )
    if done.returncode != 0:
        print(f"sbatch failed: {done.stderr.strip()}", file=sys.stderr)
        return 1
    job = done.stdout.strip().split(";")[0]
    print(f"SUBMITTED {job} {script_path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
