"""Loading DCP checkpoints without running code found in them.

torch.distributed.checkpoint reads a checkpoint's ``.metadata`` with plain ``pickle.load``
and its non-tensor entries (optimizer hyper-parameters and the like) with
``torch.load(weights_only=False)``: whoever can write into the checkpoint directory could
then make the trainer run arbitrary code on ``LoadCheckpoint``. Here the metadata goes
through an unpickler that only builds the classes DCP's metadata is made of, and byte
entries go through ``torch.load(weights_only=True)``. A checkpoint that needs anything else
fails to load with :class:`UnsafeCheckpointError` (and nothing is restored).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "UnsafeCheckpointError"]

# What DCP's own metadata pickle refers to (torch 2.13): the dataclasses of
# torch.distributed.checkpoint.metadata, the file reader's per-item location, and the few
# torch and pathlib types their fields hold.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """The checkpoint's metadata refers to something a DCP checkpoint never contains."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which a DCP checkpoint never holds"
        )


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` whose metadata is unpickled with an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not Metadata")
        # As the stock reader does: older checkpoints carry no storage_meta.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that loads non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"checkpoint entry {read_item.dest_index.fqn}: {exc}"
            ) from exc
        # Placed as the stock planner places it.
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
