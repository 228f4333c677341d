"""A process's directory in shared memory (``/dev/shm``) for SHARED_MEMORY weight updates.

A sender on the same host as its receivers writes each version there once (as DISK writes a
version directory) and every receiver maps it without a copy. The directory is named after
the owning process, ``areal-shm-<pid>``, carries the project's marker, and holds a
``.probe`` file whose random contents a receiver reads back to prove it shares this memory
(another container on the same host does not).

Lifetime: the owner keeps one version (the one being served) and removes the directory when
it exits; a directory whose owner died without exiting (kill -9) is removed by the next
process that opens its own (:func:`sweep_dead`), so segments do not leak.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import re
import secrets
import threading
from pathlib import Path

from areal_grpc.paths import is_marked, remove_owned, write_marker

__all__ = [
    "PREFIX",
    "PROBE_FILE",
    "SHM_BASE",
    "host_id",
    "is_shared_root",
    "own_root",
    "read_probe",
    "release_own",
    "sweep_dead",
]

SHM_BASE = "/dev/shm"
PREFIX = "areal-shm-"
PROBE_FILE = ".probe"
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)$")

_lock = threading.Lock()
_own: tuple[Path, bytes] | None = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def sweep_dead(base: str = SHM_BASE) -> list[Path]:
    """Removes the shared-memory directories of processes that no longer run; returns them."""
    removed = []
    root = Path(base)
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        m = _NAME.match(entry.name)
        dead = m is not None and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1)))
        if dead and remove_owned(entry):
            removed.append(entry)
    return removed


def own_root(base: str = SHM_BASE) -> tuple[Path, bytes] | None:
    """This process's directory and its probe (made once; removed at exit); None when the
    host has no usable shared memory. Dead processes' directories are swept first."""
    global _own
    with _lock:
        if _own is not None:
            return _own
        if not Path(base).is_dir() or not os.access(base, os.W_OK):
            return None
        sweep_dead(base)
        root = Path(base) / f"{PREFIX}{os.getpid()}"
        # Left by a dead process that had our pid; anything else there is not ours to touch.
        if (root.exists() or root.is_symlink()) and not remove_owned(root):
            return None
        root.mkdir(mode=0o700)
        write_marker(root, "shared-memory")
        probe = secrets.token_bytes(16)
        (root / PROBE_FILE).write_bytes(probe)
        atexit.register(remove_owned, root)
        _own = (root, probe)
        return _own


def release_own() -> None:
    """Removes this process's directory now (for exits that skip atexit, e.g. os._exit)."""
    global _own
    with _lock:
        if _own is not None:
            remove_owned(_own[0])
            _own = None


def is_shared_root(root: str, base: str = SHM_BASE) -> bool:
    """Whether ``root`` names a project directory directly in ``base`` (nothing else is
    ever read as shared memory)."""
    path = Path(root)
    return (
        path.is_absolute()
        and _NAME.match(path.name) is not None
        and path.parent == Path(base)
        and path.is_dir()
        and not path.is_symlink()
        and is_marked(path)
    )


def read_probe(root: str) -> bytes | None:
    """The probe in ``root`` (None when unreadable)."""
    with contextlib.suppress(OSError):
        return (Path(root) / PROBE_FILE).read_bytes()
    return None


def host_id(base: str = SHM_BASE) -> str:
    """Who shares this shared memory: equal for the processes of one host (one kernel, one
    ``base``), different across hosts and across containers with their own ``base``; "" when
    there is none. Nothing is written: the kernel's boot id and the identity of ``base``."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        st = os.stat(base)
    except OSError:
        return ""
    return hashlib.sha256(f"{boot}:{st.st_dev}:{st.st_ino}".encode()).hexdigest()[:16]
