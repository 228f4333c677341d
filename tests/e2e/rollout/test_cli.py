"""``areal-rollout`` as a real process: serves RolloutService, WeightSyncService and health."""

from __future__ import annotations

import signal
import subprocess
import sys

import grpc
from arealgrpc.v1 import (
    common_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    weight_sync_pb2,
    weight_sync_pb2_grpc,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from areal_grpc.server import sync_channel


def test_areal_rollout_serves_and_drains_on_sigterm():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_servers.rollout",
            "--port",
            "0",
            "model.source=builtin:micro",
            "model.seed=3",
            "rollout.sampling.max_new_tokens=3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = ""
        for line in proc.stdout:
            if line.startswith("LISTENING "):
                break
        assert line.startswith("LISTENING "), "server did not report its address"
        address = line.split()[1]
        with sync_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="arealgrpc.v1.RolloutService"), timeout=10
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            st = stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=10)
            assert (st.engine, st.model, st.vocab_size, st.policy_version) == (
                rollout_pb2.ROLLOUT_ENGINE_HF,
                "builtin:micro",
                384,
                0,
            )
            resp = stub.Generate(
                rollout_pb2.GenerateRequest(
                    input_ids=[5, 6], sampling=common_pb2.SamplingParams(ignore_eos=True)
                ),
                timeout=30,
            )
            # The server default (rollout.sampling.max_new_tokens) applies when the request
            # leaves it unset.
            assert len(resp.completions[0].output_ids) == 3
            ws = weight_sync_pb2_grpc.WeightSyncServiceStub(channel)
            stream = weight_sync_pb2.TransferOption(
                method=weight_sync_pb2.TRANSFER_METHOD_STREAM,
                stream=weight_sync_pb2.StreamParams(max_chunk_bytes=1 << 20),
            )
            plan = ws.Negotiate(weight_sync_pb2.NegotiateRequest(offers=[stream]), timeout=10)
            assert plan.plan.method == weight_sync_pb2.TRANSFER_METHOD_STREAM
            assert plan.policy_version == 0
            try:
                ws.Negotiate(weight_sync_pb2.NegotiateRequest(), timeout=10)
                raise AssertionError("expected an error for an empty offer")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "offers" in err.details()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
