"""Hosts on one machine, for tests: each "host" is a network namespace with its own shared
memory, joined to the others through a bridge by a veth link shaped to a rate each way
(``tc``'s token bucket, as ``bench/link.py`` shapes its one link).

What a host has of its own: its network (an address on the hosts' subnet, its own loopback)
and its ``/dev/shm`` (so a shared-memory weight update offered by another host is declined, as
it would be across machines). What it shares with the others: the CPUs, the memory, the
filesystem and the process table. Processes are the same binaries, started under ``ip netns
exec``. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2; :func:`unavailable` says why
not where they are missing.

The test process itself sits on the bridge (the subnet's ``.1``) and reaches every host over
its link, as an operator's machine would.

Delay and random loss are not shaped: this machine's kernel has no ``netem`` qdisc (nor
``fq``, nor tc classifiers). A host can be cut off (its link down) and brought back.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Host", "Hosts", "hosts", "run", "tbf", "unavailable"]

# Mounted over /dev/shm in each of a host's processes (their mount namespace is private: ``ip
# netns exec`` makes one per command), so all processes of one host share it.
_SHM_WRAPPER = 'mount --bind "$0" /dev/shm && exec "$@"'


def tbf(gbit: float) -> list[str]:
    """tc's arguments for a token bucket of ``gbit`` Gbit/s (after ``root``)."""
    rate = int(gbit * 1e9)
    # The bucket holds 4 ms of the rate (at least 1 MiB), so the kernel's timer refills it
    # before it runs dry. Measured (256 MiB, raw TCP, bench/link.py): 0.60, 1.20 and 2.93 GB/s
    # of payload at 5, 10 and 25 Gbit/s, i.e. the rate less the TCP/IP headers up to
    # 10 Gbit/s; at 25 the two cores are the limit, as on loopback.
    burst = max(1 << 20, rate // 8 // 250)
    return ["tbf", "rate", f"{rate}bit", "burst", str(burst), "latency", "10ms"]


@dataclass
class Host:
    """A host: its namespace, address, shared memory, and the two ends of its link."""

    name: str
    netns: str
    ip: str
    shm: Path
    outer_if: str  # the link's end on the bridge (in the test's namespace)
    gbit: float

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this host."""
        return ["ip", "netns", "exec", self.netns, "sh", "-c", _SHM_WRAPPER, str(self.shm), *argv]

    def reshape(self, gbit: float) -> None:
        """Changes this host's link rate, both ways, while processes use it."""
        run("tc", "qdisc", "change", "dev", self.outer_if, "root", *tbf(gbit))
        run(*self._inner("tc", "qdisc", "change", "dev", "eth0", "root", *tbf(gbit)))
        self.gbit = gbit

    def cut(self) -> None:
        """Takes this host off the network (its link down); :meth:`restore` brings it back."""
        run("ip", "link", "set", self.outer_if, "down")

    def restore(self) -> None:
        """Brings a cut host's link back up."""
        run("ip", "link", "set", self.outer_if, "up")

    def _inner(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass
class Hosts:
    """The hosts of one test, by name, and the bridge's address (the test's own)."""

    by_name: dict[str, Host]
    bridge_ip: str

    def __getitem__(self, name: str) -> Host:
        return self.by_name[name]


def run(*argv: str) -> None:
    """Runs a command; RuntimeError naming it and its error when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


def unavailable() -> str:
    """Why hosts cannot be made here ("" where they can)."""
    if os.geteuid() != 0:
        return "hosts need root (network namespaces, tc, mounts)"
    missing = [t for t in ("ip", "tc", "mount", "sh") if shutil.which(t) is None]
    if missing:
        return f"hosts need {', '.join(missing)} (iproute2, util-linux)"
    return ""


@contextmanager
def hosts(names: Sequence[str], gbit: float = 1.0) -> Iterator[Hosts]:
    """Hosts named ``names``, each on a link of ``gbit`` Gbit/s each way; all removed on exit
    (namespaces, links, bridge and their shared memory)."""
    pid = os.getpid()
    tag = f"{pid % 100000}"
    subnet = f"10.233.{pid % 250}"
    bridge = f"arb{tag}"
    root = Path("/dev/shm") / f"areal-hosts-{pid}"
    made: list[Host] = []
    try:
        run("ip", "link", "add", "name", bridge, "type", "bridge")
        run("ip", "addr", "add", f"{subnet}.1/24", "dev", bridge)
        run("ip", "link", "set", bridge, "up")
        for i, name in enumerate(names):
            host = Host(
                name=name,
                netns=f"areal-{tag}-{name}",
                ip=f"{subnet}.{i + 2}",
                shm=root / name,
                outer_if=f"arh{tag}h{i}",
                gbit=gbit,
            )
            inner = f"arh{tag}i{i}"
            host.shm.mkdir(parents=True)
            run("ip", "netns", "add", host.netns)
            made.append(host)
            run("ip", "link", "add", host.outer_if, "type", "veth", "peer", "name", inner)
            run("ip", "link", "set", inner, "netns", host.netns)
            run("ip", "link", "set", host.outer_if, "master", bridge, "up")
            for args in (
                ("link", "set", inner, "name", "eth0"),
                ("addr", "add", f"{host.ip}/24", "dev", "eth0"),
                ("link", "set", "eth0", "up"),
                ("link", "set", "lo", "up"),
            ):
                run(*host._inner("ip", *args))
            run("tc", "qdisc", "add", "dev", host.outer_if, "root", *tbf(gbit))
            run(*host._inner("tc", "qdisc", "add", "dev", "eth0", "root", *tbf(gbit)))
        yield Hosts({h.name: h for h in made}, f"{subnet}.1")
    finally:
        for host in made:
            # The namespace takes its end of the link, and the pair goes with it.
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
            subprocess.run(["ip", "link", "del", host.outer_if], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
