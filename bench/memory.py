"""Peak memory of benchmark processes, as the kernel counts it."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable
from pathlib import Path

import psutil


def peak_rss_gib(pids: Iterable[int], *, descendants: bool = False) -> float:
    """The peak resident memory (VmHWM) of processes ``pids`` (and, with ``descendants``, of
    every process under them), summed, in GiB; a process already gone counts nothing."""
    procs: list[int] = []
    for pid in pids:
        procs.append(pid)
        if descendants:
            with contextlib.suppress(psutil.Error):
                procs.extend(p.pid for p in psutil.Process(pid).children(recursive=True))
    total_kib = 0
    for pid in procs:
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{pid}/status").read_text()
            found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
            total_kib += int(found.group(1)) if found else 0
    return total_kib / (1 << 20)
