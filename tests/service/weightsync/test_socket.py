"""SOCKET: the side channel's failure rules on a real rollout server (HFEngine +
WeightSyncService on loopback), driven by a plain client that speaks the contract and the
documented frame format. Every refused transfer leaves the old weights serving and the
server up; the next transfer succeeds."""

from __future__ import annotations

import socket
import ssl
import struct
import threading
from collections.abc import Callable

import grpc
import pytest
import torch
from arealgrpc.v1 import tensor_pb2
from arealgrpc.v1 import weight_sync_pb2 as pb

from areal_grpc import side_channel
from areal_grpc import tensor_codec as tc
from areal_grpc.security import ClientTls, ServerTls
from tests.support.weightsync import MakeRollout, Rollout, shifted, tensor_digest

TIMEOUT = 30.0


def negotiate(r: Rollout, tls: bool = False) -> pb.NegotiateResponse:
    offer = pb.TransferOption(
        method=pb.TRANSFER_METHOD_SOCKET, socket=pb.SocketParams(max_frame_bytes=4096, tls=tls)
    )
    plan = r.sync.Negotiate(pb.NegotiateRequest(offers=[offer]), timeout=TIMEOUT)
    assert plan.plan.method == pb.TRANSFER_METHOD_SOCKET
    assert plan.plan.socket.port > 0 and len(plan.plan.socket.token) == side_channel.TOKEN_BYTES
    assert plan.plan.socket.max_frame_bytes == 4096
    return plan


def update(
    r: Rollout,
    plan: pb.NegotiateResponse,
    sd: dict[str, torch.Tensor],
    version: int,
    sender: Callable[[socket.socket], None] | None,
    timeout: float = TIMEOUT,
    tls: ssl.SSLContext | None = None,
) -> pb.UpdateFromSocketResponse:
    """UpdateFromSocket, with ``sender`` writing the connection meanwhile (None: no one
    connects), inside TLS with ``tls``."""
    request = pb.UpdateFromSocketRequest(
        plan_id=plan.plan_id,
        policy_version=version,
        tensors=[tc.tensor_spec(name, t) for name, t in sd.items()],
    )
    errors: list[BaseException] = []

    def send() -> None:
        assert sender is not None
        try:
            port = plan.plan.socket.port
            with side_channel.connect("127.0.0.1", port, 10, tls) as s:
                sender(s)
                s.shutdown(socket.SHUT_WR)
                s.recv(1)  # until the receiver is done with the connection
        except OSError as exc:  # e.g. the receiver refusing a handshake
            errors.append(exc)

    thread = threading.Thread(target=send) if sender is not None else None
    if thread is not None:
        thread.start()
    try:
        return r.sync.UpdateFromSocket(request, timeout=timeout)
    finally:
        if thread is not None:
            thread.join(timeout=30)


def honest(plan: pb.NegotiateResponse, sd: dict[str, torch.Tensor], version: int):
    def sender(s: socket.socket) -> None:
        side_channel.send_preamble(s, plan.plan.socket.token, version)
        for i, t in enumerate(sd.values()):
            side_channel.send_tensor(s, i, t, plan.plan.socket.max_frame_bytes)
        side_channel.send_end(s)

    return sender


def corrupting(
    plan: pb.NegotiateResponse, sd: dict[str, torch.Tensor], version: int, tensor: int, byte: int
):
    """A sender that flips ``byte`` of ``tensor``'s first frame after its CRC was taken."""

    def sender(s: socket.socket) -> None:
        side_channel.send_preamble(s, plan.plan.socket.token, version)
        for i, t in enumerate(sd.values()):
            for k, (header, payload) in enumerate(side_channel.frames_of(i, t, 4096)):
                data = bytearray(payload)
                if i == tensor and k == 0:
                    data[byte] ^= 0xFF
                s.sendall(header)
                s.sendall(data)
        side_channel.send_end(s)

    return sender


