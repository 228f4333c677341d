"""Errors that map onto gRPC status codes with ``google.rpc`` details.

Validation code raises :class:`FieldError` (a ``ValueError``) naming the offending field; a
handler turns it into ``INVALID_ARGUMENT`` with a ``google.rpc.BadRequest`` detail through
:func:`abort_with`. Clients read the detail back with :func:`field_violations`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Iterable
from typing import NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from areal_grpc.durations import duration, seconds

log = logging.getLogger(__name__)


class FieldError(ValueError):
    """Bad input: ``field`` is a dotted path to the offending field (e.g. ``tensor[w].data``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.description = message


class PreconditionError(RuntimeError):
    """A request that is well formed but conflicts with state (e.g. a stale policy version)."""


class UnavailableError(RuntimeError):
    """A passing failure the caller may retry (e.g. a rank group that broke): UNAVAILABLE."""


class AbortedError(RuntimeError):
    """Work interrupted by a concurrent event (e.g. a step stopped by a recovery): ABORTED."""


class DataLossError(RuntimeError):
    """Bytes that arrived corrupt or incomplete (a checksum mismatch, a cut connection)."""


class DeniedError(RuntimeError):
    """A caller that presented a wrong or used credential: PERMISSION_DENIED."""


class DeadlineError(RuntimeError):
    """Something awaited did not arrive in time: DEADLINE_EXCEEDED."""


class NotFoundError(LookupError):
    """A request names something the server does not hold (``field`` names where): NOT_FOUND."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ExhaustedError(RuntimeError):
    """A cap is reached; the caller may retry after ``retry_after_s`` (once something is
    freed): RESOURCE_EXHAUSTED with ``google.rpc.RetryInfo``."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def _status(code: grpc.StatusCode, message: str, details: Iterable[object] = ()) -> grpc.Status:
    packed = []
    for detail in details:
        any_detail = any_pb2.Any()
        any_detail.Pack(detail)  # type: ignore[arg-type]
        packed.append(any_detail)
    proto = status_pb2.Status(code=code.value[0], message=message, details=packed)
    return rpc_status.to_status(proto)


def invalid_argument(errors: FieldError | Iterable[FieldError]) -> grpc.Status:
    """INVALID_ARGUMENT with one ``BadRequest.FieldViolation`` per error."""
    errs = [errors] if isinstance(errors, FieldError) else list(errors)
    bad = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=e.field, description=e.description)
            for e in errs
        ]
    )
    return _status(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(str(e) for e in errs), [bad])


def resource_exhausted(message: str, retry_after_s: float) -> grpc.Status:
    """RESOURCE_EXHAUSTED with ``google.rpc.RetryInfo`` telling the caller when to retry."""
    return _status(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        message,
        [error_details_pb2.RetryInfo(retry_delay=duration(retry_after_s))],
    )


def status(code: grpc.StatusCode, message: str) -> grpc.Status:
    """A plain status with no details."""
    return _status(code, message)


async def abort_with(context: grpc.aio.ServicerContext, st: grpc.Status) -> NoReturn:
    """Ends the RPC with ``st`` (code, message and rich details); never returns."""
    await context.abort_with_status(st)
    # grpc's abort raises; this line keeps the NoReturn promise should it ever not.
    raise RuntimeError("context.abort_with_status returned")


