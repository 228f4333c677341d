"""The ``sglang`` engine against a fake SGLang HTTP server on loopback.

SGLang needs a GPU, so these tests use a stand-in that checks every request against the
documented protocol (SGLang 0.5.10, as AReaL's ``areal/engine/sglang_remote.py`` sends it):
exact /generate payload keys and values, pause/continue bodies, update_weights_from_disk,
health. Test names say "fake_server".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from areal_servers.rollout.engine import FinishReason, SamplingConfig, generate_resumable
from areal_servers.rollout.sglang_engine import (
    NO_TOP_K,
    SGLangEngine,
    SGLangEngineConfig,
    SGLangError,
    generate_payload,
)
from peft import PeftModel
from safetensors.torch import load_file

from areal_grpc.config import LoraSettings
from areal_grpc.errors import PreconditionError
from areal_grpc.model import load_model

SAMPLING_KEYS = {
    "top_p",
    "top_k",
    "max_new_tokens",
    "temperature",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "frequency_penalty",
}


class FakeSGLang:
    """A scripted SGLang: records requests; ``/generate`` answers come from ``script``."""

    def __init__(self):
        self.requests: list[tuple[str, str, object]] = []
        self.paused = threading.Event()
        self.generate_seen = threading.Event()
        self.script: list = []  # callables (body) -> (status, json body)
        self.fail_next: dict[str, int] = {}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.requests.append(("GET", self.path, None))
                self._answer(200 if self.path == "/health" else 404, {})

            def do_POST(self):
                n = int(self.headers["Content-Length"])
                body = json.loads(self.rfile.read(n))
                fake.requests.append(("POST", self.path, body))
                if fake.fail_next.get(self.path, 0) > 0:
                    fake.fail_next[self.path] -= 1
                    return self._answer(503, {"error": "busy"})
                if self.path == "/pause_generation":
                    fake.paused.set()
                    return self._answer(200, {})
                if self.path == "/continue_generation":
                    fake.paused.clear()
                    return self._answer(200, {})
                if self.path == "/update_weights_from_disk":
                    ok = (Path(body["model_path"]) / "model.safetensors").is_file()
                    fake.loaded = load_file(str(Path(body["model_path"]) / "model.safetensors"))
                    return self._answer(200, {"success": ok, "message": ""})
                if self.path == "/load_lora_adapter":
                    ok = (Path(body["lora_path"]) / "adapter_model.safetensors").is_file()
                    return self._answer(200, {"success": ok, "message": ""})
                if self.path in (
                    "/init_weights_update_group",
                    "/update_weights_from_distributed",
                    "/unload_lora_adapter",
                ):
                    return self._answer(200, {"success": True, "message": ""})
                if self.path == "/generate":
                    fake.generate_seen.set()
                    status, answer = fake.script.pop(0)(body)
                    return self._answer(status, answer)
                self._answer(404, {})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.paused.set()  # release a handler that is waiting for a pause
        self.server.shutdown()
        self.server.server_close()

    def posts(self, path):
        return [body for method, p, body in self.requests if p == path]


def answer(tokens, finish, message=""):
    triples = [[-0.1 * (i + 1), t, None] for i, t in enumerate(tokens)]
    return 200, {
        "text": "",
        "meta_info": {
            "output_token_logprobs": triples,
            "finish_reason": {"type": finish, "message": message},
        },
    }


@pytest.fixture
def fake():
    server = FakeSGLang()
    yield server
    server.close()


def make_engine(fake):
    return SGLangEngine(SGLangEngineConfig(model="builtin:micro", url=fake.url, retry_wait_s=0.001))


async def test_sglang_protocol_fake_server_generate_pause_update_resume(fake):
    """Interrupted by a pause, the request is re-sent as prompt + partial output with the
    remaining budget after the update; tokens carry the version they were produced under."""

    def first(body):
        fake.paused.wait(30)  # in flight until the pause aborts it
        return answer([10, 11], "abort")

    fake.script = [first, lambda body: answer([12, 13, 1], "stop")]
    engine = make_engine(fake)
    await engine.start()
    cfg = SamplingConfig(temperature=0.8, top_p=0.9, max_new_tokens=5, stop_token_ids=(9,))
    task = asyncio.create_task(generate_resumable(engine, [5, 6, 7], cfg))
    await asyncio.to_thread(fake.generate_seen.wait, 30)
    assert await engine.pause() == 1
    state = {k: v for k, v in load_model("builtin:micro", seed=1).state_dict().items()}
    await engine.load_weights(state, version=1)
    await engine.resume()
    result = await task
    await engine.close()

    assert result.output_ids == [10, 11, 12, 13, 1]
    assert result.output_versions == [0, 0, 1, 1, 1]
    assert result.output_logprobs == pytest.approx([-0.1, -0.2, -0.1, -0.2, -0.3])
    assert result.finish_reason == FinishReason.STOP
    gens = fake.posts("/generate")
    assert [g["input_ids"] for g in gens] == [[5, 6, 7], [5, 6, 7, 10, 11]]
    for g, budget in zip(gens, [5, 3], strict=True):
        assert set(g) == {"input_ids", "image_data", "sampling_params", "return_logprob", "stream"}
        assert g["image_data"] == [] and g["return_logprob"] is True and g["stream"] is False
        assert set(g["sampling_params"]) == SAMPLING_KEYS
        sp = g["sampling_params"]
        assert sp["max_new_tokens"] == budget and sp["top_k"] == NO_TOP_K
        assert sp["temperature"] == pytest.approx(0.8) and sp["top_p"] == pytest.approx(0.9)
        assert sp["stop_token_ids"] == [9] and sp["ignore_eos"] is False
        assert sp["skip_special_tokens"] is True and sp["frequency_penalty"] == 0.0
    assert fake.posts("/pause_generation") == [{}]
    assert fake.posts("/continue_generation") == [{}]
    (update,) = fake.posts("/update_weights_from_disk")
    assert update["abort_all_requests"] is True and update["model_path"].endswith("v1")
    # The tied lm_head is stored once, under the embedding's name.
    assert set(fake.loaded) == set(state) - {"lm_head.weight"}
    assert all(fake.loaded[k].equal(state[k]) for k in fake.loaded)
    assert ("GET", "/health", None) in fake.requests
    assert engine.version == 1


async def test_sglang_protocol_fake_server_abort_before_prefill_and_greedy(fake):
    fake.script = [
        lambda body: answer([99], "abort", "Abort before prefill: paused"),
        lambda body: answer([4, 4], "length"),
    ]
    engine = make_engine(fake)
    cfg = SamplingConfig(temperature=0.0, top_k=5, max_new_tokens=2)
    result = await generate_resumable(engine, [3], cfg)
    assert result.output_ids == [4, 4] and result.finish_reason == FinishReason.LENGTH
    first, second = fake.posts("/generate")
    assert first["input_ids"] == second["input_ids"] == [3]
    assert first["sampling_params"]["temperature"] == 0.0
    assert first["sampling_params"]["top_k"] == 5


async def test_sglang_protocol_fake_server_top_logprobs(fake):
    """top_logprobs asks SGLang for ``top_logprobs_num`` and reads
    ``meta_info.output_top_logprobs`` ([logprob, token_id, text] per alternative)."""

    def with_top(body):
        status, answer_body = answer([4, 5], "length")
        answer_body["meta_info"]["output_top_logprobs"] = [
            [[-0.1, 4, "a"], [-2.0, 9, "b"]],
            [[-0.2, 5, "c"], [-1.5, 8, "d"]],
        ]
        return status, answer_body

    fake.script = [with_top, lambda body: answer([4], "length")]
    engine = make_engine(fake)
    result = await engine.generate([3], SamplingConfig(max_new_tokens=2, top_logprobs=2))
    assert fake.posts("/generate")[0]["top_logprobs_num"] == 2
    assert result.output_top == [([4, 9], [-0.1, -2.0]), ([5, 8], [-0.2, -1.5])]
    # Alternatives for fewer tokens than were generated: a malformed answer.
    with pytest.raises(SGLangError, match="top log-probs"):
        await engine.generate([3], SamplingConfig(max_new_tokens=1, top_logprobs=2))
    await engine.close()


def test_sglang_protocol_fake_server_seed_is_sampling_seed():
    """A seeded request carries SGLang's ``sampling_params.sampling_seed``; an unseeded one
    keeps the exact documented keys."""
    seeded = generate_payload([1], SamplingConfig(seed=42))
    assert seeded["sampling_params"]["sampling_seed"] == 42
    assert set(seeded["sampling_params"]) == SAMPLING_KEYS | {"sampling_seed"}
    assert set(generate_payload([1], SamplingConfig())["sampling_params"]) == SAMPLING_KEYS


async def test_sglang_protocol_fake_server_retries_transient_errors_only(fake):
    engine = make_engine(fake)
    fake.fail_next["/pause_generation"] = 2
    await engine.pause()  # two 503s, then success: 3 attempts
    assert len(fake.posts("/pause_generation")) == 3
    fake.fail_next["/continue_generation"] = 3
    with pytest.raises(ConnectionError):
        await engine.resume()
    assert len(fake.posts("/continue_generation")) == 3
    fake.script = [lambda body: (200, [1, 2, 3])]
    await engine.resume()
    with pytest.raises(SGLangError, match="not a JSON object"):
        await engine.generate([3], SamplingConfig(max_new_tokens=2))
    with pytest.raises(PreconditionError):
        await engine.update_weights_from_disk("/nowhere", version=0)
    assert fake.posts("/update_weights_from_disk") == []


async def test_sglang_protocol_fake_server_unreachable_url_is_a_connection_error():
    engine = SGLangEngine(
        SGLangEngineConfig(
            model="builtin:micro", url="http://127.0.0.1:9", retry_wait_s=0.001, request_retries=2
        )
    )
    with pytest.raises(ConnectionError):
        await engine.generate([3], SamplingConfig(max_new_tokens=1))
    with contextlib.suppress(Exception):
        await engine.close()


async def test_sglang_protocol_fake_server_cancelled_generate_disconnects_and_reuses_nothing():
    # SGLang aborts a request whose client disconnected: a cancelled episode must close its
    # connection, not leave it open (and generating) in the pool.
    disconnected = asyncio.Event()
    connections = 0

    async def read_request(reader: asyncio.StreamReader) -> str:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("ascii").lower()
        if "content-length:" in head:
            await reader.readexactly(int(head.split("content-length:")[1].split("\r\n")[0]))
        return head

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        if (await read_request(reader)).startswith("get /health"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            await read_request(reader)
        # A /generate that never answers: wait for the client to go away.
        if await reader.read(1) == b"":
            disconnected.set()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    engine = SGLangEngine(SGLangEngineConfig(model="builtin:micro", url=url))
    try:
        await engine.wait_healthy(timeout_s=10)
        task = asyncio.create_task(engine.generate([3], SamplingConfig(max_new_tokens=4)))
        while connections < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the /generate is on the wire
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.wait_for(disconnected.wait(), 10)
    finally:
        await engine.close()
        server.close()
        await server.wait_closed()
    # The health check's keep-alive connection carried the /generate too (pooled client).
    assert connections == 1


async def test_sglang_protocol_fake_server_distributed_update_payloads(fake):
    engine = make_engine(fake)
    await engine.init_weights_update_group("10.0.0.1", 29500, 1, 3, "areal-weights")
    assert fake.posts("/init_weights_update_group") == [
        {
            "master_address": "10.0.0.1",
            "master_port": "29500",
            "rank_offset": 1,
            "world_size": 3,
            "backend": "nccl",
            "group_name": "areal-weights",
        }
    ]
    await engine.update_weights_from_distributed(
        ["a.weight", "b.bias"], ["bfloat16", "float32"], [(4, 2), (3,)], "areal-weights", version=4
    )
    assert fake.posts("/update_weights_from_distributed") == [
        {
            "names": ["a.weight", "b.bias"],
            "dtypes": ["bfloat16", "float32"],
            "shapes": [[4, 2], [3]],
            "group_name": "areal-weights",
            "abort_all_requests": True,
        }
    ]
    assert engine.version == 4
    fake.fail_next["/update_weights_from_distributed"] = 1
    with pytest.raises(ConnectionError):
        await engine.update_weights_from_distributed(["a"], ["float32"], [[1]], "g", version=5)
    assert len(fake.posts("/update_weights_from_distributed")) == 2  # one attempt, no retry
    assert engine.version == 4


async def test_sglang_protocol_fake_server_unhealthy_until_ready_then_timeout_names_the_url():
    # SGLang answers GET /health with 503 while it loads the model, 200 once it serves.
    answers = [503, 503, 200]
    polls = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal polls
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while (await reader.readuntil(b"\r\n\r\n")).lower().startswith(b"get /health"):
                code = answers[min(polls, len(answers) - 1)]
                polls += 1
                writer.write(f"HTTP/1.1 {code} X\r\nContent-Length: 0\r\n\r\n".encode())
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    engine = SGLangEngine(SGLangEngineConfig(model="builtin:micro", url=url))
    try:
        await engine.wait_healthy(timeout_s=30)
        assert polls == 3  # polled until the 200, not past it
        answers[:] = [503]
        with pytest.raises(TimeoutError, match=url):
            await engine.wait_healthy(timeout_s=1.5)
        assert polls >= 5  # kept polling (about once a second) until the deadline
    finally:
        await engine.close()
        server.close()


async def test_sglang_protocol_fake_server_lora_adapter_per_version(fake, tmp_path):
    """With LoRA, each update is a peft directory loaded as "areal-v<version>"; requests name
    the adapter they were sent with and carry its version; a replaced adapter is unloaded (and
    its directory removed) only once its last request has finished."""
    lora = LoraSettings(rank=4, alpha=8.0)
    release = threading.Event()

    def held(body):
        release.wait(30)
        return answer([7], "length")

    fake.script = [lambda body: answer([5], "length"), held]
    engine = SGLangEngine(
        SGLangEngineConfig(
            model="builtin:micro", url=fake.url, lora=lora, weights_dir=str(tmp_path)
        )
    )
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=1)
    model = load_model("builtin:micro", lora=lora)
    adapters = {n: torch.randn_like(p) for n, p in model.named_parameters() if p.requires_grad}

    # Before any update the base model serves (LoRA's B starts at zero): no lora_path.
    first = await engine.generate([3], cfg)
    assert "lora_path" not in fake.posts("/generate")[0] and first.output_versions == [0]
    # A full state dict is not an adapter update: refused before SGLang hears of it.
    with pytest.raises(ValueError, match="unknown tensors"):
        await engine.load_weights(load_model("builtin:micro").state_dict(), 1)
    assert fake.posts("/load_lora_adapter") == []
    with pytest.raises(PreconditionError, match="LoRA"):
        await engine.update_weights_from_distributed(["x"], ["float32"], [[1]], "g", 1)

    await engine.load_weights(adapters, 1)
    assert fake.posts("/load_lora_adapter") == [
        {"lora_name": "areal-v1", "lora_path": str(tmp_path / "lora-v1")}
    ]
    served = PeftModel.from_pretrained(load_model("builtin:micro"), str(tmp_path / "lora-v1"))
    for name, tensor in served.named_parameters():
        if "lora_" in name:
            assert tensor.equal(adapters[name]), name

    fake.generate_seen.clear()
    in_flight = asyncio.create_task(engine.generate([4], cfg))
    await asyncio.to_thread(fake.generate_seen.wait, 30)
    assert fake.posts("/generate")[-1]["lora_path"] == "areal-v1"
    await engine.load_weights({n: t + 1 for n, t in adapters.items()}, 2)
    await engine.settle()
    # areal-v1 still has a request in flight: it stays loaded.
    assert fake.posts("/unload_lora_adapter") == [] and (tmp_path / "lora-v1").is_dir()
    release.set()
    result = await in_flight
    await engine.settle()
    assert result.output_versions == [1]  # the version of the adapter it ran on
    assert fake.posts("/unload_lora_adapter") == [{"lora_name": "areal-v1"}]
    assert not (tmp_path / "lora-v1").exists() and (tmp_path / "lora-v2").is_dir()
    fake.script = [lambda body: answer([6], "length")]
    latest = await engine.generate([5], cfg)
    assert fake.posts("/generate")[-1]["lora_path"] == "areal-v2" and latest.output_versions == [2]
    await engine.close()


def test_sglang_launch_enables_lora_for_the_run_adapters():
    engine = SGLangEngine(
        SGLangEngineConfig(
            model="builtin:micro", launch=True, lora=LoraSettings(rank=16, alpha=32.0)
        )
    )
    args = engine._lora_launch_args()
    assert args == ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all"]
