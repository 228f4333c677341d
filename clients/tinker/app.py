"""The Tinker HTTP face: the endpoints the official ``tinker`` SDK calls, over
LoraTrainingService (gRPC). docs/tinker-wire.md is the wire this follows.

Each heavy call is checked by the service at once (a bad datum is a 400 naming the field) and
becomes a future the SDK polls with ``retrieve_future``; the poll is held until the operation
is done or about 30 s passed. The caller's ``X-API-Key`` is passed on as the service's bearer
token, so the service decides which tenant a call belongs to and what it may see.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import math
import secrets
import struct
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from arealgrpc.v1 import common_pb2
from arealgrpc.v1 import lora_training_pb2 as pb
from arealgrpc.v1 import lora_training_pb2_grpc as pb_grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from google.rpc import error_details_pb2

from areal_grpc.config import TINKER_AUTOSAVE_ID
from areal_grpc.durations import duration
from areal_grpc.errors import field_violations, retry_delay_s
from areal_grpc.server import aio_channel

log = logging.getLogger(__name__)

PROTO = "application/x-protobuf"
POLL_HOLD_S = 25.0
FUTURE_TTL_S = 3600.0
LOSSES = {
    "cross_entropy": pb.LOSS_FUNCTION_CROSS_ENTROPY,
    "importance_sampling": pb.LOSS_FUNCTION_IMPORTANCE_SAMPLING,
    "ppo": pb.LOSS_FUNCTION_PPO,
    "cispo": pb.LOSS_FUNCTION_CISPO,
    "dro": pb.LOSS_FUNCTION_DRO,
}
LOSS_INPUTS = ("target_tokens", "weights", "logprobs", "advantages")
HTTP_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def _tinker_pb() -> Any:
    """The SDK's own protobuf schema (forward_backward bodies, fwd/bwd and sample results)."""
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


class HttpError(Exception):
    """An HTTP answer other than success: status, message, extra headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def _from_rpc(exc: grpc.aio.AioRpcError) -> HttpError:
    code = exc.code()
    status = HTTP_OF.get(code, 500)
    message = exc.details() or code.name
    violations = field_violations(exc)
    if violations:
        message = "; ".join(f"{f}: {d}" for f, d in violations)
    headers = {}
    if status == 429:
        delay = retry_delay_s(exc) or 1.0
        headers["retry-after-ms"] = str(int(delay * 1000))
    elif status in (409, 501):
        # The SDK retries these by default; asking again gets the same answer.
        headers["x-should-retry"] = "false"
    return HttpError(status, message, headers)


def _not_supported(what: str, status: int = 400) -> HttpError:
    # 400 (or 404 for a whole endpoint), not 501: the SDK retries every 5xx for minutes.
    return HttpError(status, f"not supported by this server: {what}")


def _result_error(status: Any) -> dict[str, Any]:
    """An operation's error as the SDK's RequestFailedResponse."""
    code = grpc.StatusCode.UNKNOWN
    for c in grpc.StatusCode:
        if c.value[0] == status.code:
            code = c
    message = status.message
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            message = "; ".join(f"{v.field}: {v.description}" for v in bad.field_violations)
    user = code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
    )
    return {"error": f"{code.name}: {message}", "category": "user" if user else "server"}


# -- tinker paths <-> checkpoint names -----------------------------------------------------

KIND_DIRS = {"weights": "state", "sampler_weights": "sampler"}


def tinker_path(checkpoint: str) -> str:
    """``training_runs/{run}/checkpoints/{kind}.{name}`` as ``tinker://{run}/{dir}/{name}``."""
    run, _, ckpt = checkpoint.removeprefix("training_runs/").partition("/checkpoints/")
    prefix, _, name = ckpt.partition(".")
    directory = {v: k for k, v in KIND_DIRS.items()}[prefix]
    return f"tinker://{run}/{directory}/{name}"


def checkpoint_name(path: str, key: str = "path") -> str:
    """A tinker path as the service's checkpoint name (HttpError 400 naming ``key``)."""
    parts = path.removeprefix("tinker://").split("/")
    if not path.startswith("tinker://") or len(parts) != 3 or parts[1] not in KIND_DIRS:
        raise HttpError(
            400, f"{key}: {path!r} is not tinker://<run>/<weights|sampler_weights>/<name>"
        )
    run, directory, name = parts
    return f"training_runs/{run}/checkpoints/{KIND_DIRS[directory]}.{name}"


