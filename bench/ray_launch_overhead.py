"""What the Ray launcher adds to a run's start: time until the mesh is healthy, Ray vs local.

Both sides start the same mesh (``--rollout`` rollout servers and ``--ranks`` FSDP2 trainer
ranks on builtin:micro, the run's default flags) with :func:`start_mesh` and stop it again;
the clock runs from the call to every server answering SERVING on its health service.

* measured (``launcher.mode=ray``): a private Ray instance started by the launcher
  (``ray.init``), the placement group (one bundle, PACK), one actor per server, each starting
  the server as a subprocess on its node. Reported separately (``RayMesh.timings``):
  ``ray_init``, ``placement``, ``actors`` (actor processes up), ``servers`` (subprocesses
  started until healthy), and the stop (servers, actors, placement group, Ray).
* baseline (``launcher.mode=local``): the same servers as subprocesses of this process.

The sides alternate (``--repeats`` times each, order flipped every round) so machine load
hits both alike; medians are reported. ``value`` is the Ray start, ``ratio`` Ray / local;
target: Ray adds at most 15 s to a run's start. About two minutes on 2 CPU cores::

    .venv/bin/python bench/ray_launch_overhead.py [--repeats 2] [--rollout 1] [--ranks 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from results import result

from areal_grpc.config import load_config
from areal_grpc.coordinator.launcher import new_mesh, start_mesh


def one(mode: str, rollout: int, ranks: int, root: Path) -> dict[str, float]:
    """Starts and stops one mesh; seconds to healthy (and its parts on Ray)."""
    cfg = load_config(
        None,
        [
            f"launcher.mode={mode}",
            "security.allow_plaintext=true",  # Ray binds the node address
            f"rollout.num_servers={rollout}",
            f"trainer.ranks={ranks}",
            f"output.dir={root / mode}",
            "data.task=echo",
        ],
    )
    log_dir = root / mode / "logs"
    mesh = new_mesh(cfg, log_dir)
    t0 = time.monotonic()
    try:
        start_mesh(cfg, log_dir, mesh)
        up = time.monotonic() - t0
    finally:
        t1 = time.monotonic()
        mesh.stop()
        stop = time.monotonic() - t1
    out = {"up": up, "stop": stop}
    # On Ray: ray_init, placement, actors (actor processes up), servers (to healthy).
    out.update(getattr(mesh, "timings", {}))
    return out


def main() -> None:
    """Runs both sides and prints the RESULT lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rollout", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"local": [], "ray": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            order = ["local", "ray"] if i % 2 == 0 else ["ray", "local"]
            for mode in order:
                r = one(mode, args.rollout, args.ranks, Path(tmp) / f"{i}")
                runs[mode].append(r)
                print(f"round {i} {mode}: " + " ".join(f"{k}={v:.2f}s" for k, v in r.items()))

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    ray_up, local_up = med("ray", "up"), med("local", "up")
    parts = ("ray_init", "placement", "actors", "servers", "stop")
    print(
        "ray (medians): "
        + ", ".join(f"{k} {med('ray', k):.2f}s" for k in parts)
        + f"; local: up {local_up:.2f}s, stop {med('local', 'stop'):.2f}s; "
        f"Ray adds {ray_up - local_up:.2f}s to the start"
    )
    result("ray_launch_startup", ray_up, "s", local_up, "+15s")


if __name__ == "__main__":
    main()
