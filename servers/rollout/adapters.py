"""What the engines backed by an inference server of their own (``sglang``, ``vllm``) share:
the LoRA adapter served per policy version, and the directories such a server reads.

A weight update of a LoRA run brings the adapters only; the server loads them as a named
adapter per version (``<name>-v<version>``), generation names the current one, and an adapter
that was replaced is dropped once no request uses it any more (:class:`AdapterBook`).
Directories (peft adapters, HF checkpoints) are written beside their final path and swapped
in whole, marked as ours, so a server never reads a half-written one and only a directory
this project wrote is ever replaced.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import ByT5Tokenizer

from areal_grpc.config import LoraSettings
from areal_grpc.model import lora_config, qwen2_config
from areal_grpc.model_source import builtin_spec, is_builtin
from areal_grpc.paths import replace_dir, write_marker

__all__ = [
    "ADAPTER_KEY",
    "AdapterBook",
    "check_adapter_update",
    "write_adapter",
    "write_checkpoint",
    "write_dir",
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


def write_adapter(
    model: str, lora: LoraSettings, state_dict: Mapping[str, torch.Tensor], path: Path
) -> None:
    """A peft adapter directory (adapter_config.json, adapter_model.safetensors).

    peft saves adapter tensors without the adapter's own name, so "q_proj.lora_A.default.
    weight" is stored as "q_proj.lora_A.weight"; the config names the modules actually wrapped.
    """

    def fill(tmp: Path) -> None:
        tensors = {
            ADAPTER_KEY.sub(r".\1.weight", n): t.detach().cpu().contiguous()
            for n, t in state_dict.items()
        }
        save_file(tensors, str(tmp / "adapter_model.safetensors"))
        modules = sorted({n.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for n in state_dict})
        config = lora_config(lora, modules)
        config.base_model_name_or_path = "" if is_builtin(model) else model
        config.save_pretrained(str(tmp))

    write_dir(path, fill, "adapter")


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