# -- tensors -------------------------------------------------------------------------------

DTYPES = {1: np.float32, 2: np.int64, 3: np.int32}


def _tensor(t: Any, key: str) -> np.ndarray:
    if t.WhichOneof("encoding") != "dense":
        raise _not_supported(f"{key}: sparse tensors")
    if t.dtype not in DTYPES:
        raise HttpError(400, f"{key}: dtype {t.dtype} is not float32, int64 or int32")
    values = np.frombuffer(t.dense, dtype=DTYPES[t.dtype])
    if len(t.shape) > 1:
        raise _not_supported(f"{key}: {len(t.shape)}-D inputs (one value per token only)")
    return values


def _datum(i: int, d: Any) -> pb.Datum:
    tokens: list[int] = []
    for j, chunk in enumerate(d.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise _not_supported(f"data[{i}].model_input[{j}]: {kind} chunks (text only)")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist())
    out = pb.Datum(input_tokens=tokens)
    for key, tensor in d.loss_fn_inputs.items():
        if key not in LOSS_INPUTS:
            raise HttpError(
                400, f"data[{i}].loss_fn_inputs.{key}: not an input of the supported losses"
            )
        values = _tensor(tensor, f"data[{i}].loss_fn_inputs.{key}")
        if key == "target_tokens" and (
            values.size and not 0 <= values.min() <= values.max() < 2**31
        ):
            raise HttpError(400, f"data[{i}].loss_fn_inputs.target_tokens: ids out of range")
        getattr(out, key).extend(values.tolist())
    return out


def _batched(arrays: list[list[float]]) -> Any:
    tp = _tinker_pb()
    data = b"".join(np.asarray(a, dtype="<f4").tobytes() for a in arrays)
    offsets = np.cumsum([0, *(4 * len(a) for a in arrays)]).astype("<i8").tobytes()
    return tp.BatchedTensor(data=data, offsets=offsets, dtype=tp.DTYPE_FLOAT32)


# -- state ---------------------------------------------------------------------------------


@dataclass
class Future:
    """A request the SDK polls: the task producing its result (a JSON object or proto bytes)."""

    owner: str
    task: asyncio.Task[Any]
    created: float = field(default_factory=time.monotonic)


@dataclass
class Session:
    """An SDK session: whose it is, and its sampling sessions."""

    owner: str
    samplers: dict[str, dict[str, str]] = field(default_factory=dict)


