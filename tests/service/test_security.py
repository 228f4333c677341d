"""TLS, mutual TLS, bearer-token auth, plaintext binding rules, and no unpickling anywhere
(an entry point's process serving TLS: tests/e2e/test_security.py)."""

from __future__ import annotations

import ast

import grpc
import pytest
from arealgrpc.v1 import rollout_pb2, rollout_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from areal_grpc.cli import base_parser, channel_options_from_args, plaintext_weights_warning
from areal_grpc.config import WEIGHT_SYNC_METHODS, SecurityConfig
from areal_grpc.security import ClientTls, ServerTls, is_loopback
from areal_grpc.server import (
    BackgroundServer,
    ChannelOptions,
    ServerOptions,
    aio_channel,
    default_channel_options,
    service,
    set_default_channel_options,
    start_server,
    sync_channel,
)
from tests.support.paths import ROOT


class Echo(rollout_pb2_grpc.RolloutServiceServicer):
    async def Generate(self, request, context):
        return rollout_pb2.GenerateResponse(policy_version=len(request.input_ids))

    async def GenerateStream(self, request, context):
        yield rollout_pb2.GenerateStreamResponse(output_ids=list(request.input_ids))


def echo_service():
    return service(Echo(), rollout_pb2_grpc.add_RolloutServiceServicer_to_server, rollout_pb2)


def call(address, opts=None, payload=(1, 2, 3)):
    with sync_channel(address, opts) as ch:
        return rollout_pb2_grpc.RolloutServiceStub(ch).Generate(
            rollout_pb2.GenerateRequest(input_ids=list(payload)), timeout=10
        )


