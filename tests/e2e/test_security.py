"""The coordinator's entry point as a process, serving TLS with a bearer token (TLS, tokens
and the plaintext rules in this process: tests/service/test_security.py)."""

from __future__ import annotations

from grpc_health.v1 import health_pb2, health_pb2_grpc

from areal_grpc.launch import health_status, python_module_argv, start_child, stop_children
from areal_grpc.security import ClientTls
from areal_grpc.server import (
    ChannelOptions,
    sync_channel,
)


def test_entry_point_serves_tls_with_token(pki, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("tok-123\n")
    child = start_child(
        "coordinator",
        python_module_argv(
            "areal_grpc.coordinator.serve",
            "--port",
            "0",
            "--tls-cert",
            pki["server_cert"],
            "--tls-key",
            pki["server_key"],
            "--auth-token-file",
            str(token_file),
        ),
        log_dir=tmp_path,
    )
    try:
        assert health_status(child.address) == "UNREACHABLE"  # plaintext probe fails
        opts = ChannelOptions(tls=ClientTls(pki["ca"], server_name="localhost"))
        with sync_channel(child.address, opts) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        assert stop_children([child])["coordinator"] == 0