class Face:
    """The HTTP face's state: the service channel, sessions, futures."""

    def __init__(self, address: str, channel: grpc.aio.Channel | None = None) -> None:
        self.address = address
        self._channel = channel
        self.sessions: dict[str, Session] = {}
        self.futures: dict[str, Future] = {}
        self.samplers: dict[str, tuple[str, dict[str, str]]] = {}
        self._ids = itertools.count(1)
        # Runs made through this face since the service last started, and those a restart
        # lost (with why), so that a call naming a lost run says what happened to it.
        self.runs_made: set[str] = set()
        self.lost_runs: set[str] = set()
        self.lost_reason = ""

    def service_lost(self, reason: str) -> None:
        """The service exited: its runs are gone, and calls on them say why."""
        self.lost_reason = reason
        self.lost_runs |= self.runs_made
        self.runs_made.clear()

    async def repoint(self, address: str) -> None:
        """Talks to the service at ``address`` from now on (a restarted one)."""
        old, self._channel, self.address = self._channel, None, address
        if old is not None:
            await old.close()

    async def call(self, rpc: str, request: Any, metadata: list[tuple[str, str]]) -> Any:
        """The service's method ``rpc`` (HttpError for a failure, saying why for lost runs)."""
        try:
            return await getattr(self.stub, rpc)(request, metadata=metadata, timeout=120)
        except grpc.aio.AioRpcError as exc:
            error, code = _from_rpc(exc), exc.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            error.message = f"the training service is unavailable ({error.message})"
            if self.lost_reason:
                error.message += f"; {self.lost_reason}"
        elif code == grpc.StatusCode.NOT_FOUND:
            lost = next((run for run in self.lost_runs if run in error.message), None)
            if lost is not None:
                error.message += f": {self.lost_reason}"
                saved = await self._autosave_of(lost, metadata)
                if saved is not None:
                    error.message += (
                        f"; its state at step {saved.step} is saved as "
                        f"{tinker_path(saved.name)}, which "
                        "create_training_client_from_state_with_optimizer resumes"
                    )
        raise error

    async def _autosave_of(self, run: str, metadata: list[tuple[str, str]]) -> pb.Checkpoint | None:
        """The lost run's last autosave (tinker.autosave_steps), if the service has one."""
        name = f"training_runs/{run}/checkpoints/{TINKER_AUTOSAVE_ID}"
        try:
            reply = await self.stub.GetCheckpoint(
                pb.GetCheckpointRequest(name=name), metadata=metadata, timeout=30
            )
        except grpc.aio.AioRpcError:
            return None
        return reply.checkpoint

    @property
    def stub(self) -> pb_grpc.LoraTrainingServiceStub:
        if self._channel is None:
            # The process's channel options: the run's TLS (see areal_grpc.tinker).
            self._channel = aio_channel(self.address)
        return pb_grpc.LoraTrainingServiceStub(self._channel)

    async def close(self) -> None:
        for f in self.futures.values():
            f.task.cancel()
        if self._channel is not None:
            await self._channel.close()

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def future(self, owner: str, work: Awaitable[Any]) -> dict[str, Any]:
        # A result stays for an hour: the SDK polls it within seconds, and again only if a
        # poll's reply was lost.
        horizon = time.monotonic() - FUTURE_TTL_S
        for old in [k for k, f in self.futures.items() if f.task.done() and f.created < horizon]:
            del self.futures[old]
        request_id = self.new_id("req")
        self.futures[request_id] = Future(owner, asyncio.ensure_future(work))
        return {"request_id": request_id}


def _owner(request: Request) -> tuple[str, list[tuple[str, str]]]:
    key = request.headers.get("x-api-key", "")
    if not key:
        raise HttpError(401, "X-API-Key is needed")
    # Sessions and futures are kept per key: another key's are not found.
    owner = hashlib.sha256(key.encode()).hexdigest()
    return owner, [("authorization", f"Bearer {key}")]


async def _await_op(face: Face, op: pb.Operation, metadata: list[tuple[str, str]]) -> pb.Operation:
    while not op.done:
        try:
            reply = await face.call(
                "WaitOperation",
                pb.WaitOperationRequest(name=op.name, timeout=duration(30)),
                metadata,
            )
        except HttpError as exc:
            if exc.status != 503:
                raise
            # The service died under the call: its result is lost with it.
            raise OpFailed({"error": exc.message, "category": "server"}) from None
        op = reply.operation
    return op


