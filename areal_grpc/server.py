"""Scaffolding shared by every service: serving, health, reflection, limits, channels.

Every process serves its servicers on a ``grpc.aio`` server together with ``grpc.health.v1``
health and server reflection, with message-size limits and keepalive, and stops gracefully on
SIGTERM or SIGINT (health turns NOT_SERVING first, so routers stop sending new work, then
in-flight calls get ``grace_s`` to finish). Request bytes are parsed by our handlers, so bytes
that are not the request message get INVALID_ARGUMENT naming the message type (grpc.aio's own
deserializer path answers UNKNOWN). Clients use :func:`aio_channel` or :func:`sync_channel`,
which carry the matching options; without explicit options they use the process-wide default
(:func:`set_default_channel_options`), which is how one run's TLS and token reach every
channel a process opens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from arealgrpc.v1 import coordinator_pb2, rollout_pb2, trainer_pb2, weight_sync_pb2
from google.protobuf import descriptor_pool
from google.protobuf.descriptor_pb2 import MethodOptions
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from areal_grpc import tracing
from areal_grpc.security import (
    BearerTokenInterceptor,
    ClientTls,
    ServerTls,
    aio_token_interceptors,
    check_plaintext_bind,
    with_sync_token,
)

log = logging.getLogger(__name__)

MiB = 1 << 20

# Exit code of a server process that stopped because it can serve no more (a servicer's
# ``fatal()`` returned: a rollout server's engine died); its launcher replaces it.
EXIT_FATAL = 3
# Seconds in-flight calls get to end (with the servicer's own error) on such a stop.
FATAL_GRACE_S = 2.0


@dataclass
class ServerOptions:
    """Network and limits of one gRPC server."""

    host: str = "127.0.0.1"
    # 0 picks a free port; the bound port is on RunningServer.port.
    port: int = 0
    # Largest message accepted or sent. Weight and state-dict streams use <= 1 MiB chunks, so
    # this bounds trajectory groups and unary calls.
    max_message_bytes: int = 64 * MiB
    # Seconds in-flight calls get to finish on a graceful stop.
    grace_s: float = 10.0
    # A peer that stops answering (frozen, partitioned: its kernel still takes the bytes) is
    # found by an unanswered ping within keepalive_time_s + keepalive_timeout_s, and its calls
    # fail UNAVAILABLE; a busy one still answers (gRPC's core does, not our Python code).
    keepalive_time_s: float = 10.0
    keepalive_timeout_s: float = 5.0
    # Concurrent RPCs; further calls wait (bounded memory under load).
    max_concurrent_rpcs: int | None = 256
    # Further core channel arguments, e.g. chunk_wire.stream_channel_options().
    extra: list[tuple[str, Any]] = field(default_factory=list)
    # TLS (mutual when it names a client CA); None serves plaintext, loopback only unless
    # allow_plaintext is set.
    tls: ServerTls | None = None
    allow_plaintext: bool = False
    # Calls must carry "authorization: Bearer <auth_token>" (health checks excepted).
    auth_token: str | None = None


@dataclass
class ChannelOptions:
    """How a client dials: message and keepalive limits matching :class:`ServerOptions`,
    ``tls`` (a :class:`~areal_grpc.security.ClientTls`; None: plaintext) and ``auth_token``."""

    max_message_bytes: int = 64 * MiB
    # As ServerOptions' (servers accept a ping every 5 s, see server_options).
    keepalive_time_s: float = 10.0
    keepalive_timeout_s: float = 5.0
    extra: list[tuple[str, Any]] = field(default_factory=list)
    # Verify the server with TLS (and present a client certificate for mTLS).
    tls: ClientTls | None = None
    # Sent as "authorization: Bearer <auth_token>" on every call.
    auth_token: str | None = None


# What aio_channel/sync_channel use when called without options. A process sets it once at
# start (servers from their flags, the coordinator from its run config) so that every client
# it builds, wherever it is built, speaks the run's TLS and token.
_default_channel_options = ChannelOptions()


def set_default_channel_options(opts: ChannelOptions) -> ChannelOptions:
    """Makes ``opts`` this process's default channel options; returns the previous default."""
    global _default_channel_options
    previous = _default_channel_options
    _default_channel_options = opts
    return previous


