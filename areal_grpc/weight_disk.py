"""Versioned weight directories on disk: atomic write, confined load, retention.

A published version is a Hugging Face style directory ``<root>/v<version:08d>`` holding
``config.json``, one or more ``*.safetensors`` shards and ``model.safetensors.index.json``.
It is written under a hidden temporary name and renamed into place, so a reader never sees a
half-written version. Every version carries the project's marker file, and only marked
directories are replaced or pruned (:mod:`areal_grpc.paths`). Readers resolve a requested path
against *their own* root and refuse anything that leads outside it (``..`` escapes, absolute
paths elsewhere, symlinks pointing out), with a :class:`~areal_grpc.errors.FieldError`
naming the field. Only safetensors are read: no pickle, no ``torch.load``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from areal_grpc.errors import FieldError
from areal_grpc.paths import (
    check_replaceable,
    is_marked,
    remove_owned,
    replace_dir,
    resolve_inside,
    write_marker,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_VERSION_DIR = re.compile(r"^v(\d+)$")
_TMP_PREFIX = ".tmp-"


def version_dir_name(version: int) -> str:
    """The directory name of ``version`` under a root, e.g. ``v00000003``."""
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return f"v{version:08d}"


def shard_name(index: int, count: int) -> str:
    """HF shard file name: ``model-00001-of-00003.safetensors`` (1-based)."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


class VersionWriter:
    """Writes one version directory shard by shard, then publishes it atomically.

    Use as a context manager; leaving it with an exception removes the temporary directory
    and publishes nothing::

        with VersionWriter(root, version, shard_count=n) as w:
            for bucket in buckets:
                w.add_shard(bucket)
            w.write_config(config_json)
        w.path  # <root>/v00000007
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        version: int,
        shard_count: int,
        keep: int | None = None,
    ) -> None:
        """``keep``: the versions kept once this one is published (see :func:`prune_versions`).

        Given, the older versions that pruning will delete then, except the newest one, go
        while this one is written: before each shard, files of theirs of about its size are
        deleted. The write then reuses page-cache memory freed a moment earlier: on the
        machines this was developed on (virtual machines), a write right after deleting as
        much was several times faster than one that grows the page cache (why is not
        established). ``bench/weight_sync.py`` measures the effect on a whole DISK sync.
        """
        if shard_count < 1:
            raise ValueError("shard_count must be >= 1")
        self.root = Path(root)
        self.version = version
        self.shard_count = shard_count
        self.path = self.root / version_dir_name(version)
        self._tmp = self.root / f"{_TMP_PREFIX}{version_dir_name(version)}-{uuid.uuid4().hex[:8]}"
        self._weight_map: dict[str, str] = {}
        self._total = 0
        self._shards = 0  # shards begun (named in the order add_shard is called)
        self._written = 0
        # add_shard may run in several threads at once (shards are independent files).
        self._lock = threading.Lock()
        self._keep = keep
        # Files of versions due for pruning, largest first, and how many bytes they hold.
        self._doomed: list[tuple[int, Path]] = []

    def __enter__(self) -> VersionWriter:
        self.root.mkdir(parents=True, exist_ok=True)
        # Refused before anything is written: a version directory we did not write stays.
        check_replaceable(self.path)
        self._tmp.mkdir()
        write_marker(self._tmp, "weights")
        if self._keep is not None:
            existing = [p for v, p in list_versions(self.root) if v != self.version]
            # The newest existing version stays whatever happens to this one.
            for d in existing[: -max(self._keep - 1, 1)]:
                self._doomed += [(f.stat().st_size, f) for f in d.glob("*.safetensors")]
            self._doomed.sort(key=lambda sf: sf[0], reverse=True)
        return self

    def _free_for(self, nbytes: int) -> None:
        """Deletes doomed files holding about ``nbytes`` (at least one, while there are any)."""
        freed = 0
        while self._doomed and freed < nbytes:
            size, f = self._doomed.pop(0)
            with contextlib.suppress(OSError):
                f.unlink()
            freed += size

    def add_shard(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Writes the next shard file (tensors made contiguous CPU copies only if needed).

        Thread-safe: shards are independent files, and writing two at once uses two cores.
        """
        plain = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        nbytes = sum(v.numel() * v.element_size() for v in plain.values())
        with self._lock:
            if self._shards >= self.shard_count:
                raise ValueError(f"more than the announced {self.shard_count} shards")
            name = shard_name(self._shards, self.shard_count)
            self._shards += 1
            for k in plain:
                if k in self._weight_map:
                    raise ValueError(f"tensor {k!r} written twice")
                self._weight_map[k] = name
            self._free_for(nbytes)
        save_file(plain, str(self._tmp / name), metadata={"format": "pt"})
        with self._lock:
            self._total += nbytes
            self._written += 1

    def write_config(self, config: Mapping[str, object] | str) -> None:
        """Writes ``config.json`` from a dict or from JSON text (``config.to_json_string()``)."""
        text = config if isinstance(config, str) else json.dumps(config, indent=2)
        (self._tmp / "config.json").write_text(text)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None or self._written != self.shard_count:
            shutil.rmtree(self._tmp, ignore_errors=True)
            if exc_type is None:
                raise ValueError(f"wrote {self._written} of {self.shard_count} announced shards")
            return
        index = {"metadata": {"total_size": self._total}, "weight_map": self._weight_map}
        (self._tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
        _fsync_dir(self._tmp)
        # Re-publishing a version (e.g. a retried update) replaces it as a whole.
        replace_dir(self._tmp, self.path)
        _fsync_dir(self.root)


def _fsync_dir(path: Path) -> None:
    # Best effort durability of the rename; some file systems refuse fsync on directories.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_version(
    root: str | os.PathLike[str],
    version: int,
    shards: Iterable[Mapping[str, torch.Tensor]],
    shard_count: int,
    config: Mapping[str, object] | str | None = None,
) -> Path:
    """Writes ``shards`` as version ``version`` under ``root`` atomically; returns its path."""
    with VersionWriter(root, version, shard_count) as writer:
        for shard in shards:
            writer.add_shard(shard)
        if config is not None:
            writer.write_config(config)
    return writer.path


