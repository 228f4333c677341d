"""What the engines backed by an inference server of their own (``sglang``, ``vllm``) share:
the LoRA adapter served per policy version, and the directories such a server reads; and what
every engine with named adapters (``RolloutService.LoadAdapter``) keeps of them
(:class:`NamedAdapters`).

A weight update of a LoRA run brings the adapters only; the server loads them as a named
adapter per version (``<name>-v<version>``), generation names the current one, and an adapter
that was replaced is dropped once no request uses it any more (:class:`AdapterBook`).
Directories (peft adapters, HF checkpoints) are written beside their final path and swapped
in whole, marked as ours, so a server never reads a half-written one and only a directory
this project wrote is ever replaced.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from transformers import ByT5Tokenizer

from areal_grpc.config import LoraSettings
from areal_grpc.errors import ExhaustedError, NotFoundError
from areal_grpc.model import lora_config, qwen2_config
from areal_grpc.model_source import builtin_spec, is_builtin
from areal_grpc.paths import write_dir

if TYPE_CHECKING:
    from peft import LoraConfig

__all__ = [
    "ADAPTER_KEY",
    "AdapterBook",
    "NamedAdapter",
    "NamedAdapters",
    "check_adapter_update",
    "write_adapter",
    "write_checkpoint",
]

# Adapter tensors as peft names them in a model: "<module>.lora_A.<adapter>.weight".
ADAPTER_KEY = re.compile(r"\.(lora_[AB])\.[^.]+\.weight$")


def check_adapter_update(names: Collection[str], known: Collection[str]) -> None:
    """ValueError unless ``names`` are adapter tensors, and the same ones as before (``known``,
    empty before the first update)."""
    unknown = sorted(n for n in names if not ADAPTER_KEY.search(n))
    if unknown:
        raise ValueError(f"state dict has unknown tensors: {unknown[:5]}")
    if known and set(names) != set(known):
        missing = sorted(set(known) - set(names))
        extra = sorted(set(names) - set(known))
        raise ValueError(
            f"state dict lacks tensors: {missing[:5]}"
            if missing
            else f"state dict has unknown tensors: {extra[:5]}"
        )


@dataclass
class AdapterBook:
    """The adapter new requests run on, the requests using each adapter, and their files.

    ``current`` is "" until the first update: LoRA's B starts at zero, so the base model is
    the initial policy. An adapter pins the weights a request runs on, so the request's
    tokens carry the version it was sent at, and a replaced adapter is dropped only when its
    last request ends.
    """

    current: str = ""
    version: int = 0
    # The adapter tensors' names (fixed by the first update).
    names: frozenset[str] = frozenset()
    dirs: dict[str, Path] = field(default_factory=dict)
    users: dict[str, int] = field(default_factory=dict)

    def acquire(self) -> tuple[str, int]:
        """The adapter (and its version) a request starting now runs on; pinned until
        :meth:`release`."""
        self.users[self.current] = self.users.get(self.current, 0) + 1
        return self.current, self.version

    def release(self, name: str) -> None:
        """A request on ``name`` ended."""
        self.users[name] -= 1

    def install(self, name: str, path: Path, version: int, names: Collection[str]) -> None:
        """``name`` (loaded by the server from ``path``) serves new requests from now on."""
        self.names = frozenset(names)
        self.dirs[name] = path
        self.current, self.version = name, version

    def idle(self) -> list[tuple[str, Path]]:
        """Replaced adapters no request uses any more, forgotten here: the caller drops them."""
        out = []
        for name in list(self.dirs):
            if name != self.current and not self.users.get(name):
                self.users.pop(name, None)
                out.append((name, self.dirs.pop(name)))
        return out


def write_peft_dir(path: Path, tensors: Mapping[str, torch.Tensor], config: LoraConfig) -> None:
    """A peft adapter directory, written whole: ``tensors`` (peft's checkpoint keys) as
    adapter_model.safetensors and ``config`` as adapter_config.json."""

    def fill(tmp: Path) -> None:
        save_file(dict(tensors), str(tmp / "adapter_model.safetensors"))
        config.save_pretrained(str(tmp))

    write_dir(path, fill, "adapter")


def write_adapter(
    model: str, lora: LoraSettings, state_dict: Mapping[str, torch.Tensor], path: Path
) -> None:
    """A peft adapter directory (adapter_config.json, adapter_model.safetensors).

    peft saves adapter tensors without the adapter's own name, so "q_proj.lora_A.default.
    weight" is stored as "q_proj.lora_A.weight"; the config names the modules actually wrapped.
    """
    tensors = {
        ADAPTER_KEY.sub(r".\1.weight", n): t.detach().cpu().contiguous()
        for n, t in state_dict.items()
    }
    modules = sorted({n.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for n in state_dict})
    config = lora_config(lora, modules)
    config.base_model_name_or_path = "" if is_builtin(model) else model
    write_peft_dir(path, tensors, config)


def write_checkpoint(
    model: str, state_dict: Mapping[str, torch.Tensor], path: Path, kind: str
) -> None:
    """A directory an inference server loads: model.safetensors plus the source's config files
    (a Qwen2 config for a built-in model)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in state_dict.items():
        t = tensor.detach().cpu().contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        # Tied weights (lm_head = embed_tokens) are stored once, as HF checkpoints do.
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = t

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"))
        if is_builtin(model):
            config = qwen2_config(builtin_spec(model), ByT5Tokenizer())
            config.architectures = ["Qwen2ForCausalLM"]
            config.to_json_file(str(tmp / "config.json"))
        else:
            for name in os.listdir(model):
                if name.endswith(".json") and not name.endswith(".safetensors.index.json"):
                    shutil.copy(Path(model) / name, tmp / name)

    write_dir(path, fill, kind)


@dataclass
class NamedAdapter:
    """One load of a named adapter: its engine-internal name, its size, the requests on it."""

    name: str
    internal: str
    nbytes: int
    users: int = 0


class NamedAdapters:
    """The named adapters an engine holds, within its caps.

    A name serves one load at a time; loading the name again (or removing it) retires that
    load, which requests already running on it keep until they end, so an engine drops an
    adapter only when :meth:`release` (or :meth:`retire`) says it is idle. Caps count the
    names held (and the loads under way): at most ``max_adapters`` of them, of at most
    ``max_bytes`` tensor bytes together. Not thread-safe: one event loop calls it.
    """

    def __init__(self, max_adapters: int, max_bytes: int, prefix: str = "named") -> None:
        """Caps of ``max_adapters`` names and ``max_bytes`` bytes; engine-internal names are
        ``<prefix>-<n>`` (unique for the engine's life, so a retired load never clashes)."""
        self.max_adapters = max_adapters
        self.max_bytes = max_bytes
        self._prefix = prefix
        self._ids = itertools.count(1)
        self._live: dict[str, NamedAdapter] = {}
        # Loads under way, by name: their bytes, counted against the caps until installed.
        self._loading: dict[str, int] = {}
        # Retired loads some request still runs on, by internal name.
        self._retired: dict[str, NamedAdapter] = {}
        self._by_internal: dict[str, NamedAdapter] = {}

    def names(self) -> list[str]:
        """The names requests may give now, sorted."""
        return sorted(self._live)

    @property
    def held_bytes(self) -> int:
        """Bytes of every load the engine still holds (retired ones in use included)."""
        return sum(a.nbytes for a in self._by_internal.values())

    @property
    def any_installed(self) -> bool:
        """Whether the engine holds any named adapter (live or retired but in use)."""
        return bool(self._by_internal)

    def reserve(self, name: str, nbytes: int) -> str:
        """Room for a load of ``name`` (``nbytes``): its internal name. ExhaustedError when the
        caps leave none (a load replacing ``name`` does not count the load it replaces)."""
        others = {n: a.nbytes for n, a in self._live.items() if n != name}
        others.update({n: b for n, b in self._loading.items() if n != name})
        if name in self._loading:
            raise ExhaustedError(f"adapter {name!r} is being loaded already; retry when it is")
        if len(others) + 1 > self.max_adapters:
            raise ExhaustedError(
                f"the server holds {len(others)} named adapters, its cap "
                f"(rollout.max_adapters = {self.max_adapters}); remove one first"
            )
        used = sum(others.values())
        if used + nbytes > self.max_bytes:
            raise ExhaustedError(
                f"adapter {name!r} needs {nbytes} bytes; the server holds {used} of its "
                f"{self.max_bytes} for named adapters (rollout.max_adapter_mib)"
            )
        self._loading[name] = nbytes
        return f"{self._prefix}-{next(self._ids)}"

    def unreserve(self, name: str) -> None:
        """A reserved load failed: its room is free again."""
        self._loading.pop(name, None)

    def install(self, name: str, internal: str) -> tuple[bool, list[str]]:
        """The reserved load of ``name`` serves new requests from now on. Returns whether it
        replaced a load, and the internal names the engine may drop now."""
        nbytes = self._loading.pop(name)
        entry = NamedAdapter(name, internal, nbytes)
        self._by_internal[internal] = entry
        old = self._live.pop(name, None)
        self._live[name] = entry
        return old is not None, self._retire(old)

    def remove(self, name: str, field: str = "name") -> list[str]:
        """Retires ``name`` (NotFoundError naming ``field`` when it is not held); the internal
        names the engine may drop now."""
        entry = self._live.pop(name, None)
        if entry is None:
            raise NotFoundError(field, f"no adapter {name!r} is loaded")
        return self._retire(entry)

    def acquire(self, name: str, field: str = "adapter") -> str:
        """The internal name a request naming ``name`` runs on, held until :meth:`release`;
        NotFoundError naming ``field`` when ``name`` is not held."""
        entry = self._live.get(name)
        if entry is None:
            raise NotFoundError(field, f"no adapter {name!r} is loaded")
        entry.users += 1
        return entry.internal

    def check(self, name: str, field: str = "adapter") -> None:
        """NotFoundError naming ``field`` unless ``name`` is held."""
        if name not in self._live:
            raise NotFoundError(field, f"no adapter {name!r} is loaded")

    def release(self, internal: str) -> list[str]:
        """A request on ``internal`` ended; the internal names the engine may drop now."""
        entry = self._by_internal.get(internal)
        if entry is None:
            return []
        entry.users -= 1
        if internal in self._retired and entry.users <= 0:
            del self._retired[internal]
            del self._by_internal[internal]
            return [internal]
        return []

    def _retire(self, entry: NamedAdapter | None) -> list[str]:
        if entry is None:
            return []
        if entry.users > 0:
            self._retired[entry.internal] = entry
            return []
        del self._by_internal[entry.internal]
        return [entry.internal]
