"""Model and tokenizer builders shared by rollout servers and trainers.

Sources (built-in, checkpoint directory, GGUF file, named model) are described in
:mod:`areal_grpc.model_source`. GGUF files and named models are converted here, once
(transformers + gguf de-quantize to fp32), into a cached Hugging Face directory that every
process of a run then loads, so rollout servers and trainer ranks start from identical weights.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers
from transformers import ByT5Tokenizer, PreTrainedModel, PreTrainedTokenizerBase, Qwen2Config

from areal_grpc.config import LoraSettings
from areal_grpc.model_source import (
    TinyModelSpec,
    builtin_spec,
    conversion_dir,
    conversion_lock,
    is_builtin,
    is_converted,
    locate_source,
    model_cache_dir,
    ready_source,
)
from areal_grpc.paths import write_marker

if TYPE_CHECKING:
    from peft import LoraConfig

log = logging.getLogger(__name__)


def convert_gguf(gguf: Path, cache: Path | None = None) -> Path:
    """The Hugging Face directory converted from ``gguf`` (converted on the first call only).

    Keyed by the file's content, so a changed file converts again. The directory appears
    whole (written aside, then renamed) and carries the project's marker.
    """
    cache = cache or model_cache_dir()
    # The key hashes the whole file: computed once.
    target = conversion_dir(gguf, cache)
    if is_converted(target):
        return target
    with conversion_lock(cache / ".convert.lock"):
        if is_converted(target):
            return target
        log.info("converting %s to a Hugging Face checkpoint in %s (once)", gguf, target)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        config = quantized.config
        # The tensors are de-quantized already; a config that still names the GGUF
        # quantizer cannot be saved, nor loaded without the file.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config._name_or_path = ""
        with torch.device("meta"):
            plain = transformers.AutoModelForCausalLM.from_config(config)
        plain.load_state_dict(quantized.state_dict(), assign=True)
        plain.tie_weights()
        tmp = cache / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            save_pretrained(plain, tokenizer, tmp)
            write_marker(tmp, "converted-model")
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def resolve_source(source: str) -> str:
    """A source :func:`load_model` reads directly: built-in or a checkpoint directory.

    GGUF files and named models are converted (once) into the cache; ValueError names what
    is wrong with anything else.
    """
    ready = ready_source(source)
    return ready if ready is not None else str(convert_gguf(Path(locate_source(source))))


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
    path = Path(resolve_source(source))
    config_file = path / "tokenizer_config.json"
    if config_file.is_file():
        cls_name = json.loads(config_file.read_text()).get("tokenizer_class")
        cls = getattr(transformers, cls_name, None) if isinstance(cls_name, str) else None
        if cls is not None:
            return cls.from_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def load_model(
    source: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    lora: LoraSettings | None = None,
) -> PreTrainedModel:
    """A causal LM from a model source; built-in models are initialised from ``seed``.

    Every process that builds the same built-in source with the same seed gets bit-identical
    weights, so trainers and rollout servers start from the same policy without a transfer.
    With ``lora`` (rank > 0) the model comes wrapped by :func:`with_lora`.
    """
    model = _load_base(source, seed, dtype)
    if lora is not None and lora.rank > 0:
        return with_lora(model, lora, seed)
    return model


def with_lora(model: PreTrainedModel, lora: LoraSettings, seed: int = 0) -> PreTrainedModel:
    """``model`` wrapped in peft LoRA adapters; the base weights are frozen.

    The adapters' init is seeded, so every process gets the same ones (LoRA's B starts at
    zero: the wrapped model computes exactly what the base model does until it trains).
    """
    from peft import get_peft_model

    config = lora_config(lora)
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        wrapped = get_peft_model(model, config)
    finally:
        torch.random.set_rng_state(rng_state)
    return wrapped  # type: ignore[return-value]


def lora_config(lora: LoraSettings, target_modules: Sequence[str] | None = None) -> LoraConfig:
    """peft's config for ``lora`` (``target_modules``: the modules resolved, when known)."""
    from peft import LoraConfig

    targets = list(target_modules if target_modules is not None else lora.target_modules)
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        # peft reads "all-linear" only as a string, not inside a list.
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        task_type="CAUSAL_LM",
    )


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries peft adapters (only they train, only they are published)."""
    return hasattr(model, "peft_config")


def adapter_names(model: torch.nn.Module) -> set[str]:
    """The parameters a LoRA model trains, which are all a weight update of it carries."""
    return {n for n, p in model.named_parameters() if p.requires_grad}


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The transformer blocks of a causal LM, under a peft wrapper or not."""
    base = model.get_base_model() if is_lora(model) else model  # type: ignore[operator]
    return base.model.layers  # type: ignore[return-value]


# transformers takes a boolean [B, S] ``logits_to_keep`` (and flattens the positions it keeps)
# only since it has ``slice_logits_to_keep``; older releases raise IndexError on one.
_MASK_LOGITS_TO_KEEP = hasattr(transformers.modeling_utils, "slice_logits_to_keep")


def masked_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    keep: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The logits at the positions where the boolean ``keep`` [B, S] is set, [N, V].

    ``attention_mask``: [B, S] (True on real tokens, causal attention), or a boolean
    [B, 1, S, S] of what each position sees, with its ``position_ids`` [B, S].
    """
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
    if position_ids is not None:
        inputs["position_ids"] = position_ids
    if _MASK_LOGITS_TO_KEEP:
        # Only the kept positions go through the vocabulary projection.
        return model(**inputs, logits_to_keep=keep).logits
    # An older transformers: every position's logits, then the mask (same values, more memory).
    return model(**inputs).logits[keep]


def _load_base(source: str, seed: int, dtype: torch.dtype) -> PreTrainedModel:
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
    return transformers.AutoModelForCausalLM.from_pretrained(resolve_source(source), dtype=dtype)


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
