"""SGLang for the tests: a rollout server on a real SGLang server (its CPU path here), and a
fake HTTP server for what only runs on a GPU (LoRA adapters).

Callers of :func:`start_sglang_server` depend on the ``sglang_installed`` fixture
(tests/system/conftest.py), which skips where SGLang's venv is missing, or fails with
``AREAL_REQUIRE_SGLANG=1`` as CI sets.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import httpx
import torch
from areal_servers.rollout.receive.base import ReceiverConfig
from areal_servers.rollout.service import RolloutServicer
from areal_servers.rollout.sglang_engine import SGLangEngine
from areal_servers.rollout.weight_sync import WeightSyncServicer, build_weight_sync_service
from arealgrpc.v1 import (
    common_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    weight_sync_pb2,
    weight_sync_pb2_grpc,
)

from areal_grpc.config import SglangSettings
from areal_grpc.model import load_tokenizer
from areal_grpc.server import BackgroundServer, service, sync_channel
from areal_grpc.weight_transfer import PUSH_WEIGHTS_METHOD, encode_push_request
from tests.support.weightsync import push_messages

RPC_TIMEOUT = 120.0
# The built-in model the SGLang tests serve (about 1M parameters).
TINY = "builtin:tiny"
# A small KV cache: several servers fit on a 24 GiB machine; quick health checks (an idle
# SGLang answers /health in well under a second here: one token of the tiny model).
SETTINGS = SglangSettings(kv_cache_tokens=4096, health_interval_s=1.0, health_timeout_s=5.0)


@dataclass
class SglangServer:
    """A rollout server on an SGLang server, its stubs, and the deaths its engine reported."""

    server: BackgroundServer
    address: str
    engine: SGLangEngine
    weight_sync: WeightSyncServicer
    channel: grpc.Channel
    rollout: rollout_pb2_grpc.RolloutServiceStub
    sync: weight_sync_pb2_grpc.WeightSyncServiceStub
    deaths: list[str]
    # Where UpdateFromDisk paths must lie.
    disk_root: Path | None = None

    def version(self) -> int:
        """The version GetRolloutStatus reports."""
        status = self.rollout.GetRolloutStatus(
            rollout_pb2.GetRolloutStatusRequest(), timeout=RPC_TIMEOUT
        )
        return int(status.policy_version)

    def generate(self, prompt: list[int], **sampling: object) -> rollout_pb2.GenerateResponse:
        """One Generate call (``sampling``: SamplingParams fields)."""
        return self.rollout.Generate(
            rollout_pb2.GenerateRequest(
                input_ids=prompt, sampling=common_pb2.SamplingParams(**sampling)
            ),
            timeout=RPC_TIMEOUT,
        )

    def greedy(self, prompt: list[int], n: int = 12) -> rollout_pb2.Completion:
        """A greedy completion of ``n`` tokens (EOS ignored)."""
        reply = self.generate(prompt, temperature=0.0, max_new_tokens=n, ignore_eos=True)
        return reply.completions[0]

    def push(self, state_dict: dict[str, torch.Tensor], version: int) -> object:
        """PushWeights (STREAM) of ``state_dict`` as ``version``."""
        call = self.channel.stream_unary(
            PUSH_WEIGHTS_METHOD,
            request_serializer=encode_push_request,
            response_deserializer=weight_sync_pb2.PushWeightsResponse.FromString,
        )
        messages = push_messages(state_dict, version, chunk_bytes=1 << 16)
        return call(iter(messages), timeout=RPC_TIMEOUT)

    def sglang(self, path: str, payload: Any = None) -> httpx.Response:
        """One request to the SGLang server itself (GET without a payload)."""
        url = f"{self.engine.url}{path}"
        if payload is None:
            return httpx.get(url, timeout=RPC_TIMEOUT)
        return httpx.post(url, json=payload, timeout=RPC_TIMEOUT)

    def close(self) -> None:
        """Stops the server, then the engine (and the SGLang server it launched)."""
        self.channel.close()
        self.server.call(self.weight_sync.close())
        self.server.call(self.engine.close(), timeout_s=120)
        self.server.stop()


def start_sglang_server(
    model: str = TINY, settings: SglangSettings = SETTINGS, disk_root: Path | None = None
) -> SglangServer:
    """A started rollout server whose engine launched an SGLang server (deaths are recorded,
    not exited on: this is the test process)."""
    deaths: list[str] = []
    engine = SGLangEngine(model, settings)
    engine.on_death(deaths.append)
    rollout = RolloutServicer(engine, load_tokenizer(model))
    ws = build_weight_sync_service(
        engine,
        ReceiverConfig(
            disk_root=str(disk_root) if disk_root else None,
            socket_host="127.0.0.1",
            group_timeout_s=120,
        ),
    )
    server = BackgroundServer(
        [
            service(rollout, rollout_pb2_grpc.add_RolloutServiceServicer_to_server, rollout_pb2),
            ws,
        ]
    )
    running = server.start()
    try:
        server.call(engine.start(), timeout_s=settings.start_timeout_s)
    except BaseException:
        server.call(engine.close(), timeout_s=120)
        server.stop()
        raise
    channel = sync_channel(running.address)
    return SglangServer(
        server,
        running.address,
        engine,
        ws.servicer,  # type: ignore[arg-type]
        channel,
        rollout_pb2_grpc.RolloutServiceStub(channel),
        weight_sync_pb2_grpc.WeightSyncServiceStub(channel),
        deaths,
        disk_root,
    )


class FakeSGLangHTTP:
    """For what SGLang serves on a GPU only (LoRA adapters): answers /health, ``/generate``
    (one token; held until ``release`` while ``hold`` is set), ``/load_lora_adapter`` (success
    when the peft directory it names has its weights) and every other POST with success,
    recording each POST body."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, Any]] = []
        self.hold = False
        self.release = threading.Event()
        self.generating = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._answer({})

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(n) or b"null")
                fake.posts.append((self.path, body))
                if self.path == "/load_lora_adapter":
                    ok = (Path(body["lora_path"]) / "adapter_model.safetensors").is_file()
                    return self._answer({"success": ok, "message": ""})
                if self.path == "/generate":
                    fake.generating.set()
                    if fake.hold:
                        fake.release.wait(30)
                    # One token, then the length limit: enough for a request to complete.
                    meta = {
                        "output_token_logprobs": [[-0.5, 7, None]],
                        "finish_reason": {"type": "length"},
                    }
                    return self._answer({"output_ids": [7], "meta_info": meta})
                self._answer({"success": True, "message": "ok"})

            def _answer(self, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def bodies(self, path: str) -> list[Any]:
        """The bodies POSTed to ``path``, in order."""
        return [b for p, b in self.posts if p == path]

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
