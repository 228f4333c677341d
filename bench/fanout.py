"""Weight sync to several rollout servers per host, across shaped links: what the copies cost.

Run by hand (root, iproute2): ``.venv/bin/python bench/fanout.py [--hosts 2] [--servers 4]
[--gbit 1] [--layers 2] [--methods distributed,socket,stream] [--reps 3]``.

The hosts are ``tests/support/hosts.py``'s: network namespaces with their own shared memory,
on links shaped to ``--gbit`` Gbit/s each way through a bridge. The trainer (one rank, gloo)
runs on a host of its own ("head"); the rollout servers (``bench/weight_sync.py``'s, hf engine)
on ``--hosts`` rollout hosts; this process, on the bridge, drives the fleet updates as the
coordinator does (``clients.fleet.update_fleet_weights``). Per method, the same update runs
into one server per host (the baseline) and into ``--servers`` servers per host, alternating,
after unmeasured rounds. Each method prints ``RESULT bench=weight_sync_fanout_<method>_<S>x<H>
value=<s> unit=s baseline=<s> ratio=<r> target=1.3``: the time into S servers on each of H
hosts over the time into one per host. Each server receiving its own copy makes the ratio
about S (the head's link carries S x H copies); with one send per host (a server of each
host relays the update to the others there, by shared memory) it is about 1 plus what the
relay's write and the others' loads add.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support.hosts, the hosts the tests use

import weight_sync as ws  # noqa: E402
from results import result  # noqa: E402

from areal_grpc.launch import Child, python_module_argv, start_child, stop_children  # noqa: E402
from tests.support.hosts import Host, hosts, unavailable  # noqa: E402

TARGET = 1.3


def start_rollouts(host: Host, count: int, model_dir: Path, root: Path, logs: Path) -> list[Child]:
    """``count`` rollout servers on ``host`` (bench/weight_sync.py's child mode)."""
    argv = [
        sys.executable,
        str(Path(__file__).parent / "weight_sync.py"),
        "--serve-rollout",
        str(model_dir),
        str(root),
        "--serve-netns",
        host.netns,
        host.ip,
    ]
    return [
        start_child(f"rollout-{host.name}-{i}", host.argv(argv), log_dir=logs, ready_timeout_s=300)
        for i in range(count)
    ]


def main() -> int:
    """Runs the cases; one RESULT line per method."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=2, help="rollout hosts")
    parser.add_argument("--servers", type=int, default=4, help="rollout servers per host")
    parser.add_argument("--gbit", type=float, default=1.0, help="each host's link, each way")
    parser.add_argument("--layers", type=int, default=2, help="of bench/weight_sync.py's model")
    parser.add_argument("--methods", default="distributed,socket,stream")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    why = unavailable()
    if why:
        parser.error(why)
    if args.hosts < 1 or args.servers < 2:
        parser.error("--hosts must be at least 1 and --servers at least 2")
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(ws.METHODS) | (set(methods) & set(ws.SAME_HOST)))
    if unknown:
        parser.error(
            f"--methods: {unknown} do not cross hosts; choose from distributed, socket, stream"
        )
    names = ["head", *(f"r{i}" for i in range(args.hosts))]
    with tempfile.TemporaryDirectory(prefix="bench-fanout-") as tmp, hosts(names, args.gbit) as hs:
        base = Path(tmp)
        model_dir = ws.build_model_dir(base / "model", args.layers)
        sd = ws.published_state_dict(model_dir)
        mib = sum(t.numel() * t.element_size() for t in sd.values()) / 2**20
        head = hs["head"]
        print(
            f"model: {mib:.0f} MiB float32; trainer on 'head', {args.hosts} rollout host(s); "
            f"every host's link {args.gbit:g} Gbit/s each way",
            flush=True,
        )
        trainer = start_child(
            "trainer",
            head.argv(
                python_module_argv(
                    "areal_servers.trainer",
                    f"--host={head.ip}",
                    "--port=0",
                    "--rank=0",
                    "--world-size=1",
                    f"--master-addr={head.ip}",
                    "--master-port=29533",
                    "--log-level=WARNING",
                    f"model.source={model_dir}",
                    "trainer.torch_threads=1",
                    f"output.dir={base}",
                    "weight_sync.backend=gloo",
                    f"weight_sync.master_addr={head.ip}",
                    "--allow-plaintext",
                )
            ),
            log_dir=base / "logs",
            env={"OMP_NUM_THREADS": "1"},
            ready_timeout_s=300,
        )
        children: list[Child] = [trainer]
        fleet = ws.Fleet()
        try:
            per_host: dict[str, list[Child]] = {}
            for i in range(args.hosts):
                host = hs[f"r{i}"]
                per_host[host.name] = start_rollouts(
                    host, args.servers, model_dir, base / "weights", base / "logs"
                )
                children += per_host[host.name]
            one = [c.address for c in (cs[0] for cs in per_host.values())]
            every = [c.address for cs in per_host.values() for c in cs]
            step, version = 0, 0

            def update(method: str, addresses: list[str]) -> float:
                nonlocal step, version
                version = ws.train_one_step(trainer.address, step, version)
                step += 1
                return fleet.time_sync(trainer.address, addresses, method, relayed=True)

            # The servers left out of a round fall behind; each round brings its own ones to
            # the newest version, so an update always carries the whole model.
            for method in methods:
                for addresses in (one, every, one, every):  # unmeasured
                    update(method, addresses)
                times: dict[str, list[float]] = {"one": [], "every": []}
                for r in range(args.reps):
                    order = ("one", "every") if r % 2 == 0 else ("every", "one")
                    for case in order:
                        times[case].append(update(method, one if case == "one" else every))
                t1, tn = statistics.median(times["one"]), statistics.median(times["every"])
                print(
                    f"{method}: 1 server per host {t1:.3f} s ({times['one']}), "
                    f"{args.servers} per host {tn:.3f} s ({times['every']})",
                    flush=True,
                )
                result(
                    f"weight_sync_fanout_{method}_{args.servers}x{args.hosts}",
                    tn,
                    "s",
                    t1,
                    str(TARGET),
                )
        finally:
            fleet.close()
            stop_children(children)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
