"""A second host on this machine, for benchmarks: a network namespace joined to this one by a
veth pair shaped to a given rate each way (``tc``'s token bucket), so bytes between the two
"hosts" cross a link of known speed instead of loopback.

What it is not: the namespace shares this machine's CPUs, memory and filesystem, so only the
network is another host's. Needs root (CAP_NET_ADMIN) and iproute2 (``ip``, ``tc``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

# The test hosts' helpers (tests/support/hosts.py): one way to run iproute2 and shape a link.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.hosts import run as _run
from tests.support.hosts import tbf

__all__ = ["Link", "add_option", "enter", "from_args", "shaped_link"]

# setns(2)'s flag for a network namespace (os.setns arrives in Python 3.12).
_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Link:
    """Both ends of a shaped link: this namespace's and the peer namespace's."""

    netns: str
    gbit: float
    host_ip: str
    peer_ip: str
    host_if: str
    peer_if: str

    @property
    def label(self) -> str:
        """``link10gbit`` and the like, for a benchmark case's name."""
        return f"link{self.gbit:g}gbit"


def _ip(*args: str) -> None:
    _run("ip", *args)


def _shape(gbit: float, dev: str, netns: str | None = None) -> None:
    argv = ["tc", "qdisc", "add", "dev", dev, "root", *tbf(gbit)]
    _run(*(["ip", "netns", "exec", netns] if netns else []), *argv)


@contextmanager
def shaped_link(gbit: float) -> Iterator[Link]:
    """A network namespace reached over a veth pair shaped to ``gbit`` Gbit/s each way;
    removed on exit (the pair goes with it). RuntimeError, naming the command, when this
    process may not make one (not root, no ``ip``)."""
    if gbit <= 0:
        raise ValueError(f"the link's rate must be positive, got {gbit} Gbit/s")
    pid = os.getpid()
    subnet = f"10.231.{pid % 250}"
    link = Link(
        netns=f"areal-bench-{pid}",
        gbit=gbit,
        host_ip=f"{subnet}.1",
        peer_ip=f"{subnet}.2",
        host_if=f"ab{pid}h",
        peer_if=f"ab{pid}p",
    )
    try:
        _ip("netns", "add", link.netns)
    except (OSError, RuntimeError) as exc:
        raise RuntimeError(
            f"a shaped link needs root and iproute2 (a network namespace): {exc}"
        ) from None
    made_pair = False
    try:
        _ip("link", "add", link.host_if, "type", "veth", "peer", "name", link.peer_if)
        made_pair = True
        _ip("link", "set", link.peer_if, "netns", link.netns)
        _ip("addr", "add", f"{link.host_ip}/30", "dev", link.host_if)
        _ip("link", "set", link.host_if, "up")
        for args in (
            ("addr", "add", f"{link.peer_ip}/30", "dev", link.peer_if),
            ("link", "set", link.peer_if, "up"),
            ("link", "set", "lo", "up"),
        ):
            _ip("netns", "exec", link.netns, "ip", *args)
        _shape(gbit, link.host_if)
        _shape(gbit, link.peer_if, link.netns)
        yield link
    finally:
        # Only what this call made: the namespace, whose end of the pair goes with it (and the
        # pair with its end), and the pair if it never reached the namespace.
        subprocess.run(["ip", "netns", "del", link.netns], capture_output=True)
        if made_pair:
            subprocess.run(["ip", "link", "del", link.host_if], capture_output=True)


def enter(netns: str) -> None:
    """Moves the calling thread, and every thread it starts after, into ``netns``: call it
    first in a child process, before anything opens a socket or starts a thread."""
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
    finally:
        os.close(fd)


def add_option(parser: argparse.ArgumentParser, what: str) -> None:
    """``--link GBIT``: ``what`` (the benchmark's servers) on a second host behind a link."""
    parser.add_argument(
        "--link",
        type=float,
        metavar="GBIT",
        help=f"{what} on a second host: a network namespace over a link shaped to GBIT Gbit/s "
        "each way (bench/link.py; needs root)",
    )


@contextmanager
def from_args(parser: argparse.ArgumentParser, gbit: float | None) -> Iterator[Link | None]:
    """The link ``--link`` asks for (None without it), made for the block; a rate that is
    not positive, or a machine that cannot make one, is the parser's usage error."""
    if gbit is None:
        yield None
        return
    with ExitStack() as stack:
        try:
            link = stack.enter_context(shaped_link(gbit))
        except (ValueError, RuntimeError) as exc:
            parser.error(f"--link: {exc}")
        yield link
