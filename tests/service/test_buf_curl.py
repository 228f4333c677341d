"""`buf curl` (the buf binary from buf-bin) talks to our servers through server reflection."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from arealgrpc.v1 import coordinator_pb2, coordinator_pb2_grpc

from areal_grpc.server import BackgroundServer, service


def buf_binary() -> str:
    found = shutil.which("buf") or str(Path(sys.executable).with_name("buf"))
    if not Path(found).exists():
        pytest.fail("buf binary not found: install the dev extra (buf-bin)")
    return found


@pytest.fixture(scope="module")
def server():
    svc = service(
        coordinator_pb2_grpc.CoordinatorServiceServicer(),
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server,
        coordinator_pb2,
    )
    with BackgroundServer([svc]) as running:
        yield running


def buf_curl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [buf_binary(), "curl", "--protocol", "grpc", "--http2-prior-knowledge", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_buf_curl_lists_services_through_reflection(server):
    out = buf_curl("--list-services", f"http://{server.address}")
    assert out.returncode == 0, out.stderr
    services = set(out.stdout.split())
    assert {"arealgrpc.v1.CoordinatorService", "grpc.health.v1.Health"} <= services


def test_buf_curl_lists_methods_of_our_service(server):
    out = buf_curl("--list-methods", f"http://{server.address}")
    assert out.returncode == 0, out.stderr
    methods = set(out.stdout.split())
    assert "arealgrpc.v1.CoordinatorService/AcquireRollout" in methods
    assert "grpc.health.v1.Health/Check" in methods


def test_buf_curl_calls_the_health_check(server):
    out = buf_curl(
        "-d",
        '{"service": "arealgrpc.v1.CoordinatorService"}',
        f"http://{server.address}/grpc.health.v1.Health/Check",
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"status": "SERVING"}
