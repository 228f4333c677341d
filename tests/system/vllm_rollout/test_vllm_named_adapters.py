"""Named LoRA adapters on the vllm engine (real vLLM, CPU build): ``LoadAdapter``,
``RemoveAdapter`` and ``GenerateRequest.adapter`` over real gRPC on loopback.

A request naming an adapter generates what a standalone peft model with that adapter
generates (greedy tokens equal, log-probs within ``LOGPROB_TOL`` of transformers' fp32
forward), alone and batched with rows of the other adapter and of the run's own policy.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from areal_clients.rollout import adapter_requests
from arealgrpc.v1 import common_pb2, rollout_pb2

from areal_grpc.errors import field_violations
from areal_grpc.model import load_model
from tests.support.vllm import RPC_TIMEOUT, SETTINGS, TINY, VllmServer, start_vllm_server

# vLLM's CPU kernels (its LoRA ones too) against transformers' eager fp32 forward.
LOGPROB_TOL = 2e-4
NEW_TOKENS = 8
ATTN = ("q_proj", "v_proj")
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
A = (1, 4, ATTN)
B = (2, 8, ALL_LINEAR)
PROMPTS = [[5, 17, 42, 99, 7], [40, 41, 42], [100, 7, 100, 7, 100, 7, 1]]


@pytest.fixture(scope="module")
def server(vllm_installed: None) -> Iterator[VllmServer]:
    """A rollout server on vLLM serving named adapters up to rank 8 (tiny model)."""
    s = start_vllm_server(settings=dataclasses.replace(SETTINGS, max_adapter_rank=8))
    yield s
    s.close()


@functools.cache
def peft_adapter(seed: int, rank: int, targets: tuple[str, ...]):
    """A standalone peft model on the served base with a random adapter that changes its
    outputs, and the adapter's tensors by peft's saved names."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False
    )
    model = get_peft_model(load_model(TINY, seed=0), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(3.0)
    model.eval()
    return model, {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


@functools.cache
def reference(which: tuple | None, prompt: tuple[int, ...]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs, each position recomputed from the whole sequence."""
    model = load_model(TINY, seed=0).eval() if which is None else peft_adapter(*which)[0]
    ids = list(prompt)
    logprobs = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
            tok = int(lp.argmax())
            ids.append(tok)
            logprobs.append(float(lp[tok]))
    return ids[len(prompt) :], logprobs


def load(server: VllmServer, name: str, which: tuple) -> rollout_pb2.LoadAdapterResponse:
    rank = which[1]
    requests = adapter_requests(name, peft_adapter(*which)[1], rank, 2.0 * rank)
    return server.rollout.LoadAdapter(requests, timeout=RPC_TIMEOUT)


def generate(server: VllmServer, prompt: list[int], adapter: str = "") -> rollout_pb2.Completion:
    sampling = common_pb2.SamplingParams(
        temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True
    )
    reply = server.rollout.Generate(
        rollout_pb2.GenerateRequest(input_ids=prompt, sampling=sampling, adapter=adapter),
        timeout=RPC_TIMEOUT,
    )
    return reply.completions[0]


def assert_matches(completion: rollout_pb2.Completion, which: tuple | None, prompt) -> None:
    tokens, logprobs = reference(which, tuple(prompt))
    assert list(completion.output_ids) == tokens
    assert list(completion.output_logprobs) == pytest.approx(logprobs, abs=LOGPROB_TOL)


def status(server: VllmServer) -> rollout_pb2.GetRolloutStatusResponse:
    return server.rollout.GetRolloutStatus(
        rollout_pb2.GetRolloutStatusRequest(), timeout=RPC_TIMEOUT
    )


def test_requests_naming_each_adapter_generate_as_peft_does_alone_and_batched(
    server: VllmServer,
):
    torch.set_num_threads(1)
    a = load(server, "a", A)
    b = load(server, "b", B)
    assert (a.name, a.replaced, b.replaced) == ("a", False, False)
    assert list(status(server).adapters) == ["a", "b"]
    which = {"": None, "a": A, "b": B}
    jobs = [(prompt, name) for prompt in PROMPTS for name in ("", "a", "b")]
    alone = [generate(server, prompt, name) for prompt, name in jobs]
    for (prompt, name), got in zip(jobs, alone, strict=True):
        assert_matches(got, which[name], prompt)
    assert len({tuple(c.output_ids) for c in alone[:3]}) == 3  # the adapters matter
    # Paused, every request waits at the gate; resumed, all go to vLLM together and decode
    # in the same steps, each row with its own adapter.
    server.rollout.PauseGeneration(rollout_pb2.PauseGenerationRequest(), timeout=RPC_TIMEOUT)
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(generate, server, p, n) for p, n in jobs]
        while status(server).queued_requests < len(jobs):
            time.sleep(0.01)
        server.rollout.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(), timeout=RPC_TIMEOUT)
        batched = [f.result() for f in futures]
    for (prompt, name), one, many in zip(jobs, alone, batched, strict=True):
        assert list(many.output_ids) == list(one.output_ids), (prompt, name)
        assert list(many.output_logprobs) == pytest.approx(
            list(one.output_logprobs), abs=LOGPROB_TOL
        )


def test_unknown_and_removed_adapters_are_not_found_and_the_server_serves_on(
    server: VllmServer,
):
    load(server, "gone", A)
    with pytest.raises(grpc.RpcError) as err:
        generate(server, PROMPTS[0], "nope")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert err.value.details().startswith("adapter: ")
    server.rollout.RemoveAdapter(rollout_pb2.RemoveAdapterRequest(name="gone"), timeout=RPC_TIMEOUT)
    assert "gone" not in status(server).adapters
    with pytest.raises(grpc.RpcError) as err:
        generate(server, PROMPTS[0], "gone")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        server.rollout.RemoveAdapter(
            rollout_pb2.RemoveAdapterRequest(name="gone"), timeout=RPC_TIMEOUT
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert_matches(generate(server, PROMPTS[1]), None, PROMPTS[1])
    # Loaded again under the same name, it serves again.
    load(server, "gone", B)
    assert_matches(generate(server, PROMPTS[1], "gone"), B, PROMPTS[1])
    assert server.fatal == []


def test_an_adapter_that_does_not_fit_is_invalid_argument_naming_the_field(server: VllmServer):
    tensors = dict(peft_adapter(*A)[1])
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key] = torch.zeros(4, 3)
    with pytest.raises(grpc.RpcError) as err:
        server.rollout.LoadAdapter(adapter_requests("bad", tensors, 4, 8.0), timeout=RPC_TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in field_violations(err.value)] == [f'tensor["{key}"].shape']
    # A rank above what vLLM was started for.
    wide = peft_adapter(3, 16, ATTN)[1]
    with pytest.raises(grpc.RpcError) as err:
        server.rollout.LoadAdapter(adapter_requests("wide", wide, 16, 32.0), timeout=RPC_TIMEOUT)
    assert [f for f, _ in field_violations(err.value)] == ["header.rank"]
    assert "bad" not in status(server).adapters and "wide" not in status(server).adapters
    assert_matches(generate(server, PROMPTS[0]), None, PROMPTS[0])