class OpFailed(Exception):
    """An operation that ended in an error (answered as the SDK's RequestFailedResponse)."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body["error"])
        self.body = body


async def _result(face: Face, op: pb.Operation, metadata: list[tuple[str, str]]) -> pb.Operation:
    op = await _await_op(face, op, metadata)
    if op.WhichOneof("result") == "error":
        raise OpFailed(_result_error(op.error))
    return op


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError as exc:
        raise HttpError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    return body


def _need(body: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(key)
    if value is None or not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise HttpError(400, f"{key}: required ({getattr(kind, '__name__', kind)})")
    return value


INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)


def _int(
    obj: dict[str, Any], key: str, default: int, where: str = "", bounds: tuple[int, int] = INT32
) -> int:
    """``obj[key]`` as an integer within ``bounds`` (HttpError 400 naming it otherwise)."""
    value = obj.get(key)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not (bounds[0] <= value <= bounds[1])
    ):
        raise HttpError(400, f"{where}{key}: must be an integer in {bounds[0]}..{bounds[1]}")
    return value


def _float(obj: dict[str, Any], key: str, default: float, where: str = "") -> float:
    """``obj[key]`` as a finite number (HttpError 400 naming it otherwise)."""
    value = obj.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise HttpError(400, f"{where}{key}: must be a finite number, got {value!r}")
    return float(value)


def _bool(obj: dict[str, Any], key: str, default: bool, where: str = "") -> bool:
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HttpError(400, f"{where}{key}: must be true or false, got {value!r}")
    return value


def _object(obj: dict[str, Any], key: str) -> dict[str, Any]:
    """``obj[key]``, a JSON object ({} when absent)."""
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise HttpError(400, f"{key}: must be an object")
    return value


def _sampling(params: dict[str, Any]) -> tuple[common_pb2.SamplingParams, list[str]]:
    at = "sampling_params."
    s = common_pb2.SamplingParams(
        max_new_tokens=_int(params, "max_tokens", 16, at) or 16,
        temperature=_float(params, "temperature", 1.0, at),
        top_p=_float(params, "top_p", 1.0, at),
        top_k=max(0, _int(params, "top_k", -1, at)),
    )
    if params.get("seed") is not None:
        s.seed = _int(params, "seed", 0, at, INT64) % 2**64
    stop = params.get("stop")
    strings: list[str] = []
    if stop is not None:
        # A stop list replaces the model's EOS; [] stops at nothing.
        s.ignore_eos = True
        items = [stop] if isinstance(stop, str) else list(stop)
        for item in items:
            if isinstance(item, str):
                strings.append(item)
            elif isinstance(item, int):
                s.stop_token_ids.append(item)
            else:
                raise HttpError(400, "sampling_params.stop: strings or token ids")
    return s, strings


def create_app(address: str, channel: grpc.aio.Channel | None = None) -> FastAPI:
    """The FastAPI app serving the SDK's endpoints, talking to LoraTrainingService at
    ``address`` (or over ``channel``)."""
    face = Face(address, channel)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        yield
        await face.close()

    app = FastAPI(title="areal-grpc Tinker face", lifespan=lifespan)
    app.state.face = face

    @app.exception_handler(HttpError)
    async def http_error(request: Request, exc: HttpError) -> JSONResponse:
        # A 4xx always carries a body: the SDK takes an empty 400 for a proxy's.
        return JSONResponse({"detail": exc.message}, exc.status, headers=exc.headers)

    # -- session plumbing ------------------------------------------------------------------

    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config() -> dict[str, Any]:
        return {}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, str]:
        owner, metadata = _owner(request)
        # The key must be a tenant's: a session of an unknown key would fail later.
        await face.call("ListTrainingRuns", pb.ListTrainingRunsRequest(), metadata)
        # Unique across restarts of the face: run ids (and so tinker paths) derive from it.
        session_id = f"session-{secrets.token_hex(6)}"
        face.sessions[session_id] = Session(owner)
        return {"session_id": session_id}

    def session_of(owner: str, session_id: Any) -> Session:
        session = face.sessions.get(str(session_id))
        if session is None or session.owner != owner:
            raise HttpError(404, f"session_id: no session {session_id!r}")
        return session

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> dict[str, Any]:
        owner, _ = _owner(request)
        body = await _body(request)
        session_of(owner, body.get("session_id"))
        return {}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> dict[str, Any]:
        owner, _ = _owner(request)
        session_of(owner, session_id)
        return {}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities(request: Request) -> dict[str, Any]:
        _, metadata = _owner(request)
        reply = await face.call("ListBaseModels", pb.ListBaseModelsRequest(), metadata)
        return {
            "supported_models": [
                {
                    "model_name": m.name,
                    "max_context_length": m.max_context_length,
                    "trainable": m.trainable,
                    "sampleable": m.sampleable,
                }
                for m in reply.base_models
            ]
        }

    # -- training runs -----------------------------------------------------------------------

    async def run_info(run: pb.TrainingRun, metadata: list[tuple[str, str]]) -> dict[str, Any]:
        run_id = run.name.removeprefix("training_runs/")
        models = await face.call("ListBaseModels", pb.ListBaseModelsRequest(), metadata)
        tokenizer = next(
            (m.tokenizer_id for m in models.base_models if m.name == run.base_model),
            run.base_model,
        )
        return {
            "model_id": run_id,
            # The SDK's get_tokenizer() loads tokenizer_id (a directory here, when the
            # service's machine has the model's files).
            "model_data": {"model_name": run.base_model, "tokenizer_id": tokenizer},
            "is_lora": True,
            "lora_rank": run.lora.rank,
            "model_name": run.base_model,
        }

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        owner, metadata = _owner(request)
        body = await _body(request)
        session = _need(body, "session_id", str)
        session_of(owner, session)
        seq = _int(body, "model_seq_id", -1, bounds=(0, INT64[1]))
        if seq < 0:
            raise HttpError(400, "model_seq_id: required (a non-negative integer)")
        optimizer = _object(body, "optimizer_config").get("type", "adamw")
        if optimizer != "adamw":
            raise _not_supported(f"optimizer_config.type {optimizer!r} (adamw only)")
        lora = _object(body, "lora_config")
        at = "lora_config."
        spec = pb.LoraSpec(
            rank=_int(lora, "rank", 32, at),
            train_attn=_bool(lora, "train_attn", True, at),
            train_mlp=_bool(lora, "train_mlp", True, at),
            train_unembed=_bool(lora, "train_unembed", False, at),
        )
        if lora.get("seed") is not None:
            spec.seed = _int(lora, "seed", 0, at, INT64)
        reply = await face.call(
            "CreateTrainingRun",
            pb.CreateTrainingRunRequest(
                base_model=_need(body, "base_model", str),
                lora=spec,
                training_run_id=f"{session}:train:{seq}",
            ),
            metadata,
        )

        async def work() -> dict[str, Any]:
            op = await _result(face, reply.operation, metadata)
            run_id = op.training_run.name.removeprefix("training_runs/")
            face.runs_made.add(run_id)
            return {"model_id": run_id}

        return face.future(owner, work())

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        _, metadata = _owner(request)
        body = await _body(request)
        model_id = _need(body, "model_id", str)
        reply = await face.call(
            "GetTrainingRun",
            pb.GetTrainingRunRequest(name=f"training_runs/{model_id}"),
            metadata,
        )
        return await run_info(reply.training_run, metadata)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        owner, metadata = _owner(request)
        raw = await request.body()
        if request.headers.get("content-encoding", "") == "zstd":
            import zstandard

            raw = zstandard.ZstdDecompressor().decompressobj().decompress(raw)
        if PROTO not in request.headers.get("content-type", ""):
            raise HttpError(400, f"the body must be {PROTO} (the SDK's ForwardBackwardRequest)")
        tp = _tinker_pb()
        msg = tp.ForwardBackwardRequest()
        try:
            msg.ParseFromString(raw)
        except Exception as exc:
            raise HttpError(400, f"the body is not a ForwardBackwardRequest: {exc}") from None
        if msg.loss_fn not in LOSSES:
            raise (
                HttpError(400, f"loss_fn: {msg.loss_fn!r} is not one of {sorted(LOSSES)}")
                if msg.loss_fn != "custom"
                else _not_supported("server-side custom losses")
            )
        config = pb.LossConfig()
        values: dict[str, float] = dict(msg.loss_fn_config)
        for k, v in msg.loss_fn_config_v2.items():
            if v.WhichOneof("value") != "number":
                raise HttpError(400, f"loss_fn_config.{k}: must be a number")
            values[k] = v.number
        for k, v in values.items():
            if k not in ("clip_low_threshold", "clip_high_threshold", "beta"):
                raise HttpError(400, f"loss_fn_config.{k}: not a setting of {msg.loss_fn}")
            setattr(config, k, v)
        data = [_datum(i, d) for i, d in enumerate(msg.data)]
        if msg.loss_fn == "cross_entropy":
            for d in data:
                if not d.weights:
                    d.weights.extend([1.0] * len(d.input_tokens))
        reply = await face.call(
            "ForwardBackward",
            pb.ForwardBackwardRequest(
                training_run=f"training_runs/{msg.model_id}",
                data=data,
                loss_function=LOSSES[msg.loss_fn],
                loss_config=config,
                forward_only=msg.forward_only,
                sequence_number=msg.seq_id,
            ),
            metadata,
        )

        async def work() -> bytes:
            op = await _result(face, reply.operation, metadata)
            result = op.forward_backward
            out = tp.ForwardBackwardOutput(
                loss_fn_output_type="ArrayRecord",
                loss_fn_outputs=[
                    tp.ArrayRecord(
                        type_tag="ArrayRecord",
                        fields={"logprobs": _batched([list(o.logprobs) for o in result.outputs])},
                        num_datums=len(result.outputs),
                    )
                ],
                metrics=dict(result.metrics),
            )
            return out.SerializeToString()

        return face.future(owner, work())

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        owner, metadata = _owner(request)
        body = await _body(request)
        if "adam_params" not in body:
            raise _not_supported("optimizers other than Adam")
        a, at = _object(body, "adam_params"), "adam_params."
        adam = pb.AdamParams(
            learning_rate=_float(a, "learning_rate", 1e-4, at),
            beta1=_float(a, "beta1", 0.9, at),
            beta2=_float(a, "beta2", 0.95, at),
            eps=_float(a, "eps", 1e-12, at),
            weight_decay=_float(a, "weight_decay", 0.0, at),
            grad_clip_norm=_float(a, "grad_clip_norm", 0.0, at),
        )
        reply = await face.call(
            "OptimStep",
            pb.OptimStepRequest(
                training_run=f"training_runs/{_need(body, 'model_id', str)}",
                adam=adam,
                sequence_number=_int(body, "seq_id", 0, bounds=(0, INT64[1])),
            ),
            metadata,
        )

        async def work() -> dict[str, Any]:
            op = await _result(face, reply.operation, metadata)
            return {"metrics": dict(op.optim_step.metrics)}

        return face.future(owner, work())

    async def save(
        owner: str,
        metadata: list[tuple[str, str]],
        body: dict[str, Any],
        kind: int,
        name: str,
    ) -> pb.SaveWeightsResponse:
        prefix = "state" if kind == pb.CHECKPOINT_KIND_STATE else "sampler"
        return await face.call(
            "SaveWeights",
            pb.SaveWeightsRequest(
                training_run=f"training_runs/{_need(body, 'model_id', str)}",
                checkpoint_id=f"{prefix}.{name}",
                kind=kind,  # type: ignore[arg-type]
                sequence_number=_int(body, "seq_id", 0, bounds=(0, INT64[1])),
            ),
            metadata,
        )

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        owner, metadata = _owner(request)
        body = await _body(request)
        reply = await save(
            owner, metadata, body, pb.CHECKPOINT_KIND_STATE, _need(body, "path", str)
        )

        async def work() -> dict[str, Any]:
            op = await _result(face, reply.operation, metadata)
            return {"path": tinker_path(op.checkpoint.name)}

        return face.future(owner, work())

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
        owner, metadata = _owner(request)
        body = await _body(request)
        named = body.get("path")
        name = str(named) if named else face.new_id("s")
        reply = await save(owner, metadata, body, pb.CHECKPOINT_KIND_SAMPLER, name)

        async def work() -> dict[str, Any]:
            op = await _result(face, reply.operation, metadata)
            path = tinker_path(op.checkpoint.name)
            if named:
                return {"path": path}
            sampler_id = face.new_id("sampler")
            face.samplers[sampler_id] = (
                owner,
                {"checkpoint": op.checkpoint.name, "base_model": op.checkpoint.base_model},
            )
            return {"sampling_session_id": sampler_id, "path": path}

        return face.future(owner, work())

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        owner, metadata = _owner(request)
        body = await _body(request)
        checkpoint = checkpoint_name(_need(body, "path", str))
        with_optimizer = _bool(body, "optimizer", False)
        if body.get("model_id"):
            reply = await face.call(
                "LoadWeights",
                pb.LoadWeightsRequest(
                    training_run=f"training_runs/{body['model_id']}",
                    checkpoint=checkpoint,
                    with_optimizer=with_optimizer,
                    sequence_number=_int(body, "seq_id", 0, bounds=(0, INT64[1])),
                ),
                metadata,
            )

            async def load() -> dict[str, Any]:
                await _result(face, reply.operation, metadata)
                return {"path": body["path"]}

            return face.future(owner, load())
        # A new run from a checkpoint: the same adapter shape as the checkpoint's run.
        session = _need(body, "session_id", str)
        session_of(owner, session)
        seq = _need(body, "model_seq_id", int)
        # The checkpoint, not its run: the run may be gone (a restart) while its state stays.
        source = await face.call(
            "GetCheckpoint", pb.GetCheckpointRequest(name=checkpoint), metadata
        )
        created = await face.call(
            "CreateTrainingRun",
            pb.CreateTrainingRunRequest(
                base_model=source.checkpoint.base_model,
                lora=source.checkpoint.lora,
                training_run_id=f"{session}:train:{seq}",
            ),
            metadata,
        )

        async def create_and_load() -> dict[str, Any]:
            op = await _result(face, created.operation, metadata)
            reply = await face.call(
                "LoadWeights",
                pb.LoadWeightsRequest(
                    training_run=op.training_run.name,
                    checkpoint=checkpoint,
                    with_optimizer=with_optimizer,
                ),
                metadata,
            )
            await _result(face, reply.operation, metadata)
            run_id = op.training_run.name.removeprefix("training_runs/")
            face.runs_made.add(run_id)
            return {"path": body["path"], "model_id": run_id}

        return face.future(owner, create_and_load())

    # -- sampling ------------------------------------------------------------------------------

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        owner, metadata = _owner(request)
        body = await _body(request)
        session_of(owner, _need(body, "session_id", str))
        sampler_id = face.new_id("sampler")
        if body.get("model_path"):
            checkpoint = checkpoint_name(str(body["model_path"]), "model_path")
            found = await face.call(
                "GetCheckpoint", pb.GetCheckpointRequest(name=checkpoint), metadata
            )
            target = {
                "checkpoint": checkpoint,
                "base_model": found.checkpoint.base_model,
                "model_path": str(body["model_path"]),
            }
        elif body.get("base_model"):
            target = {"base_model": str(body["base_model"])}
        else:
            raise HttpError(400, "model_path or base_model is needed")
        face.samplers[sampler_id] = (owner, target)
        return {"sampling_session_id": sampler_id}

    def sampler_of(owner: str, sampler_id: str) -> dict[str, str]:
        found = face.samplers.get(sampler_id)
        if found is None or found[0] != owner:
            raise HttpError(404, f"sampling_session_id: no sampler {sampler_id!r}")
        return found[1]

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request) -> dict[str, Any]:
        owner, _ = _owner(request)
        target = sampler_of(owner, sampler_id)
        out = {"sampler_id": sampler_id, "base_model": target["base_model"]}
        if "model_path" in target:
            out["model_path"] = target["model_path"]
        return out

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        owner, metadata = _owner(request)
        body = await _body(request)
        target = sampler_of(owner, _need(body, "sampling_session_id", str))
        tokens: list[int] = []
        chunks = _object(body, "prompt").get("chunks") or []
        if not isinstance(chunks, list):
            raise HttpError(400, "prompt.chunks: must be a list")
        for j, chunk in enumerate(chunks):
            if not isinstance(chunk, dict):
                raise HttpError(400, f"prompt.chunks[{j}]: must be an object")
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise _not_supported(f"prompt.chunks[{j}]: {chunk.get('type')} chunks")
            ids = chunk.get("tokens") or []
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in ids
            ):
                raise HttpError(400, f"prompt.chunks[{j}].tokens: must be token ids (integers)")
            tokens.extend(ids)
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(key):
                raise _not_supported(key)
        if body.get("target_prompt_logprobs") is not None:
            raise _not_supported("target_prompt_logprobs")
        sampling, stop = _sampling(_object(body, "sampling_params"))
        n = _int(body, "num_samples", 1, bounds=(1, 64))
        sampling.n_samples = n
        req = pb.SampleRequest(
            prompt_tokens=tokens,
            sampling=sampling,
            stop=stop,
            prompt_logprobs=_bool(body, "prompt_logprobs", False),
        )
        if "checkpoint" in target:
            req.checkpoint = target["checkpoint"]
        else:
            req.base_model = target["base_model"]
        reply = await face.call("Sample", req, metadata)
        tp = _tinker_pb()
        last_n = _int(body, "prompt_logprobs_last_n", 0, bounds=(1, INT32[1])) or None

        async def work() -> bytes:
            op = await _result(face, reply.operation, metadata)
            result = op.sample
            out = tp.SampleResponse(
                sequences=[
                    tp.SampledSequence(
                        stop_reason=tp.STOP_REASON_STOP
                        if c.finish_reason == common_pb2.FINISH_REASON_STOP
                        else tp.STOP_REASON_LENGTH,
                        tokens=np.asarray(c.output_ids, dtype="<i4").tobytes(),
                        logprobs=np.asarray(c.output_logprobs, dtype="<f4").tobytes(),
                    )
                    for c in result.completions
                ]
            )
            if body.get("prompt_logprobs"):
                lps = list(result.prompt_logprobs)
                if last_n is not None:
                    lps = [math.nan] * max(0, len(lps) - int(last_n)) + lps[-int(last_n) :]
                out.prompt_logprobs = struct.pack(f"<{len(lps)}f", *lps)
            return out.SerializeToString()

        answer = face.future(owner, work())
        answer["sample_sequence_ids"] = [f"{answer['request_id']}:{i}" for i in range(n)]
        return answer

    # -- futures ---------------------------------------------------------------------------------

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Any:
        owner, _ = _owner(request)
        body = await _body(request)
        request_id = _need(body, "request_id", str)
        future = face.futures.get(request_id)
        if future is None or future.owner != owner:
            raise HttpError(404, f"request_id: no request {request_id!r}")
        done, _ = await asyncio.wait({future.task}, timeout=POLL_HOLD_S)
        if not done:
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        try:
            result = future.task.result()
        except OpFailed as exc:
            return exc.body
        except HttpError as exc:
            category = "user" if 400 <= exc.status < 500 else "server"
            return {"error": exc.message, "category": category}
        if isinstance(result, bytes):
            return Response(result, media_type=PROTO)
        return result

    # -- runs and checkpoints (REST) ----------------------------------------------------------

    def checkpoint_json(c: pb.Checkpoint) -> dict[str, Any]:
        return {
            "checkpoint_id": c.name.rpartition("/")[2],
            "checkpoint_type": "training" if c.kind == pb.CHECKPOINT_KIND_STATE else "sampler",
            "time": c.create_time.ToJsonString(),
            "tinker_path": tinker_path(c.name),
            "size_bytes": c.size_bytes,
        }

    def run_json(run: pb.TrainingRun) -> dict[str, Any]:
        return {
            "training_run_id": run.name.removeprefix("training_runs/"),
            "base_model": run.base_model,
            "model_owner": "",
            "is_lora": True,
            "corrupted": False,
            "lora_rank": run.lora.rank,
            "last_request_time": run.last_request_time.ToJsonString(),
        }

    @app.get("/api/v1/training_runs")
    async def training_runs(request: Request) -> dict[str, Any]:
        _, metadata = _owner(request)
        reply = await face.call("ListTrainingRuns", pb.ListTrainingRunsRequest(), metadata)
        runs = [run_json(r) for r in reply.training_runs]
        return {
            "training_runs": runs,
            "cursor": {"offset": 0, "limit": len(runs), "total_count": len(runs)},
        }

    @app.get("/api/v1/training_runs/{run_id}")
    async def training_run(run_id: str, request: Request) -> dict[str, Any]:
        _, metadata = _owner(request)
        reply = await face.call(
            "GetTrainingRun",
            pb.GetTrainingRunRequest(name=f"training_runs/{run_id}"),
            metadata,
        )
        return run_json(reply.training_run)

    @app.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def run_checkpoints(run_id: str, request: Request) -> dict[str, Any]:
        _, metadata = _owner(request)
        reply = await face.call(
            "GetTrainingRun",
            pb.GetTrainingRunRequest(name=f"training_runs/{run_id}"),
            metadata,
        )
        return {"checkpoints": [checkpoint_json(c) for c in reply.training_run.checkpoints]}

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        _, metadata = _owner(request)
        body = await _body(request)
        path = _need(body, "tinker_path", str)
        found = await face.call(
            "GetCheckpoint",
            pb.GetCheckpointRequest(name=checkpoint_name(path, "tinker_path")),
            metadata,
        )
        c = found.checkpoint
        return {
            "base_model": c.base_model,
            "is_lora": True,
            "lora_rank": c.lora.rank,
            "train_unembed": c.lora.train_unembed,
            "train_mlp": c.lora.train_mlp,
            "train_attn": c.lora.train_attn,
        }

    @app.api_route("/api/v1/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unsupported(rest: str) -> None:
        # Billing, publishing, audit, custom losses...: a clear refusal, never a hang.
        raise _not_supported(f"/api/v1/{rest}", 404)

    return app