def list_versions(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Versions published by the project under ``root`` as (version, path), oldest first.

    Only directories carrying the project's marker count: nothing else is ever pruned.
    """
    base = Path(root)
    if not base.is_dir():
        return []
    found = []
    for entry in base.iterdir():
        m = _VERSION_DIR.match(entry.name)
        if m and is_marked(entry):
            found.append((int(m.group(1)), entry))
    return sorted(found)


def prune_versions(root: str | os.PathLike[str], keep: int) -> list[Path]:
    """Deletes all but the ``keep`` newest versions (and stale temporary dirs); returns them."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    versions = list_versions(root)
    doomed = [p for _, p in versions[:-keep]]
    base = Path(root)
    for entry in base.iterdir() if base.is_dir() else ():
        # Leftovers of writers that died mid-write; a live writer's directory is younger
        # than the newest published version only while it runs, so only old ones go.
        if entry.name.startswith(_TMP_PREFIX) and versions and is_marked(entry):
            newest = versions[-1][1].stat().st_mtime
            if entry.stat().st_mtime < newest:
                doomed.append(entry)
    for path in doomed:
        remove_owned(path)
    return doomed


def resolve_confined(root: str | os.PathLike[str], path: str, field: str = "path") -> Path:
    """``path`` resolved strictly inside ``root`` (see :func:`resolve_inside`); a directory."""
    resolved = resolve_inside([Path(root)], path, field)
    if not resolved.is_dir():
        raise FieldError(field, f"{path!r} is not a directory under the weights root")
    return resolved


def weight_files(directory: Path, root: Path, field: str = "path") -> list[Path]:
    """The safetensors files of a version directory, each checked to lie inside ``root``."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise FieldError(field, f"{INDEX_FILE} is malformed: {exc}") from None
        names = sorted(set(weight_map.values()))
    elif (directory / SINGLE_FILE).is_file():
        names = [SINGLE_FILE]
    else:
        raise FieldError(field, f"no {INDEX_FILE} or {SINGLE_FILE} in the directory")
    files = []
    base = root.resolve()
    for name in names:
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise FieldError(field, f"{INDEX_FILE} names a bad shard file {name!r}")
        f = (directory / name).resolve()
        if not f.is_relative_to(base):
            raise FieldError(field, f"shard {name!r} leads outside the weights root")
        if not f.is_file():
            raise FieldError(field, f"shard {name!r} is missing")
        files.append(f)
    return files


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file (safetensors validates the header and offsets).

    They stay in safetensors' private (copy-on-write) mapping of the file: nothing is copied,
    pages come in from the page cache as they are first read, writing to a tensor never
    reaches the file, and deleting the file later leaves the mapping intact.
    """
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


# safetensors' names of the floating-point dtypes (the header's "dtype" strings).
_FLOAT_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


def float_dtypes(files: Iterable[Path], field: str = "path") -> dict[str, torch.dtype]:
    """The floating-point tensors of safetensors ``files`` and their dtypes, from the headers
    alone (no tensor is read)."""
    out: dict[str, torch.dtype] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                for name in h.keys():  # noqa: SIM118
                    dtype = _FLOAT_DTYPES.get(h.get_slice(name).get_dtype())
                    if dtype is not None:
                        out[name] = dtype
        except (OSError, ValueError, SafetensorError) as exc:
            raise FieldError(field, f"cannot read {f.name}: {exc}") from None
    return out


def load_version(
    root: str | os.PathLike[str], path: str, field: str = "path"
) -> dict[str, torch.Tensor]:
    """The state dict stored at ``path`` under ``root`` (confined; safetensors only)."""
    directory = resolve_confined(root, path, field)
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(directory, Path(root), field):
        try:
            part = _read_tensors(f)
        except (OSError, ValueError, SafetensorError) as exc:
            raise FieldError(field, f"cannot read {f.name}: {exc}") from None
        dup = set(part) & set(out)
        if dup:
            raise FieldError(field, f"tensor {sorted(dup)[0]!r} appears in two shards")
        out.update(part)
    return out


__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "VersionWriter",
    "float_dtypes",
    "list_versions",
    "load_version",
    "prune_versions",
    "resolve_confined",
    "shard_name",
    "version_dir_name",
    "weight_files",
    "write_version",
]
