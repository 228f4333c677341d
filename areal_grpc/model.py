"""Model and tokenizer builders shared by rollout servers and trainers.

A model source is either the string ``"builtin:tiny"`` (a random-init Qwen2-style model built
from a config, with a byte tokenizer: needs no files and no downloads) or a local directory
holding a Hugging Face checkpoint (config.json, safetensors, tokenizer files).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import ByT5Tokenizer, PreTrainedModel, PreTrainedTokenizerBase, Qwen2Config

BUILTIN_PREFIX = "builtin:"


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


def qwen2_config(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerBase) -> Qwen2Config:
    """A Qwen2 config for a built-in spec, with the tokenizer's special ids."""
    return Qwen2Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def load_tokenizer(source: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a model source.

    Honours ``tokenizer_class`` in a directory's tokenizer_config.json: transformers'
    AutoTokenizer picks the class from the model type (Qwen2Tokenizer for qwen2), which is
    wrong for our byte-level checkpoints.
    """
    if is_builtin(source):
        builtin_spec(source)
        return ByT5Tokenizer()
    path = Path(source)
    config_file = path / "tokenizer_config.json"
    if config_file.is_file():
        cls_name = json.loads(config_file.read_text()).get("tokenizer_class")
        cls = getattr(transformers, cls_name, None) if isinstance(cls_name, str) else None
        if cls is not None:
            return cls.from_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def load_model(
    source: str, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """A causal LM from a model source; built-in models are initialised from ``seed``.

    Every process that builds the same built-in source with the same seed gets bit-identical
    weights, so trainers and rollout servers start from the same policy without a transfer.
    """
    if is_builtin(source):
        spec = builtin_spec(source)
        config = qwen2_config(spec, ByT5Tokenizer())
        rng_state = torch.random.get_rng_state()
        try:
            torch.manual_seed(seed)
            model = transformers.Qwen2ForCausalLM(config)
        finally:
            torch.random.set_rng_state(rng_state)
        return model.to(dtype)
    if not os.path.isdir(source):
        raise ValueError(
            f"model source {source!r} is neither a built-in model ({BUILTIN_PREFIX}...) "
            "nor a local checkpoint directory"
        )
    return transformers.AutoModelForCausalLM.from_pretrained(source, dtype=dtype)


def save_pretrained(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    path: str | os.PathLike[str],
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write a Hugging Face checkpoint directory that ``load_model``/``load_tokenizer`` read."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(out)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = type(tokenizer).__name__
    config_file.write_text(json.dumps(config, indent=2))
