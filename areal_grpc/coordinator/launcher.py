"""The run's launcher, by ``launcher.mode``: local subprocesses, attached servers, or Ray.

Above both :mod:`areal_grpc.coordinator.mesh` (local and attach) and
:mod:`areal_grpc.coordinator.ray_launcher` (which builds on the former), so neither imports the
other's caller; Ray is imported only for ``launcher.mode=ray`` (it is an optional extra).
"""

from __future__ import annotations

import threading
from pathlib import Path

from areal_grpc.config import RunConfig
from areal_grpc.coordinator.mesh import FleetLauncher, LocalFleet, Mesh, start_local_mesh
from areal_grpc.errors import FieldError

__all__ = ["fleet_launcher", "new_mesh", "start_mesh"]


def new_mesh(cfg: RunConfig, log_dir: Path) -> Mesh:
    """An empty mesh of the configured launcher, to pass to :func:`start_mesh`."""
    if cfg.launcher.mode == "ray":
        try:
            from areal_grpc.coordinator.ray_launcher import RayMesh
        except ImportError as exc:
            raise FieldError(
                "launcher.mode", f"ray needs the ray extra (pip install -e '.[ray]'): {exc}"
            ) from exc
        return RayMesh([], [], log_dir=log_dir)
    return Mesh([], [], log_dir=log_dir)


def start_mesh(
    cfg: RunConfig,
    log_dir: Path,
    mesh: Mesh | None = None,
    cancelled: threading.Event | None = None,
) -> Mesh:
    """Starts (local, ray) or attaches to (attach) the mesh and waits until it is healthy.

    Servers are recorded in ``mesh`` as they start, so a caller that passes its own (from
    :func:`new_mesh`) can stop them whatever happens; ``cancelled`` aborts before they start.
    On an error the servers started so far are stopped here.
    """
    if cfg.launcher.mode == "ray":
        from areal_grpc.coordinator.ray_launcher import start_ray_mesh

        return start_ray_mesh(cfg, log_dir, mesh, cancelled)
    return start_local_mesh(cfg, log_dir, mesh, cancelled)


def fleet_launcher(cfg: RunConfig, mesh: Mesh) -> FleetLauncher | None:
    """What can start and stop rollout servers for this run (None in attach mode)."""
    if cfg.launcher.mode == "attach":
        return None
    if cfg.launcher.mode == "ray":
        return mesh  # type: ignore[return-value]  # a RayMesh implements FleetLauncher
    return LocalFleet(cfg, mesh)