def status_for_exception(exc: BaseException) -> grpc.Status:
    """The status every handler answers for an exception: the one place this is decided.

    File-system errors are the fault of the request's ``path``, except a missing file
    (NOT_FOUND); anything not named here is INTERNAL.
    """
    if isinstance(exc, FieldError):
        return invalid_argument(exc)
    if isinstance(exc, PreconditionError):
        return status(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    if isinstance(exc, UnavailableError):
        return status(grpc.StatusCode.UNAVAILABLE, str(exc))
    if isinstance(exc, AbortedError):
        return status(grpc.StatusCode.ABORTED, str(exc))
    if isinstance(exc, DataLossError):
        return status(grpc.StatusCode.DATA_LOSS, str(exc))
    if isinstance(exc, DeniedError):
        return status(grpc.StatusCode.PERMISSION_DENIED, str(exc))
    if isinstance(exc, DeadlineError):
        return status(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
    if isinstance(exc, NotFoundError):
        return status(grpc.StatusCode.NOT_FOUND, str(exc))
    if isinstance(exc, ExhaustedError):
        return resource_exhausted(str(exc), exc.retry_after_s)
    if isinstance(exc, NotImplementedError):
        return status(grpc.StatusCode.UNIMPLEMENTED, str(exc) or "not implemented")
    if isinstance(exc, ValueError):
        return status(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, FileNotFoundError):
        return status(grpc.StatusCode.NOT_FOUND, str(exc))
    if isinstance(exc, (NotADirectoryError, IsADirectoryError, PermissionError)) or (
        isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG
    ):
        return status(grpc.StatusCode.INVALID_ARGUMENT, f"path: {exc}")
    return status(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
"""Codes that refuse the request itself: asking again gets the same answer."""
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def code_of(st: status_pb2.Status) -> grpc.StatusCode:
    """The ``grpc.StatusCode`` of a ``google.rpc.Status`` (UNKNOWN for a code gRPC lacks)."""
    return _CODES.get(st.code, grpc.StatusCode.UNKNOWN)


def describe(st: status_pb2.Status) -> str:
    """``CODE: message``, how a failure reads in logs and per-target reports."""
    return f"{code_of(st).name}: {st.message}"


def explain(exc: BaseException) -> str:
    """A one-line account of an exception (a failed call: ``CODE: details``), for logs."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"[:300]
    return f"{type(exc).__name__}: {exc}"[:300]


def status_proto(code: grpc.StatusCode, message: str) -> status_pb2.Status:
    """A ``google.rpc.Status`` with no details."""
    return status_pb2.Status(code=code.value[0], message=message)


def status_proto_of(exc: BaseException, prefix: str = "") -> status_pb2.Status:
    """A failed call or operation as a ``google.rpc.Status`` (message prefixed by ``prefix``).

    An RPC error keeps the peer's code and its error details; a timeout is DEADLINE_EXCEEDED;
    anything else gets the code :func:`status_for_exception` gives it.
    """
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        rich = None
        # Details that disagree with the call's code (ValueError): keep the code alone.
        with contextlib.suppress(ValueError):
            rich = rpc_status.from_call(exc)  # type: ignore[arg-type]
        out = rich or status_proto(exc.code(), exc.details() or "")
    elif isinstance(exc, TimeoutError):
        out = status_proto(grpc.StatusCode.DEADLINE_EXCEEDED, f"timed out {exc}".rstrip())
    else:
        st = status_for_exception(exc)
        out = status_proto(st.code, st.details)
    if prefix:
        out.message = f"{prefix}{out.message}"
    return out


async def abort_for(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """Ends the RPC with :func:`status_for_exception`; an INTERNAL one (a bug) is logged."""
    st = status_for_exception(exc)
    if st.code == grpc.StatusCode.INTERNAL:
        log.error("request failed", exc_info=exc)
    await abort_with(context, st)


def field_violations(error: grpc.RpcError) -> list[tuple[str, str]]:
    """(field, description) pairs from an error's ``BadRequest`` details; [] when none."""
    proto = rpc_status.from_call(error)  # type: ignore[arg-type]
    if proto is None:
        return []
    out: list[tuple[str, str]] = []
    for detail in proto.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out += [(v.field, v.description) for v in bad.field_violations]
    return out


def retry_delay_s(error: grpc.RpcError) -> float | None:
    """Seconds the server asks the caller to wait (``RetryInfo``); None when it says nothing."""
    proto = rpc_status.from_call(error)  # type: ignore[arg-type]
    if proto is None:
        return None
    for detail in proto.details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            return seconds(retry.retry_delay)
    return None


__all__ = [
    "REFUSALS",
    "AbortedError",
    "DataLossError",
    "DeadlineError",
    "DeniedError",
    "ExhaustedError",
    "FieldError",
    "NotFoundError",
    "PreconditionError",
    "UnavailableError",
    "abort_for",
    "abort_with",
    "code_of",
    "describe",
    "explain",
    "field_violations",
    "invalid_argument",
    "resource_exhausted",
    "retry_delay_s",
    "status",
    "status_for_exception",
    "status_proto",
    "status_proto_of",
]
