"""A safetensors file that weight updates are received straight into (the ``vllm`` engine).

vLLM's worker takes new weights only by reading a checkpoint (its layerwise reload), so a
version received by SOCKET, STREAM or DISTRIBUTED must become a safetensors file. Written
afresh per update, that file cost a third of a real-model update here (0.18 s for SmolLM2's
513 MiB: fresh pages of shared memory faulted in, then freed). A :class:`StagedFile` is
written once and kept: its tensors are views of one shared, writable mapping of the file, and
they become the next update's receive buffers, so the bytes arrive in the file itself and the
reload reads them from there with no write at all.

Safe only because the reload keeps nothing of the file: vLLM copies each tensor it reads into
its own parameters (``weight_loader``), so rewriting the file changes nothing that is served
(``tests/system/vllm_rollout``: a staged file overwritten after a load leaves the log-probs
as they were).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

__all__ = ["StagedFile"]


class StagedFile:
    """A safetensors file at ``path`` with its tensors mapped writable (``views``).

    Views handed out as receive buffers are ``lent``: the file is not written while any of
    them may be receiving, except through them (a receiver owns what it holds).
    """

    def __init__(self, path: Path, views: dict[str, torch.Tensor]) -> None:
        self.path = path
        self.views = views
        self.lent: set[str] = set()

    @classmethod
    def write(cls, path: Path, tensors: Mapping[str, torch.Tensor]) -> StagedFile:
        """Writes ``tensors`` to ``path`` and maps the file back."""
        save_file({n: t.detach().contiguous() for n, t in tensors.items()}, str(path))
        return cls(path, _map(path))

    def in_place(self, tensors: Mapping[str, torch.Tensor]) -> set[str]:
        """The names whose tensor is this file's own view (received into the file)."""
        views = self.views
        return {
            n
            for n, t in tensors.items()
            if n in views
            and t.device == views[n].device
            and t.data_ptr() == views[n].data_ptr()
            and t.shape == views[n].shape
            and t.dtype == views[n].dtype
        }

    def can_take(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether :meth:`fill` may write ``tensors`` here: the file holds exactly these
        names, shapes and dtypes, and no view is out but those coming back in ``tensors``."""
        views = self.views
        fits = views.keys() == tensors.keys() and all(
            t.shape == views[n].shape and t.dtype == views[n].dtype for n, t in tensors.items()
        )
        return fits and self.lent <= self.in_place(tensors)

    def fill(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Copies into the file each tensor that is not already its own view; the bytes
        copied (0 when all were received in place). Only when :meth:`can_take`."""
        inside = self.in_place(tensors)
        copied = 0
        for name, t in tensors.items():
            if name not in inside:
                view = self.views[name]
                view.copy_(t)
                copied += view.numel() * view.element_size()
        self.lent -= inside
        return copied


def _map(path: Path) -> dict[str, torch.Tensor]:
    """Views of each tensor of the safetensors file at ``path`` in one shared mapping."""
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    size = path.stat().st_size
    data = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
    start = 8 + header_len
    views = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        raw = data[start + begin : start + end]
        # safetensors orders tensors by alignment, largest first, after an 8-aligned header,
        # so each view is aligned for its dtype.
        views[name] = raw.view(dtype).view(info["shape"])
    return views


_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
