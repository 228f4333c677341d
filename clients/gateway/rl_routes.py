"""The gateway's RL session routes: ``POST /rl/sessions`` takes a coordinator lease,
``POST /rl/sessions/{id}/reward`` submits the session's conversations as one trajectory group,
``DELETE /rl/sessions/{id}`` releases the lease."""

from __future__ import annotations

from typing import Any

import grpc
from fastapi import APIRouter, Request

from areal_grpc.errors import FieldError

from .openapi import (
    RELEASE_OK,
    REWARD_BODY,
    REWARD_OK,
    SESSION_BODY,
    SESSION_OK,
    errors,
    request_body,
)
from .sessions import Session
from .state import PRODUCER_ID, from_rpc, gateway_of, int_field, json_body

router = APIRouter()


@router.post(
    "/rl/sessions",
    openapi_extra=request_body(SESSION_BODY, required=False),
    responses=SESSION_OK | errors(400, 401, 403, 429, 503),
)
async def open_session(request: Request) -> Any:
    body = await json_body(request) if await request.body() else {}
    gw = gateway_of(request)
    group_size = int_field(body, "group_size", 1, 1, 1 << 16)
    metadata = body.get("metadata")
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
        raise FieldError("metadata", "must be an object")
    try:
        lease = await gw.coordinator.acquire(PRODUCER_ID, group_size, timeout_s=30.0)
    except grpc.RpcError as exc:
        raise from_rpc(exc, "coordinator") from exc
    session = Session(lease, metadata)
    gw.sessions.add(session)
    return {
        "session_id": session.session_id,
        "policy_version": int(lease.policy_version),
        "expires_at": session.expires_at,
        # Renewed while the session works: it expires this long after its last
        # completion ended.
        "lease_ttl_s": round(session.ttl_s, 3),
        "group_size": int(lease.group_size),
    }


@router.post(
    "/rl/sessions/{session_id}/reward",
    openapi_extra=request_body(REWARD_BODY),
    responses=REWARD_OK | errors(400, 401, 403, 404, 409, 503),
)
async def reward(session_id: str, request: Request) -> Any:
    body = await json_body(request)
    gw = gateway_of(request)
    session = gw.session(session_id)
    group = session.group(body)
    # A lease about to run out would expire on its way to the coordinator.
    await gw.keep_alive(session)
    # Ended before the submission awaits: later completions of it are 404 (as is this
    # call when another one ended it meanwhile).
    gw.session(session_id)
    gw.sessions.pop(session_id)
    try:
        reply = await gw.coordinator.submit([(session_id, group)])
    except grpc.RpcError as exc:
        raise from_rpc(exc, "coordinator") from exc
    reasons = [r.reason for r in reply.rejections]
    return {
        "submitted": True,
        "accepted": reply.accepted_groups == 1,
        "reason": "; ".join(reasons),
        "trajectories": len(group.trajectories),
    }


@router.delete("/rl/sessions/{session_id}", responses=RELEASE_OK | errors(401, 403, 404, 409, 503))
async def release(session_id: str, request: Request) -> Any:
    gw = gateway_of(request)
    gw.check_auth(request)
    gw.session(session_id)
    gw.sessions.pop(session_id)
    try:
        await gw.coordinator.release(session_id)
    except grpc.RpcError as exc:
        raise from_rpc(exc, "coordinator") from exc
    return {"released": True}