def expect(fn: Callable[[], object], code: grpc.StatusCode, words: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    assert err.value.code() == code, err.value.details()
    assert words in (err.value.details() or ""), err.value.details()


def test_socket_update_lands_bit_exact_and_refusals_leave_the_old_weights(
    make_rollout: MakeRollout,
) -> None:
    r = make_rollout()
    before = r.digests()
    sd = shifted(r, 0.5)

    # A wrong token: PERMISSION_DENIED before a byte lands.
    plan = negotiate(r)

    def wrong_token(s: socket.socket) -> None:
        side_channel.send_preamble(s, b"x" * side_channel.TOKEN_BYTES, 1)
        for i, t in enumerate(sd.values()):
            side_channel.send_tensor(s, i, t, 4096)
        side_channel.send_end(s)

    expect(lambda: update(r, plan, sd, 1, wrong_token), grpc.StatusCode.PERMISSION_DENIED, "token")
    assert r.digests() == before and r.version() == 0
    # The plan's connection is spent: the same plan again (a replay) is refused.
    expect(
        lambda: update(r, plan, sd, 1, honest(plan, sd, 1)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "negotiate again",
    )

    # A corrupt frame: one payload byte flipped after its CRC was taken.
    plan = negotiate(r)
    corrupt = corrupting(plan, sd, 1, tensor=2, byte=0)
    expect(lambda: update(r, plan, sd, 1, corrupt), grpc.StatusCode.DATA_LOSS, "CRC-32C")
    assert r.digests() == before

    # A sender that vanishes halfway.
    plan = negotiate(r)

    def vanish(s: socket.socket) -> None:
        side_channel.send_preamble(s, plan.plan.socket.token, 1)
        for i, t in enumerate(list(sd.values())[:3]):
            side_channel.send_tensor(s, i, t, 4096)
        s.sendall(struct.pack("<IQII", 3, 0, 4096, 0) + b"\0" * 100)

    expect(lambda: update(r, plan, sd, 1, vanish), grpc.StatusCode.DATA_LOSS, "short")
    assert r.digests() == before

    # Another version on the connection than the call announced.
    plan = negotiate(r)
    expect(
        lambda: update(r, plan, sd, 1, honest(plan, sd, 2)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "version 2",
    )
    # No connection at all: the call's deadline, not a hang.
    plan = negotiate(r)
    expect(
        lambda: update(r, plan, sd, 1, None, timeout=2.0),
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "",
    )
    assert r.digests() == before and r.version() == 0

    # A bad announcement is INVALID_ARGUMENT naming the field (nothing listened for).
    plan = negotiate(r)
    bad = pb.UpdateFromSocketRequest(
        plan_id=plan.plan_id,
        policy_version=1,
        tensors=[tensor_pb2.TensorSpec(name="", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[1])],
    )
    expect(
        lambda: r.sync.UpdateFromSocket(bad, timeout=TIMEOUT),
        grpc.StatusCode.INVALID_ARGUMENT,
        "tensors[0].name",
    )

    # After all that, an honest transfer lands bit-exact.
    plan = negotiate(r)
    reply = update(r, plan, sd, 1, honest(plan, sd, 1))
    assert reply.policy_version == 1 == r.version()
    assert reply.tensor_count == len(sd)
    assert reply.received_bytes == sum(t.numel() * t.element_size() for t in sd.values())
    served = r.digests()
    assert all(served[k] == tensor_digest(v) for k, v in sd.items())


def test_socket_is_not_offered_without_a_listen_host(make_rollout: MakeRollout) -> None:
    """A server with no socket host (an embedding that opens no side channel) declines
    SOCKET and takes the next offer."""
    r = make_rollout(socket_host=None)
    offers = [
        pb.TransferOption(method=pb.TRANSFER_METHOD_SOCKET),
        pb.TransferOption(method=pb.TRANSFER_METHOD_STREAM),
    ]
    plan = r.sync.Negotiate(pb.NegotiateRequest(offers=offers), timeout=TIMEOUT)
    assert plan.plan.method == pb.TRANSFER_METHOD_STREAM


def test_a_tls_server_speaks_tls_on_the_side_channel_and_refuses_every_other_peer(
    make_rollout: MakeRollout, pki: dict[str, str]
) -> None:
    r = make_rollout(socket_tls=ServerTls(pki["server_cert"], pki["server_key"], pki["ca"]))
    before = r.digests()
    sd = shifted(r, 0.5)

    # A plaintext offer is declined: the sender falls back to its next method.
    offers = [
        pb.TransferOption(method=pb.TRANSFER_METHOD_SOCKET),
        pb.TransferOption(method=pb.TRANSFER_METHOD_STREAM),
    ]
    plan = r.sync.Negotiate(pb.NegotiateRequest(offers=offers), timeout=TIMEOUT)
    assert plan.plan.method == pb.TRANSFER_METHOD_STREAM
    expect(
        lambda: r.sync.Negotiate(pb.NegotiateRequest(offers=offers[:1]), timeout=TIMEOUT),
        grpc.StatusCode.FAILED_PRECONDITION,
        "this server's side channel is TLS; the offer is plaintext",
    )

    def client(ca: str, who: str | None) -> ssl.SSLContext:
        cert = (pki[f"{who}_cert"], pki[f"{who}_key"]) if who else (None, None)
        return ClientTls(pki[ca], *cert).ssl_context()

    # Peers that fail the handshake: PERMISSION_DENIED naming it, before a byte lands.
    for tls in (
        None,  # plaintext on a TLS plan
        client("ca", None),  # no client certificate (the server asks for one)
        client("ca", "stranger"),  # a certificate from another CA
    ):
        plan = negotiate(r, tls=True)
        assert plan.plan.socket.tls
        expect(
            lambda plan=plan, tls=tls: update(r, plan, sd, 1, honest(plan, sd, 1), tls=tls),
            grpc.StatusCode.PERMISSION_DENIED,
            "TLS handshake",
        )
        assert r.digests() == before and r.version() == 0

    # A sender that does not trust the server's certificate never sends: the receiver's
    # handshake fails too, and the old weights serve.
    plan = negotiate(r, tls=True)
    expect(
        lambda: update(r, plan, sd, 1, honest(plan, sd, 1), tls=client("stranger_ca", "client")),
        grpc.StatusCode.PERMISSION_DENIED,
        "TLS handshake",
    )
    assert r.digests() == before

    # Inside TLS, the token and the frames are checked as on plaintext.
    plan = negotiate(r, tls=True)
    tls = client("ca", "client")
    corrupt = corrupting(plan, sd, 1, tensor=1, byte=-1)
    expect(lambda: update(r, plan, sd, 1, corrupt, tls=tls), grpc.StatusCode.DATA_LOSS, "CRC")
    assert r.digests() == before

    # A sender that vanishes halfway (no TLS close either).
    plan = negotiate(r, tls=True)

    def vanish(s: socket.socket) -> None:
        side_channel.send_preamble(s, plan.plan.socket.token, 1)
        side_channel.send_tensor(s, 0, next(iter(sd.values())), 4096)

    expect(lambda: update(r, plan, sd, 1, vanish, tls=tls), grpc.StatusCode.DATA_LOSS, "short")
    assert r.digests() == before and r.version() == 0

    plan = negotiate(r, tls=True)
    reply = update(r, plan, sd, 1, honest(plan, sd, 1), tls=tls)
    assert reply.policy_version == 1 == r.version()
    assert reply.received_bytes == sum(t.numel() * t.element_size() for t in sd.values())
    served = r.digests()
    assert all(served[k] == tensor_digest(v) for k, v in sd.items())
