"""Host memory for bulk tensor traffic: receive buffers and glibc allocator tuning.

A process that moves many chunks should call :func:`tune_malloc` once at start (without it,
glibc returns each freed message buffer to the kernel and faults it in again, zeroed, for the
next one).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

import torch

from areal_grpc.tensor_codec import MiB

# Receive buffers.
#
# Filling freshly allocated memory is dominated by page faults (4 KiB each, ~1.5 GB/s here);
# with transparent huge pages in "madvise" mode, advising a big buffer first makes it ~4x
# faster to fill. Best effort: where madvise is missing or refused, nothing changes.
_HUGE_PAGE = 2 * MiB
_MADV_HUGEPAGE = 14


def _load_madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


def empty_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised flat uint8 CPU tensor of ``nbytes``, huge-page backed when large."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if _madvise is not None and nbytes >= 2 * _HUGE_PAGE:
        # Only whole pages inside the allocation; the kernel uses huge pages for the
        # 2 MiB-aligned stretches within it.
        start = (buf.data_ptr() + 4095) & ~4095
        end = (buf.data_ptr() + nbytes) & ~4095
        _madvise(start, end - start, _MADV_HUGEPAGE)
    return buf


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc(
    mmap_threshold_bytes: int = 32 * MiB, trim_threshold_bytes: int = 256 * MiB
) -> bool:
    """Process-wide: keep freed message buffers mapped for reuse (glibc only; True if applied).

    A chunk stream allocates and frees a ~1 MiB buffer per message on both sides (and gRPC
    its read buffers). With glibc's defaults those are handed back to the kernel and faulted
    in again, zeroed, on the next message, which costs as much CPU as the copies themselves.
    Allocations up to ``mmap_threshold_bytes`` then come from the heap, and up to
    ``trim_threshold_bytes`` of free heap stays mapped. Call once at process start.

    Setting a threshold turns off glibc's own adaptive one, which grows up to 32 MiB as large
    blocks are freed. A fixed 4 MiB here made every 4-32 MiB activation of a training step an
    mmap, a munmap and a page fault per 4 KiB (a trainer rank of the 135M model: 7x the faults
    and 1.3x the step time of the same rank without tuning), so the default is 32 MiB, the
    adaptive threshold's cap: nothing is mapped afresh that the adaptive one would reuse.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes) == 1
    return mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes) == 1 and ok


__all__ = ["empty_buffer", "tune_malloc"]
