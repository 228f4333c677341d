"""The gateway's HTTP surface on FastAPI: the OpenAI routes (``openai_routes``) and the RL
session routes (``rl_routes``) over one :class:`~.state.Gateway`. See the package docstring for
the endpoints.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from areal_grpc.config import RunConfig
from areal_grpc.errors import FieldError, PreconditionError

from . import openai_routes, rl_routes
from .openapi import with_model_limits
from .sessions import SessionGone
from .state import SESSION_HEADER, Gateway, HTTPError

__all__ = ["create_app"]


def create_app(run: RunConfig, coordinator: str, api_key: str | None = None) -> FastAPI:
    """The gateway of ``run`` (see :class:`Gateway`) as a FastAPI application (serve it with
    uvicorn)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Made on the server's event loop: gRPC aio channels belong to the loop they start on.
        gateway = Gateway(run, coordinator, api_key)
        gateway.start()
        app.state.gateway = gateway
        try:
            yield
        finally:
            await gateway.close()

    app = FastAPI(title="areal-grpc gateway", lifespan=lifespan)

    @app.exception_handler(HTTPError)
    async def _http_error(_: Request, exc: HTTPError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(FieldError)
    async def _field_error(_: Request, exc: FieldError) -> JSONResponse:
        return HTTPError(400, str(exc), param=exc.field).response()

    @app.exception_handler(SessionGone)
    async def _gone(_: Request, exc: SessionGone) -> JSONResponse:
        return HTTPError(409, str(exc), param=SESSION_HEADER, code="session_expired").response()

    @app.exception_handler(PreconditionError)
    async def _precondition(_: Request, exc: PreconditionError) -> JSONResponse:
        return HTTPError(409, str(exc), param=getattr(exc, "field", None)).response()

    app.include_router(openai_routes.router)
    app.include_router(rl_routes.router)
    plain = app.openapi

    def openapi() -> dict[str, Any]:
        # The served model's limits are known once the gateway (its tokenizer) is up; a copy,
        # since FastAPI's document shares dicts with the routes' constant body schemas.
        doc = plain()
        gateway: Gateway | None = getattr(app.state, "gateway", None)
        if gateway is None:
            return doc
        return with_model_limits(copy.deepcopy(doc), gateway.vocab_size, gateway.context)

    app.openapi = openapi  # type: ignore[method-assign]
    return app
