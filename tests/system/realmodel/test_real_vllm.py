"""The real model (SmolLM2-135M-Instruct) on the vllm engine: vLLM's CPU build, for real.

The same module-wide mesh as test_real_correctness (an FSDP2 trainer service and a rollout
server over loopback gRPC), with the rollout server on vLLM:

1. greedy RunEpisodes on chat prompts equals transformers' ``generate(do_sample=False)``
   token for token, from the prompt ids the model's own chat template gives;
2. the log-probs vLLM reports for sampled tokens equal the trainer's recomputation, after
   the trainer's weights were published into vLLM;
3. the agent gateway serves a session on vLLM token-exactly: what trains is exactly the ids
   vLLM sampled, across turns and a stop string.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import transformers
from areal_clients.gateway.chat import ChatRenderer
from areal_servers.rollout.vllm_engine import VLLMEngine

from areal_grpc.config import GatewaySettings, ModelConfig, RunConfig, VllmSettings
from areal_grpc.coordinator.pool import WorkPool
from areal_grpc.model import load_tokenizer
from tests.support.gateway import ServedCoordinator, coordinator_with, gateway_serving
from tests.support.realmodel import (
    Mesh,
    Serve,
    check_greedy_equals_generate,
    check_logprobs_equal_recomputation,
)

# vLLM's CPU kernels (fp32) against the trainer's FSDP2 forward on SmolLM2's 30 layers:
# 2.6e-5 at most seen here; the hf engine's check (test_real_correctness) allows 1e-3.
LOGPROB_TOL = 2e-4
SETTINGS = VllmSettings(kv_cache_gib=0.5, max_model_len=1024, max_num_seqs=16)


@pytest.fixture(scope="module")
def vllm_mesh(
    vllm_installed: None,
    real_model_dir: str,
    tmp_path_factory: pytest.TempPathFactory,
    serve: Serve,
) -> Iterator[Mesh]:
    fatal: list[str] = []
    engine = VLLMEngine(real_model_dir, SETTINGS)
    engine.on_death(fatal.append)
    m = Mesh(
        real_model_dir,
        tmp_path_factory.mktemp("real-vllm"),
        functools.partial(serve, engine=engine),  # type: ignore[arg-type]
    )
    yield m
    m.close()
    assert fatal == []


@pytest.fixture(scope="module")
def tokenizer(real_model_dir: str):
    return load_tokenizer(real_model_dir)


@pytest.fixture(scope="module")
def reference(real_model_dir: str) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(real_model_dir, dtype="float32")
    return model.eval()


def test_greedy_run_episodes_on_vllm_equals_hf_generate_on_chat_prompts(
    vllm_mesh: Mesh, tokenizer, reference: transformers.PreTrainedModel
) -> None:
    assert isinstance(vllm_mesh.rollout, VLLMEngine)
    check_greedy_equals_generate(vllm_mesh, tokenizer, reference)


def test_vllm_logprobs_equal_the_trainers_recomputation(vllm_mesh: Mesh, tokenizer) -> None:
    diff = check_logprobs_equal_recomputation(vllm_mesh, tokenizer, tolerance=LOGPROB_TOL)
    print(f"vllm: max |served - recomputed| log-prob {diff:.2e}")


def test_a_gateway_session_on_vllm_trains_exactly_the_sampled_ids(
    vllm_mesh: Mesh, real_model_dir: str, tmp_path: Path
) -> None:
    pool = WorkPool(8, 0, vocab_size=vllm_mesh.rollout.vocab_size)
    with coordinator_with(vllm_mesh.rollout_address, pool) as co:
        run = RunConfig(
            model=ModelConfig(source=real_model_dir), gateway=GatewaySettings(max_tokens=8)
        )
        with gateway_serving(run, co.address) as url:
            session_trains_sampled_ids(vllm_mesh, co, url, real_model_dir)


def session_trains_sampled_ids(
    mesh: Mesh, co: ServedCoordinator, url: str, real_model_dir: str
) -> None:
    """Two turns and a stop-string reply in one session, then what the pool trains on."""
    reply = httpx.post(f"{url}/rl/sessions", json={"group_size": 2}, timeout=60)
    assert reply.status_code == 200, reply.text
    sid = reply.json()["session_id"]
    c = openai.OpenAI(
        base_url=f"{url}/v1",
        api_key="unused",
        max_retries=0,
        default_headers={"X-Session-Id": sid},
        timeout=120,
    )
    messages = [{"role": "user", "content": "Name a color."}]
    sampled: list[list[int]] = []
    for turn in ("Another one.", "One more."):
        r = c.chat.completions.create(
            model=real_model_dir,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=1.0,
            seed=3,
            extra_body={"return_token_ids": True},
        )
        sampled.append(r.choices[0].model_extra["token_ids"])  # type: ignore[index]
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content or ""},
            {"role": "user", "content": turn},
        ]
    # A second conversation in the session, cut by a stop string: the same seeded reply
    # in full first (outside the session), then with a stop string from its text.
    free = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    same = {"max_tokens": 12, "temperature": 1.0, "seed": 7}
    full = free.chat.completions.create(
        model=real_model_dir,
        messages=messages[:1],  # type: ignore[arg-type]
        extra_body={"return_token_ids": True},
        **same,  # type: ignore[arg-type]
    )
    text = str(full.choices[0].message.content)
    full_ids = full.choices[0].model_extra["token_ids"]  # type: ignore[index]
    stop = next(text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2].strip())
    cut = c.chat.completions.create(
        model=real_model_dir,
        messages=messages[:1],  # type: ignore[arg-type]
        stop=[stop],
        **same,  # type: ignore[arg-type]
    )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    reward = httpx.post(f"{url}/rl/sessions/{sid}/reward", json={"reward": 1.0}, timeout=60)
    assert reward.status_code == 200, reward.text
    assert reward.json()["accepted"] is True, reward.text

    [group] = [f.group for f in co.buffered() if f.work.task_id == sid]
    first, second = group.trajectories
    trained = [t for t, m in zip(first.token_ids, first.loss_mask, strict=True) if m]
    assert trained == [t for turn in sampled for t in turn]
    renderer = ChatRenderer(load_tokenizer(real_model_dir))
    opening = renderer.encode(renderer.text(messages[:1]))
    assert list(first.token_ids[: first.prompt_length]) == opening
    # The cut reply trains the ids up to the token that completed the stop string.
    cut_ids = [t for t, m in zip(second.token_ids, second.loss_mask, strict=True) if m]
    assert 0 < len(cut_ids) < len(full_ids) and cut_ids == full_ids[: len(cut_ids)]
    version = mesh.rollout.version
    assert {v for v, m in zip(first.versions, first.loss_mask, strict=True) if m} == {version}
