"""What an engine that serves a checkpoint of its own (vLLM, SGLang) knows of it: its tensors'
names and shapes, read from safetensors headers, the checks an update must pass against them
before the engine is handed it, and the ids that end a turn.

Both engines load by name, and take whatever they are given: a missing tensor keeps its old
value and an unknown one is ignored (SGLang answers success for both). An update that does
not match the model exactly is refused here instead, before anything changes.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from areal_servers.rollout.adapters import write_checkpoint
from safetensors import SafetensorError, safe_open

from areal_grpc.model import load_model, resolve_source
from areal_grpc.model_source import is_builtin

__all__ = [
    "TensorSpec",
    "check_specs",
    "checkpoint_shapes",
    "end_token_ids",
    "file_specs",
    "served_checkpoint",
    "tensor_specs",
]

# (shape, floating point, dtype name) of one tensor.
TensorSpec = tuple[tuple[int, ...], bool, str]

# Floating-point dtypes as safetensors headers name them.
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}


def file_specs(files: Sequence[Path]) -> dict[str, TensorSpec]:
    """Name -> spec of every tensor in safetensors ``files``, from their headers only
    (safetensors also checks that each file covers what its header declares); ValueError for
    an unreadable file or a tensor in two of them."""
    specs: dict[str, TensorSpec] = {}
    for file in files:
        try:
            with safe_open(str(file), "pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if name in specs:
                        raise ValueError(f"tensor {name!r} appears in two files")
                    part = f.get_slice(name)
                    dtype = part.get_dtype()
                    specs[name] = (tuple(part.get_shape()), dtype in _FLOAT_DTYPES, dtype)
        except (OSError, SafetensorError) as exc:
            raise ValueError(f"cannot read {file.name}: {exc}") from None
    return specs


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """Name -> spec of in-memory tensors."""
    return {n: (tuple(t.shape), t.is_floating_point(), str(t.dtype)) for n, t in tensors.items()}


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a safetensors checkpoint (read from the headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def check_specs(expected: Mapping[str, tuple[int, ...]], specs: Mapping[str, TensorSpec]) -> None:
    """ValueError unless ``specs`` are exactly the model's tensors (``expected``: name ->
    shape), with its shapes and floating-point dtypes; nothing is checked while ``expected`` is
    empty (not known)."""
    if not expected:
        return
    unknown = sorted(set(specs) - set(expected))
    if unknown:
        raise ValueError(f"state dict has unknown tensors: {unknown[:5]}")
    missing = sorted(set(expected) - set(specs))
    if missing:
        raise ValueError(f"state dict lacks tensors: {missing[:5]}")
    for name, (shape, floating, dtype) in specs.items():
        if shape != expected[name]:
            raise ValueError(f"{name}: shape {shape} does not match the model's {expected[name]}")
        if not floating:
            raise ValueError(f"{name}: dtype {dtype} is not a floating-point one")


def end_token_ids(path: Path, eos: int | None) -> set[int]:
    """Ids that end a turn: the tokenizer's EOS and the generation config's."""
    ends = {int(eos)} if eos is not None else set()
    gen = path / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ends |= {int(v) for v in ([value] if isinstance(value, int) else value or [])}
    return ends


def served_checkpoint(model: str, seed: int, kind: str) -> tuple[str, Path | None]:
    """The directory an engine's own server loads for ``model``: the model's own (a GGUF file
    or a named model converted once), or a built-in model written out, initialised from
    ``seed`` exactly as the trainer's; and the temporary directory to remove at close (None
    when nothing was written)."""
    if not is_builtin(model):
        return resolve_source(model), None
    root = Path(tempfile.mkdtemp(prefix=f"areal-{kind}-model-"))
    path = root / "model"
    write_checkpoint(model, load_model(model, seed=seed).state_dict(), path, f"{kind}-model")
    return str(path), root
