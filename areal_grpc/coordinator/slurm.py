"""``launcher.mode=slurm``: the mesh's servers as ``srun`` job steps of the allocation the
coordinator runs in (started by ``sbatch`` or ``salloc``).

Each server is one step (one task on one node, ``launcher.trainer_cpus`` /
``rollout_cpus`` CPUs and ``*_gpus`` GPUs as gres), started with ``--overlap`` so the steps
share the allocation with the coordinator's own step. ``srun`` relays the server's output,
so the launcher learns its address from the ``LISTENING`` line as in local mode, and
supervision is the local mode's: a step that dies is restarted within the allocation.
Placement by node: the trainer ranks on the allocation's first node, the rollout servers on
the others (all on the first when there is one). ``scancel`` of the job ends every step with
it. Addresses, pids and step names land in ``mesh.json``.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache

from areal_grpc.config import RunConfig
from areal_grpc.errors import FieldError

__all__ = ["Allocation", "allocation", "check_slurm", "node_of", "step_argv", "step_ids"]


@dataclass(frozen=True)
class Allocation:
    """The job the coordinator runs in: its id and nodes (first node first)."""

    job_id: str
    nodes: tuple[str, ...]


def check_slurm() -> None:
    """FieldError naming ``launcher.mode`` unless this process runs inside an allocation."""
    if not os.environ.get("SLURM_JOB_ID"):
        raise FieldError(
            "launcher.mode",
            "slurm starts the servers as steps of the allocation it runs in: run the "
            "coordinator under sbatch or salloc (SLURM_JOB_ID is not set)",
        )
    if shutil.which("srun") is None:
        raise FieldError("launcher.mode", "slurm needs srun on PATH")


@lru_cache(maxsize=1)
def allocation() -> Allocation:
    """The current allocation (from SLURM_JOB_ID and ``scontrol show hostnames``)."""
    check_slurm()
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    nodes: list[str] = []
    if nodelist:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        nodes = out.stdout.split()
    if not nodes:
        raise FieldError("launcher.mode", f"the allocation lists no nodes ({nodelist!r})")
    return Allocation(os.environ["SLURM_JOB_ID"], tuple(nodes))


def node_of(alloc: Allocation, role: str, index: int) -> str:
    """The node a server runs on: trainers on the first, rollout servers on the rest."""
    if role == "trainer" or len(alloc.nodes) == 1:
        return alloc.nodes[0]
    rest = alloc.nodes[1:]
    return rest[index % len(rest)]


def step_ids() -> dict[str, str]:
    """The running steps of this allocation by step name (``rollout-0`` -> ``4242.3``)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or shutil.which("squeue") is None:
        return {}
    try:
        out = subprocess.run(
            ["squeue", "--steps", "-h", "-j", job, "-o", "%i %j"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    pairs = (line.split(maxsplit=1) for line in out.stdout.splitlines())
    return {name.strip(): step for step, name in (p for p in pairs if len(p) == 2)}


def step_argv(cfg: RunConfig, argv: list[str], role: str, index: int) -> list[str]:
    """``argv`` as one ``srun`` step of the allocation, on the node its role is placed on."""
    alloc = allocation()
    la = cfg.launcher
    cpus = la.trainer_cpus if role == "trainer" else la.rollout_cpus
    gpus = la.trainer_gpus if role == "trainer" else la.rollout_gpus
    step = [
        "srun",
        f"--jobid={alloc.job_id}",
        f"--job-name={role}-{index}",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--cpus-per-task={max(1, math.ceil(cpus))}",
        f"--nodelist={node_of(alloc, role, index)}",
        # One task: when it dies the step ends (and the launcher restarts it).
        "--kill-on-bad-exit=1",
        "--unbuffered",
        "--quiet",
    ]
    if gpus:
        step.append(f"--gres=gpu:{math.ceil(gpus)}")
    return [*step, *argv]
