"""The servers' entry points as processes: serving and draining on SIGTERM, the main command
bringing a mesh up and down, keepalive pings failing a call to a frozen peer (the scaffolding
in this process: tests/service/test_server.py)."""

from __future__ import annotations

import json
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from areal_grpc.launch import health_status, python_module_argv, start_child, stop_children
from areal_grpc.server import (
    ChannelOptions,
    sync_channel,
)


def test_entry_point_serves_and_drains_on_sigterm(tmp_path):
    child = start_child(
        "coordinator",
        python_module_argv("areal_grpc.coordinator.serve", "--port", "0"),
        log_dir=tmp_path,
    )
    try:
        assert health_status(child.address, "arealgrpc.v1.CoordinatorService") == "SERVING"
        child.process.send_signal(signal.SIGTERM)
        assert child.process.wait(timeout=30) == 0
        assert "draining" in (tmp_path / "coordinator.log").read_text()
    finally:
        stop_children([child])


def test_main_command_brings_the_mesh_up_and_down(tmp_path, coordinator_command):
    # A two-step run of the real command on the local mesh (the full default run takes
    # minutes; tests/e2e/coordinator/ covers the loop in depth).
    code, log = coordinator_command.run(tmp_path, *coordinator_command.SMALL_RUN, "total_steps=2")
    assert code == 0, log
    assert "COORDINATOR 127.0.0.1:" in log
    assert "done: 2 steps, version 2" in log
    assert "mesh stopped cleanly" in log
    mesh = json.loads((tmp_path / "mesh.json").read_text())
    assert [c["name"] for c in mesh["children"]] == ["rollout-0", "trainer-0", "trainer-1"]


def test_a_frozen_peer_fails_an_open_call_once_a_keepalive_ping_goes_unanswered(tmp_path):
    """A peer that stops answering (SIGSTOP: its kernel still takes the bytes) fails a call in
    flight UNAVAILABLE after keepalive_time_s + keepalive_timeout_s, not at the call's deadline
    (gRPC's core gives every ping 60 s unless told otherwise: a frozen rollout server held a
    weight update for 70 s)."""
    child = start_child(
        "coordinator",
        python_module_argv("areal_grpc.coordinator.serve", "--port", "0"),
        log_dir=tmp_path,
    )
    try:
        opts = ChannelOptions(keepalive_time_s=1.0, keepalive_timeout_s=1.0)
        with sync_channel(child.address, opts) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            # A stream that stays open (Watch is not retried, unlike Check).
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=40)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            child.process.send_signal(signal.SIGSTOP)
            with pytest.raises(grpc.RpcError) as err:
                next(watch)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert "ping timeout" in (err.value.details() or "").lower(), err.value.details()
    finally:
        child.process.send_signal(signal.SIGCONT)
        stop_children([child])