def default_channel_options(extra: Sequence[tuple[str, Any]] = ()) -> ChannelOptions:
    """A copy of the process-wide default channel options with ``extra`` arguments appended.

    For call sites that need their own channel arguments (e.g. bulk chunk streams) and must
    still carry the process's TLS and token.
    """
    base = _default_channel_options
    return dataclasses.replace(base, extra=[*base.extra, *extra])


@dataclass
class Service:
    """A servicer and how to add it: ``add`` is the generated ``add_*Servicer_to_server``."""

    name: str
    servicer: object
    add: Callable[[Any, Any], None]


def service(servicer: object, add: Callable[[Any, Any], None], pb2_module: Any) -> Service:
    """A :class:`Service` whose name is read from the generated module's descriptor."""
    cls_name = add.__name__.removeprefix("add_").removesuffix("Servicer_to_server")
    descriptor = pb2_module.DESCRIPTOR.services_by_name[cls_name]
    return Service(name=descriptor.full_name, servicer=servicer, add=add)


def server_options(opts: ServerOptions) -> list[tuple[str, Any]]:
    """Core channel arguments for a server."""
    return [
        ("grpc.max_receive_message_length", opts.max_message_bytes),
        ("grpc.max_send_message_length", opts.max_message_bytes),
        ("grpc.keepalive_time_ms", int(opts.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(opts.keepalive_timeout_s * 1000)),
        # gRPC's core times a ping out after this (default 60 s), keepalive pings included.
        ("grpc.http2.ping_timeout_ms", int(opts.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ("grpc.http2.max_pings_without_data", 0),
        # Two servers must never share a port by accident (tests bind many on loopback).
        ("grpc.so_reuseport", 0),
        *opts.extra,
    ]


def idempotent_methods() -> dict[str, tuple[str, ...]]:
    """Service -> methods the contract marks safe to repeat (``option idempotency_level``).

    Health.Check is one too: grpc.health.v1 says so in its comment, not in an option.
    """
    found: dict[str, tuple[str, ...]] = {"grpc.health.v1.Health": ("Check",)}
    for module in (coordinator_pb2, rollout_pb2, trainer_pb2, weight_sync_pb2):
        for svc in module.DESCRIPTOR.services_by_name.values():
            names = tuple(
                m.name
                for m in svc.methods
                if m.GetOptions().idempotency_level != MethodOptions.IDEMPOTENCY_UNKNOWN
            )
            if names:
                found[svc.full_name] = names
    return found


# Calls that are safe to repeat: gRPC retries them on UNAVAILABLE (a peer restarting or not
# yet listening). Everything else fails fast and is handled by the caller, who knows whether
# the work was done.
IDEMPOTENT_METHODS = idempotent_methods()

RETRY_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [
                    {"service": svc, "method": m}
                    for svc, methods in IDEMPOTENT_METHODS.items()
                    for m in methods
                ],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


def channel_options(opts: ChannelOptions | None = None) -> list[tuple[str, Any]]:
    """Core channel arguments for a client channel."""
    opts = opts or ChannelOptions()
    name = (
        [("grpc.ssl_target_name_override", opts.tls.server_name)]
        if opts.tls and opts.tls.server_name
        else []
    )
    return [
        *name,
        ("grpc.max_receive_message_length", opts.max_message_bytes),
        ("grpc.max_send_message_length", opts.max_message_bytes),
        ("grpc.keepalive_time_ms", int(opts.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(opts.keepalive_timeout_s * 1000)),
        # gRPC's core times a ping out after this (default 60 s), keepalive pings included:
        # without it a frozen peer holds a call for keepalive_time_s + 60 s.
        ("grpc.http2.ping_timeout_ms", int(opts.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", RETRY_SERVICE_CONFIG),
        *opts.extra,
    ]


def aio_channel(address: str, opts: ChannelOptions | None = None) -> grpc.aio.Channel:
    """An asyncio channel to ``address`` (host:port); ``opts`` default to the process's."""
    opts = opts if opts is not None else _default_channel_options
    interceptors = [*aio_token_interceptors(opts.auth_token), *tracing.aio_client_interceptors()]
    if opts.tls is not None:
        return grpc.aio.secure_channel(
            address, opts.tls.credentials(), channel_options(opts), interceptors=interceptors
        )
    return grpc.aio.insecure_channel(
        address, options=channel_options(opts), interceptors=interceptors
    )


# Channel states of a server that is gone (or of a channel closed under us).
_GONE = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)


class ChannelCache:
    """asyncio channels kept per address between calls (use it on one event loop).

    A repeated exchange (a weight update every step) then skips the connection set-up.
    :meth:`prune` before each exchange replaces the channels whose server went away: a server
    restarted at the same address is reached at once, not after the old channel's reconnect
    backoff.
    """

    def __init__(self, extra: Sequence[tuple[str, Any]] = ()) -> None:
        """``extra``: channel arguments added to the process's default options, which each
        channel takes as it is made (they carry the run's TLS and token)."""
        self._extra = list(extra)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Future[None]] = set()

    def prune(self) -> None:
        """Drops the channels whose server went away (call it before an exchange, while no
        call uses them: they are closed without waiting)."""
        for gone in [a for a, c in self._channels.items() if c.get_state() in _GONE]:
            task = asyncio.ensure_future(self._channels.pop(gone).close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def get(self, address: str) -> grpc.aio.Channel:
        """The kept channel to ``address``, made if there is none."""
        channel = self._channels.get(address)
        if channel is None:
            opts = default_channel_options(extra=self._extra)
            channel = self._channels[address] = aio_channel(address, opts)
        return channel

    async def aclose(self) -> None:
        """Closes every channel."""
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels), *self._closing, return_exceptions=True)


def sync_channel(address: str, opts: ChannelOptions | None = None) -> grpc.Channel:
    """A blocking channel to ``address`` (host:port); ``opts`` default to the process's."""
    opts = opts if opts is not None else _default_channel_options
    if opts.tls is not None:
        channel = grpc.secure_channel(address, opts.tls.credentials(), channel_options(opts))
    else:
        channel = grpc.insecure_channel(address, options=channel_options(opts))
    return tracing.traced_sync_channel(with_sync_token(channel, opts.auth_token))


# -- request parsing -------------------------------------------------------------------------
#
# grpc.aio runs a handler's request_deserializer outside the handler, and an exception there
# ends the call as UNKNOWN "Unexpected DecodeError". Every handler registered through
# start_server is therefore rebuilt (whatever built it: generated code or a hand-made table
# with a fast deserializer) with a deserializer that never raises: bytes that do not parse
# become an _Undecodable, and a thin wrapper around the behaviour aborts INVALID_ARGUMENT when
# it sees one. Handlers are rebuilt once per method, not per call.


class _Undecodable:
    """Stands in for request bytes that did not parse; carries the status message."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


async def drain_requests(requests: AsyncIterator[Any], limit: int) -> None:
    """Reads (and drops) at most ``limit`` more messages of a client stream a handler is about
    to fail: a grpc.aio client still writing when the status arrives reports INTERNAL instead
    of it (grpc/grpc#36066). A stream that breaks meanwhile ends the reading, not the error."""
    count = 0
    try:
        async for _ in requests:
            count += 1
            if count >= limit:
                return
    except Exception:  # the call is ending with the handler's error anyway
        return


def request_type_name(method: str) -> str:
    """Full name of the request message of ``/package.Service/Method`` ("request" if unknown)."""
    service_name, _, method_name = method.lstrip("/").rpartition("/")
    try:
        svc = descriptor_pool.Default().FindServiceByName(service_name)
        return str(svc.methods_by_name[method_name].input_type.full_name)
    except KeyError:
        return "request message"


def _never_raising(deserializer: Callable[[bytes], Any], type_name: str) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # any parse failure means the bytes are not the message
            return _Undecodable(f"request: not a valid {type_name}: {exc}")

    return parse


async def _reject(context: grpc.aio.ServicerContext, bad: _Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad.message)


async def _checked_stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Undecodable):
            await _reject(context, request)
        yield request


def _checking_behavior(behavior: Callable[..., Any], request_streaming: bool) -> Any:
    """``behavior`` of the same kind (coroutine or async generator) that rejects bad bytes.

    None for synchronous behaviours, which keep grpc's own parsing.
    """
    if inspect.iscoroutinefunction(behavior):
        if request_streaming:

            async def stream_in(requests: Any, context: Any) -> Any:
                return await behavior(_checked_stream(requests, context), context)

            return stream_in

        async def unary_in(request: Any, context: Any) -> Any:
            if isinstance(request, _Undecodable):
                await _reject(context, request)
            return await behavior(request, context)

        return unary_in
    if inspect.isasyncgenfunction(behavior):
        if request_streaming:

            async def stream_in_out(requests: Any, context: Any) -> Any:
                async for response in behavior(_checked_stream(requests, context), context):
                    yield response

            return stream_in_out

        async def unary_in_stream_out(request: Any, context: Any) -> Any:
            if isinstance(request, _Undecodable):
                await _reject(context, request)
            async for response in behavior(request, context):
                yield response

        return unary_in_stream_out
    return None


def parsing_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` answering INVALID_ARGUMENT (naming the message type) to unparsable bytes."""
    if handler.request_deserializer is None:
        return handler
    kinds = {
        (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
        (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
        (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
        (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
    }
    attr, make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    behavior = getattr(handler, attr)
    checked = _checking_behavior(behavior, bool(handler.request_streaming))
    if checked is None:
        return handler
    return make(
        checked,
        request_deserializer=_never_raising(
            handler.request_deserializer, request_type_name(method)
        ),
        response_serializer=handler.response_serializer,
    )


class _ParsingGenericHandler(grpc.GenericRpcHandler):
    """A generic handler whose method handlers go through :func:`parsing_handler`."""

    def __init__(self, inner: grpc.GenericRpcHandler) -> None:
        self._inner = inner
        # method -> (the inner handler, its rebuilt form); rebuilt again if inner changes.
        self._rebuilt: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        cached = self._rebuilt.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        rebuilt = parsing_handler(handler, method)
        self._rebuilt[method] = (handler, rebuilt)
        return rebuilt


class _ParsingRegistrar:
    """What a Service's ``add`` registers into: the server, with every handler rebuilt."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_ParsingGenericHandler(h) for h in handlers))

    def add_registered_method_handlers(
        self, service_name: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        rebuilt = {m: parsing_handler(h, f"/{service_name}/{m}") for m, h in handlers.items()}
        self._server.add_registered_method_handlers(service_name, rebuilt)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


class RunningServer:
    """A started server: its address, health servicer and graceful stop."""

    def __init__(
        self,
        server: grpc.aio.Server,
        health: health_aio.HealthServicer,
        host: str,
        port: int,
        services: Sequence[Service],
        grace_s: float,
    ) -> None:
        self.server = server
        self.health = health
        self.host = host
        self.port = port
        self.services = list(services)
        self.grace_s = grace_s

    @property
    def address(self) -> str:
        """host:port clients dial."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        """Reports every service (and the server as a whole, "") as SERVING or NOT_SERVING."""
        value = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *(s.name for s in self.services)]:
            await self.health.set(name, value)

    async def stop(self, grace_s: float | None = None) -> None:
        """Turns health NOT_SERVING, then stops, giving in-flight calls ``grace_s``."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.grace_s if grace_s is None else grace_s)

    async def wait(self) -> None:
        """Blocks until the server has stopped."""
        await self.server.wait_for_termination()


async def start_server(
    services: Sequence[Service], opts: ServerOptions | None = None
) -> RunningServer:
    """Starts a server with ``services`` plus health and reflection, all SERVING."""
    opts = opts or ServerOptions()
    check_plaintext_bind(opts.host, opts.tls, opts.allow_plaintext)
    interceptors = tracing.server_interceptors()
    if opts.auth_token:
        interceptors.append(BearerTokenInterceptor(opts.auth_token))
    server = grpc.aio.server(
        options=server_options(opts),
        maximum_concurrent_rpcs=opts.max_concurrent_rpcs,
        interceptors=interceptors,
    )
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    registrar = _ParsingRegistrar(server)
    for svc in services:
        svc.add(svc.servicer, registrar)
    names = [s.name for s in services]
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    host = opts.host
    bind_host = f"[{host}]" if ":" in host else host
    if opts.tls is not None:
        port = server.add_secure_port(f"{bind_host}:{opts.port}", opts.tls.credentials())
    else:
        port = server.add_insecure_port(f"{bind_host}:{opts.port}")
    if port == 0:
        raise OSError(f"could not bind {bind_host}:{opts.port}")
    await server.start()
    running = RunningServer(server, health, host, port, services, opts.grace_s)
    await running.set_serving(True)
    log.info("serving %s on %s", ", ".join(names) or "(health only)", running.address)
    return running


async def serve_until_signal(
    running: RunningServer, on_stop: Callable[[], Any] | None = None
) -> str | None:
    """Serves until SIGTERM or SIGINT, then drains gracefully (``on_stop`` runs first).

    A servicer with an ``async fatal() -> str`` (one that can fail for good, e.g. a rollout
    server whose engine died) ends the serving too when it returns: health turns NOT_SERVING,
    calls in flight get :data:`FATAL_GRACE_S`, and its reason is returned (None otherwise).
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(running.wait())
    stopper = asyncio.ensure_future(stop.wait())
    fatals = [
        asyncio.ensure_future(svc.servicer.fatal())  # type: ignore[attr-defined]
        for svc in running.services
        if callable(getattr(svc.servicer, "fatal", None))
    ]
    await asyncio.wait([waiter, stopper, *fatals], return_when=asyncio.FIRST_COMPLETED)
    failed = next((f.result() for f in fatals if f.done() and not f.cancelled()), None)
    if failed is not None:
        log.critical("%s cannot serve any more (%s): stopping", running.address, failed)
        await running.stop(FATAL_GRACE_S)
    elif stop.is_set():
        log.info("signal received: draining %s", running.address)
        if on_stop is not None:
            result = on_stop()
            if asyncio.iscoroutine(result):
                await result
        await running.stop()
    for f in (waiter, stopper, *fatals):
        f.cancel()
    return failed


class BackgroundServer:
    """An aio server on its own event-loop thread, for synchronous callers (tests, tools).

    Use as a context manager: ``with BackgroundServer(services) as running: ...``.
    """

    def __init__(self, services: Sequence[Service], opts: ServerOptions | None = None) -> None:
        self._services = services
        self._opts = opts
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.running: RunningServer | None = None

    def start(self) -> RunningServer:
        """Starts the loop thread and the server; returns the running server."""
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(
            start_server(self._services, self._opts), self._loop
        )
        self.running = future.result(timeout=60)
        return self.running

    def call(self, coro: Any, timeout_s: float = 60.0) -> Any:
        """Runs a coroutine on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout_s)

    def stop(self, grace_s: float | None = 0) -> None:
        """Stops the server and the loop thread."""
        if self.running is not None:
            self.call(self.running.stop(grace_s))
            self.running = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    def __enter__(self) -> RunningServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
