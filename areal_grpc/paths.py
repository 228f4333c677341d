"""Where a server may read and write: one root per server, and only its own directories replaced.

Every path a request names (a checkpoint, an export, a weight version) is resolved against the
server's root (``..`` and symlinks followed, as the file system would) and must lie strictly
inside it; anything else is a :class:`FieldError` naming the field, raised before anything on
disk is touched. Relative paths are relative to the root, never to the working directory.

Every directory the project writes carries a marker file (:data:`MARKER_NAME`). An existing
directory is replaced or deleted only when it carries one; an empty one may be filled, and
anything else is refused with :class:`PreconditionError` and left exactly as it was.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from areal_grpc.errors import FieldError, PreconditionError

log = logging.getLogger(__name__)

MARKER_NAME = ".areal-grpc"
"""The file every directory the project writes carries; only such directories are replaced."""

DEFAULT_ROOT_NAME = "areal-files"
"""A server started with no root writes under ``<working directory>/areal-files/<kind>``."""


def default_root(kind: str) -> Path:
    """The root of a server of ``kind`` (``trainer``...) started without one."""
    return Path.cwd() / DEFAULT_ROOT_NAME / kind


def open_roots(configured: Sequence[str | os.PathLike[str]], kind: str) -> tuple[Path, ...]:
    """The server's roots, created and resolved: the configured ones, else the default (logged)."""
    roots = [Path(r) for r in configured] or [default_root(kind)]
    out = []
    for root in roots:
        root.mkdir(parents=True, exist_ok=True)
        out.append(root.resolve())
    log.info("%s: files are read and written only under %s", kind, ", ".join(map(str, out)))
    return tuple(out)


def resolve_inside(roots: Sequence[Path], path: str, field: str = "path") -> Path:
    """``path`` resolved; it must lie strictly inside one of ``roots`` (FieldError otherwise).

    A relative path is taken relative to the first root. The result is the real path
    (symlinks and ``..`` resolved), so what is checked is what will be opened.
    """
    if not roots:
        raise ValueError("a server needs at least one root")
    if not path:
        raise FieldError(field, "must not be empty")
    if "\x00" in path:
        raise FieldError(field, "contains a NUL byte")
    candidate = Path(path)
    if not candidate.is_absolute():
        candidate = roots[0] / candidate
    resolved = Path(os.path.realpath(candidate))
    for root in roots:
        real_root = Path(os.path.realpath(root))
        if resolved == real_root:
            raise FieldError(field, f"{path!r} is the server's root itself; name a directory in it")
        if resolved.is_relative_to(real_root):
            return resolved
    where = " or ".join(repr(str(r)) for r in roots)
    raise FieldError(field, f"{path!r} resolves outside the server's root {where}")


def is_marked(directory: Path) -> bool:
    """True when ``directory`` is a directory the project wrote (it carries the marker)."""
    marker = directory / MARKER_NAME
    return directory.is_dir() and not directory.is_symlink() and marker.is_file()


def write_marker(directory: Path, kind: str) -> None:
    """Marks ``directory`` as written by the project (``kind``: checkpoint, export, weights...)."""
    (directory / MARKER_NAME).write_text(json.dumps({"written_by": "areal-grpc", "kind": kind}))


def check_replaceable(target: Path, field: str = "path") -> None:
    """Raises PreconditionError unless ``target`` is missing, empty, or a directory we wrote."""
    if not target.exists() and not target.is_symlink():
        return
    if target.is_symlink() or not target.is_dir():
        raise PreconditionError(
            f"{field}: {str(target)!r} exists and is not a directory areal-grpc wrote; "
            "it is left as it is (name another path or remove it)"
        )
    if is_marked(target):
        return
    if any(target.iterdir()):
        raise PreconditionError(
            f"{field}: {str(target)!r} is a non-empty directory areal-grpc did not write "
            f"(no {MARKER_NAME} file); it is left as it is (name another path or remove it)"
        )


def remove_owned(target: Path) -> bool:
    """Deletes ``target`` if it is a directory the project wrote; returns whether it did."""
    if not is_marked(target):
        return False
    shutil.rmtree(target, ignore_errors=True)
    return True


def replace_dir(tmp: Path, final: Path, field: str = "path") -> None:
    """Moves the finished directory ``tmp`` to ``final``; a previous ``final`` must be ours.

    The old directory is renamed aside first and deleted only after the swap, so ``final`` is
    always either the old or the new complete directory.
    """
    check_replaceable(final, field)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{id(tmp):x}")
        final.rename(old)
    tmp.rename(final)
    if old is not None and not remove_owned(old):
        # An empty directory that was filled: nothing of anyone else's was in it.
        old.rmdir()


def write_dir(path: Path, fill: Callable[[Path], None], kind: str) -> None:
    """Fills a fresh hidden directory beside ``path``, marks it as ours (``kind``) and swaps it
    in: a complete directory appears at once, and only a directory this project wrote is ever
    replaced."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        write_marker(tmp, kind)
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


__all__ = [
    "DEFAULT_ROOT_NAME",
    "MARKER_NAME",
    "check_replaceable",
    "default_root",
    "is_marked",
    "open_roots",
    "remove_owned",
    "replace_dir",
    "resolve_inside",
    "write_dir",
    "write_marker",
]