def test_tls_server_talks_to_verifying_clients_only(pki):
    tls = ServerTls(pki["server_cert"], pki["server_key"])
    with BackgroundServer([echo_service()], ServerOptions(tls=tls)) as server:
        ok = call(server.address, ChannelOptions(tls=ClientTls(pki["ca"], server_name="localhost")))
        assert ok.policy_version == 3
        with pytest.raises(grpc.RpcError) as err:
            call(server.address)  # plaintext client
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate_from_the_ca(pki):
    tls = ServerTls(pki["server_cert"], pki["server_key"], client_ca_file=pki["ca"])
    with BackgroundServer([echo_service()], ServerOptions(tls=tls)) as server:
        good = ClientTls(pki["ca"], pki["client_cert"], pki["client_key"], "localhost")
        assert call(server.address, ChannelOptions(tls=good)).policy_version == 3
        for bad in (
            ClientTls(pki["ca"], server_name="localhost"),
            ClientTls(pki["ca"], pki["stranger_cert"], pki["stranger_key"], "localhost"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call(server.address, ChannelOptions(tls=bad))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_bearer_token_missing_wrong_and_right():
    with BackgroundServer([echo_service()], ServerOptions(auth_token="s3cret")) as server:
        with pytest.raises(grpc.RpcError) as err:
            call(server.address)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            call(server.address, ChannelOptions(auth_token="s3cre"))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert call(server.address, ChannelOptions(auth_token="s3cret")).policy_version == 3
        # Streaming methods are guarded too.
        with sync_channel(server.address) as ch, pytest.raises(grpc.RpcError) as err:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            list(stub.GenerateStream(rollout_pb2.GenerateStreamRequest(input_ids=[1]), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health stays open for probes.
        with sync_channel(server.address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_aio_channel_sends_the_token():
    import asyncio

    async def body():
        running = await start_server([echo_service()], ServerOptions(auth_token="tok"))
        try:
            async with aio_channel(running.address, ChannelOptions(auth_token="tok")) as ch:
                stub = rollout_pb2_grpc.RolloutServiceStub(ch)
                reply = await stub.Generate(rollout_pb2.GenerateRequest(input_ids=[4, 5]))
                assert reply.policy_version == 2
                got = [
                    m
                    async for m in stub.GenerateStream(
                        rollout_pb2.GenerateStreamRequest(input_ids=[7])
                    )
                ]
                assert list(got[0].output_ids) == [7]
        finally:
            await running.stop(0)

    asyncio.run(body())


def test_plaintext_is_loopback_only_unless_allowed():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    import asyncio

    with pytest.raises(ValueError, match="plaintext"):
        asyncio.run(start_server([echo_service()], ServerOptions(host="0.0.0.0")))


def _unsafe_loads(source: str) -> list[int]:
    """Lines of calls that would run code from bytes: pickle-family loads, torch.load without
    ``weights_only=True``, numpy's ``allow_pickle=True``. Calls only: docstrings may name them."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        kwargs = {k.arg: k.value for k in node.keywords}
        allow = kwargs.get("allow_pickle")
        if isinstance(allow, ast.Constant) and allow.value is True:
            bad.append(node.lineno)
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
            continue
        owner, name = func.value.id, func.attr
        if owner in ("pickle", "cloudpickle", "dill", "marshal") and name in ("load", "loads"):
            bad.append(node.lineno)
        if owner == "torch" and name == "load":
            safe = kwargs.get("weights_only")
            if not (isinstance(safe, ast.Constant) and safe.value is True):
                bad.append(node.lineno)
    return bad


def test_no_unpickling_or_torch_load_of_received_bytes_in_our_source():
    offenders = []
    for top in ("areal_grpc", "servers", "clients"):
        for path in (ROOT / top).rglob("*.py"):
            for n in _unsafe_loads(path.read_text()):
                offenders.append(f"{path.relative_to(ROOT)}:{n}")
    assert offenders == []
    # The check itself must be able to fail.
    assert _unsafe_loads("x = pickle.loads(data)") == [1]
    assert _unsafe_loads("torch.load(buf)\ntorch.load(buf, weights_only=False)") == [1, 2]
    assert _unsafe_loads("np.load(f, allow_pickle=True)") == [1]
    assert _unsafe_loads("torch.load(buf, weights_only=True)") == []


def test_the_process_default_channel_options_carry_tls_and_token(pki):
    """Channels built without options use the process default; explicit options still win."""
    import asyncio

    tls = ServerTls(pki["server_cert"], pki["server_key"], client_ca_file=pki["ca"])
    good = ChannelOptions(
        tls=ClientTls(pki["ca"], pki["client_cert"], pki["client_key"], "localhost"),
        auth_token="tok",
    )
    with BackgroundServer([echo_service()], ServerOptions(tls=tls, auth_token="tok")) as server:
        previous = set_default_channel_options(good)
        try:
            assert call(server.address).policy_version == 3

            async def aio_call() -> int:
                async with aio_channel(server.address) as ch:
                    stub = rollout_pb2_grpc.RolloutServiceStub(ch)
                    reply = await stub.Generate(rollout_pb2.GenerateRequest(input_ids=[1, 2]))
                    return reply.policy_version

            assert asyncio.run(aio_call()) == 2
            # A copy with extra channel arguments keeps the credentials.
            extra = default_channel_options(extra=[("grpc.http2.bdp_probe", 0)])
            assert call(server.address, extra).policy_version == 3
            with pytest.raises(grpc.RpcError) as err:
                call(server.address, ChannelOptions())  # explicit plaintext wins
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            set_default_channel_options(previous)
        with pytest.raises(grpc.RpcError) as err:
            call(server.address)  # the default is plaintext again
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_flags_give_the_channel_options(pki, tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("t0k\n")
    parser = base_parser("x", "test", 0)
    args = parser.parse_args(
        [
            "--tls-ca",
            pki["ca"],
            "--tls-client-cert",
            pki["client_cert"],
            "--tls-client-key",
            pki["client_key"],
            "--auth-token-file",
            str(token),
        ]
    )
    opts = channel_options_from_args(args)
    assert opts.tls == ClientTls(pki["ca"], pki["client_cert"], pki["client_key"])
    assert opts.auth_token == "t0k"
    monkeypatch.setenv("AREAL_AUTH_TOKEN", "from-env")
    assert channel_options_from_args(parser.parse_args([])).auth_token == "from-env"
    assert channel_options_from_args(parser.parse_args([])).tls is None
    with pytest.raises(SystemExit, match="go together"):
        channel_options_from_args(parser.parse_args(["--tls-client-cert", pki["client_cert"]]))
    with pytest.raises(SystemExit, match="needs --tls-ca"):
        channel_options_from_args(
            parser.parse_args(
                ["--tls-client-cert", pki["client_cert"], "--tls-client-key", pki["client_key"]]
            )
        )


def test_a_tls_run_whose_weights_may_take_distributed_is_told_they_go_in_the_clear() -> None:
    tls = SecurityConfig(tls_cert="node.pem", tls_key="node.key", tls_ca="ca.pem")
    warning = plaintext_weights_warning(tls, WEIGHT_SYNC_METHODS)
    assert warning is not None and "list weight_sync.methods without distributed" in warning
    # Methods that stay on the host or inside TLS, or a plaintext run: nothing to say.
    assert plaintext_weights_warning(tls, ("shared_memory", "socket", "stream", "disk")) is None
    assert plaintext_weights_warning(SecurityConfig(), WEIGHT_SYNC_METHODS) is None
