"""CRC-32C (the checksum of ``TensorChunk.crc32c``), computed on memory in place."""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from typing import Any

import google_crc32c
import numpy as np

# CRC-32C on memory in place.
#
# google_crc32c.value() only takes ``bytes``; checksumming a slice of tensor memory through it
# would cost a copy per chunk. The C library it bundles has crc32c_extend(crc, ptr, len), which
# we call on the tensor's memory directly (ctypes releases the GIL for the call).


def _load_crc_lib() -> Any:
    pkg_dir = os.path.dirname(google_crc32c.__file__)
    # The wheel's bundled copy first, then a system libcrc32c.
    candidates = sorted(glob.glob(os.path.join(pkg_dir, "..", "google_crc32c.libs", "libcrc32c*")))
    system = ctypes.util.find_library("crc32c")
    for path in [*candidates, *([system] if system else [])]:
        try:
            fn = ctypes.CDLL(path).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_uint32
        return fn
    return None


_crc_extend = _load_crc_lib()


def crc32c_at(address: int, nbytes: int) -> int:
    """CRC-32C of ``nbytes`` of memory at ``address`` (which the caller keeps alive)."""
    if nbytes == 0:
        return 0
    if _crc_extend is not None:
        return int(_crc_extend(0, address, nbytes))
    return google_crc32c.value(ctypes.string_at(address, nbytes))  # pragma: no cover


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """CRC-32C (Castagnoli) of a bytes-like object, computed in place (no copy)."""
    if isinstance(data, bytes):
        return google_crc32c.value(data)
    if len(data) == 0:
        return 0
    # numpy takes any contiguous buffer, read-only or not, and tells us where it lives.
    arr = np.frombuffer(data, dtype=np.uint8)
    return crc32c_at(arr.ctypes.data, arr.nbytes)


__all__ = ["crc32c", "crc32c_at"]
