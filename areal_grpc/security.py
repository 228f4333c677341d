"""Transport security and authentication for every server and channel.

- TLS and mutual TLS from PEM files (:class:`ServerTls`, :class:`ClientTls`).
- A bearer-token check on the server (``authorization: Bearer <token>`` metadata, compared in
  constant time): a missing token is UNAUTHENTICATED, a wrong one PERMISSION_DENIED. Health
  checks stay open so load balancers and launchers can probe without the secret.
- Plaintext is allowed only on loopback unless explicitly allowed (:func:`check_plaintext_bind`).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


@dataclass
class ServerTls:
    """Server certificate and key; with ``client_ca_file`` clients must present a cert (mTLS)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials from the PEM files."""
        key = Path(self.key_file).read_bytes()
        cert = Path(self.cert_file).read_bytes()
        client_ca = Path(self.client_ca_file).read_bytes() if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(key, cert)],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The same certificate (and client check) for a plain TLS socket (the SOCKET side
        channel)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.cert_file, self.key_file)
        # No session tickets: each connection is used once, and a ticket the client never
        # reads makes its close a reset, which can cut off data not yet read on this side.
        ctx.num_tickets = 0
        if self.client_ca_file:
            ctx.load_verify_locations(self.client_ca_file)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


@dataclass
class ClientTls:
    """CA to verify servers with; ``cert_file``/``key_file`` for mutual TLS."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    # Name to expect in the server certificate when dialling it by another address.
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials from the PEM files."""
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca_file).read_bytes(),
            private_key=Path(self.key_file).read_bytes() if self.key_file else None,
            certificate_chain=Path(self.cert_file).read_bytes() if self.cert_file else None,
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The same trust (and client certificate) for a plain TLS socket; it checks the
        server's name as gRPC does."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(self.ca_file)
        if self.cert_file and self.key_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


TOKEN_ENV = "AREAL_AUTH_TOKEN"


def load_auth_token(path: str | None) -> str | None:
    """The bearer token from the file at ``path``, else ``$AREAL_AUTH_TOKEN``, else None."""
    if path:
        token = Path(path).read_text().strip()
        if not token:
            raise ValueError(f"the auth token file {path} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_plaintext_bind(host: str, tls: ServerTls | None, allow_plaintext: bool) -> None:
    """Refuses to serve plaintext beyond loopback unless explicitly allowed."""
    if tls is None and not allow_plaintext and not is_loopback(host):
        raise ValueError(
            f"refusing to serve plaintext on {host}: configure TLS, bind to loopback, or "
            "allow plaintext explicitly (--allow-plaintext)"
        )


def _aborting_handler(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with ``code``."""

    async def abort(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only with ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the auth token must not be empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method in OPEN_METHODS:
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        got = metadata.get("authorization")
        if got is None:
            return _aborting_handler(
                handler, grpc.StatusCode.UNAUTHENTICATED, "missing authorization: Bearer token"
            )
        given = got.encode() if isinstance(got, str) else bytes(got)
        if not hmac.compare_digest(given, self._expected):
            return _aborting_handler(
                handler, grpc.StatusCode.PERMISSION_DENIED, "invalid bearer token"
            )
        return handler


class _TokenMetadata:
    """Adds the bearer token to a call's metadata (aio channels)."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(*self._header)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# grpc.aio files each interceptor under the first call kind it implements, so each kind needs
# its own object.
class _UnaryUnaryToken(_TokenMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _UnaryStreamToken(_TokenMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _StreamUnaryToken(_TokenMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _StreamStreamToken(_TokenMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def aio_token_interceptors(token: str | None) -> list[Any]:
    """Client interceptors adding the bearer token to every kind of call (none without one)."""
    if not token:
        return []
    kinds = (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken, _StreamStreamToken)
    return [kind(token) for kind in kinds]


class _SyncCallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class _SyncTokenMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the bearer token to every call of a blocking channel."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _SyncCallDetails(details, [*(details.metadata or ()), self._header])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def with_sync_token(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """``channel`` adding the bearer token to every call (unchanged without a token)."""
    return grpc.intercept_channel(channel, _SyncTokenMetadata(token)) if token else channel
