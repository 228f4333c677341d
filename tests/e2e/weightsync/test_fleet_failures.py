"""The fleet update when not every server can take it: failures are reported, the rest go on."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from areal_clients.fleet import update_fleet_weights
from arealgrpc.v1 import rollout_pb2, trainer_pb2, trainer_pb2_grpc, weight_sync_pb2

from areal_grpc.durations import duration
from areal_grpc.errors import field_violations
from areal_grpc.ports import free_port
from areal_grpc.server import aio_channel
from tests.support.weightsync import (
    RPC_TIMEOUT,
    MakeRollout,
    Trainers,
    push,
    push_messages,
    shifted,
)

PROMPT = [3, 1, 4, 1, 5]


def paused(r) -> bool:
    return bool(
        r.rollout.GetRolloutStatus(
            rollout_pb2.GetRolloutStatusRequest(), timeout=RPC_TIMEOUT
        ).paused
    )


def publish_on_every_rank(
    trainers: Trainers, request: trainer_pb2.PublishWeightsRequest
) -> list[trainer_pb2.PublishWeightsResponse]:
    """PublishWeights on every rank at once (the gather is collective), as the fleet does."""

    async def one(address: str) -> trainer_pb2.PublishWeightsResponse:
        async with aio_channel(address) as ch:
            stub = trainer_pb2_grpc.TrainerServiceStub(ch)
            return await stub.PublishWeights(request, timeout=RPC_TIMEOUT)

    async def every() -> list[trainer_pb2.PublishWeightsResponse]:
        return list(await asyncio.gather(*(one(a) for a in trainers.addresses)))

    return asyncio.run(every())


# DISTRIBUTED too: the trainer negotiates before it knows the version it publishes, so the
# stale server is found only then, and the weight group must be formed without it.
@pytest.mark.parametrize("method", ["stream", "distributed"])
def test_failed_servers_are_reported_and_left_out_while_the_rest_update(
    trainers: Trainers, make_rollout: MakeRollout, caplog: pytest.LogCaptureFixture, method: str
) -> None:
    version = trainers.train_step()
    good, stale = make_rollout(), make_rollout()
    # This server already serves a newer version than the trainer publishes.
    push(stale, push_messages(shifted(stale, 0.1), version=10_000))
    stale_digests = stale.digests()
    dead = f"127.0.0.1:{free_port()}"

    result = asyncio.run(
        update_fleet_weights(
            trainers.addresses,
            [good.address, stale.address, dead],
            methods=(method,),
            timeout_s=60,
            control_timeout_s=5,
        )
    )

    assert result.version == version
    assert result.updated_servers == [good.address]
    assert result.failed_servers == [stale.address, dead]
    assert result.servers[0].method == method
    errors = {s.address: s.error for s in result.servers}
    assert "FAILED_PRECONDITION" in errors[stale.address]
    assert "UNAVAILABLE" in errors[dead]
    codes = {s.address: s.code for s in result.servers}
    assert codes == {
        good.address: grpc.StatusCode.OK,
        stale.address: grpc.StatusCode.FAILED_PRECONDITION,
        dead: grpc.StatusCode.UNAVAILABLE,
    }
    # A refusal is final and an unreachable server stays unreachable: no second round.
    assert "retrying the weight update" not in caplog.text
    assert good.version() == version and not paused(good)
    assert len(good.greedy(PROMPT)) == 12
    # The refusing server keeps its weights and stays paused, out of rotation.
    assert stale.version() == 10_000 and stale.digests() == stale_digests and paused(stale)


def _rollout_process(
    kill_on: str = "joining weight group",
) -> tuple[subprocess.Popen[str], str, threading.Event]:
    """An ``areal-rollout`` process; the event is set when it was killed on logging
    ``kill_on`` (by default: on joining a group)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_servers.rollout",
            "--port=0",
            "--log-level=INFO",
            "model.source=builtin:micro",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()
    assert line.startswith("LISTENING "), line
    killed = threading.Event()

    def watch() -> None:
        assert proc.stderr is not None
        for text in proc.stderr:
            # Killed the moment it starts joining the weight group (or receiving): the other
            # members are then in the rendezvous or the broadcasts, waiting for it.
            if kill_on in text and not killed.is_set():
                proc.send_signal(signal.SIGKILL)
                killed.set()

    threading.Thread(target=watch, daemon=True).start()
    return proc, line.split()[1], killed


@pytest.mark.timeout(90)
def test_a_receiver_killed_mid_update_fails_alone_and_the_survivor_is_updated(
    trainers: Trainers, make_rollout: MakeRollout
) -> None:
    # Every group timeout here (trainer 120 s, receivers 300 s) is longer than this test may
    # run: the update must end because the dead member is noticed, not by a timeout.
    survivor = make_rollout(group_timeout_s=300)
    proc, dead, killed = _rollout_process()
    try:
        version = trainers.train_step()
        result = asyncio.run(
            update_fleet_weights(
                trainers.addresses,
                [survivor.address, dead],
                methods=("distributed",),
                timeout_s=120,
                control_timeout_s=5,
            )
        )
        assert killed.is_set() and proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)

    assert result.failed_servers == [dead]
    assert result.updated_servers == [survivor.address]
    assert "unreachable" in {s.address: s.error for s in result.servers}[dead]
    # The survivor took the version in the retry, without the dead member, and serves it.
    assert survivor.version() == version and not paused(survivor)
    assert len(survivor.greedy(PROMPT)) == 12

    # The next update reaches it as usual (a fresh group of two).
    version = trainers.train_step()
    result = asyncio.run(
        update_fleet_weights(
            trainers.addresses, [survivor.address], methods=("distributed",), timeout_s=120
        )
    )
    assert result.updated_servers == [survivor.address], [s.error for s in result.servers]
    assert survivor.version() == version


@pytest.mark.timeout(90)
def test_a_receiver_killed_while_its_socket_transfer_starts_fails_alone(
    trainers: Trainers, make_rollout: MakeRollout
) -> None:
    """SOCKET: a receiver killed as its transfer begins fails with the lost connection's
    error; the other server's transfer completes and it serves the version."""
    survivor = make_rollout()
    proc, dead, killed = _rollout_process(kill_on="socket update to version")
    try:
        version = trainers.train_step()
        result = asyncio.run(
            update_fleet_weights(
                trainers.addresses,
                [survivor.address, dead],
                methods=("socket",),
                timeout_s=120,
                control_timeout_s=5,
            )
        )
        assert killed.is_set() and proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    assert result.failed_servers == [dead]
    assert result.updated_servers == [survivor.address]
    assert [s.method for s in result.servers] == ["socket", "socket"]
    assert survivor.version() == version and not paused(survivor)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("limits", "cause"),
    [
        # The update's own 3 s ends its pause, not the 30 s control-call default.
        ({"timeout_s": 3}, "DEADLINE_EXCEEDED"),
        # Deadlines beyond the test's own timeout: only the health check can end the pause.
        (
            {"timeout_s": 600, "control_timeout_s": 600, "health_timeout_s": 1},
            "UNAVAILABLE: no answer after 1 s and the health check failed",
        ),
    ],
    ids=["deadline", "health-check"],
)
def test_a_frozen_server_fails_its_pause_alone_and_the_others_update(
    trainers: Trainers, make_rollout: MakeRollout, limits: dict[str, float], cause: str
) -> None:
    good = make_rollout()
    proc, frozen, _ = _rollout_process()
    try:
        version = trainers.train_step()
        # Stopped: its socket still accepts, nothing answers.
        proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        result = asyncio.run(
            update_fleet_weights(
                trainers.addresses, [good.address, frozen], methods=("stream",), **limits
            )
        )
        took = time.monotonic() - started
    finally:
        proc.kill()
        proc.wait(timeout=30)

    assert result.updated_servers == [good.address] and result.failed_servers == [frozen]
    [error] = [s.error for s in result.servers if s.address == frozen]
    assert error.startswith(f"pause: {cause}"), error
    assert took < 15, took
    assert good.version() == version and not paused(good)


def test_mixed_fleet_negotiates_each_server_its_own_method(
    trainers: Trainers, make_rollout: MakeRollout
) -> None:
    version = trainers.train_step()
    stream_only = make_rollout(methods=("stream",))
    full = make_rollout()
    result = asyncio.run(
        update_fleet_weights(
            trainers.addresses,
            [stream_only.address, full.address],
            methods=("distributed", "stream"),
            timeout_s=120,
        )
    )
    assert result.failed_servers == [], [s.error for s in result.servers]
    # The distributed group is formed with the one server that took it (ranks renumbered).
    assert [s.method for s in result.servers] == ["stream", "distributed"]
    assert stream_only.digests() == full.digests()
    assert stream_only.version() == full.version() == version


def test_publish_weights_bad_request_names_the_field_on_every_rank(trainers: Trainers) -> None:
    request = trainer_pb2.PublishWeightsRequest(rollout_addresses=["127.0.0.1:1", "nonsense"])
    for stub in trainers.stubs:
        with pytest.raises(grpc.RpcError) as err:
            stub.PublishWeights(request, timeout=RPC_TIMEOUT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in field_violations(err.value)] == ["rollout_addresses[1]"]
    # The ranks are still in lock-step: a publication to nobody completes on both.
    replies = publish_on_every_rank(trainers, trainer_pb2.PublishWeightsRequest())
    assert [r.policy_version for r in replies] == [trainers.version()] * 2
    assert replies[0].results == [] and replies[0].tensor_count > 0


def test_each_target_result_carries_a_status_with_the_failure_code(
    trainers: Trainers, make_rollout: MakeRollout
) -> None:
    """PublishTargetResult.status: OK, a refusal (FAILED_PRECONDITION), a passing failure."""
    version = trainers.train_step()
    good, stale = make_rollout(), make_rollout()
    push(stale, push_messages(shifted(stale, 0.1), version=10_000))
    dead = f"127.0.0.1:{free_port()}"
    request = trainer_pb2.PublishWeightsRequest(
        rollout_addresses=[good.address, stale.address, dead],
        methods=[weight_sync_pb2.TRANSFER_METHOD_STREAM],
        timeout=duration(60),
    )
    lead = next(r for r in publish_on_every_rank(trainers, request) if r.results)
    by_address = {r.address: r for r in lead.results}
    assert by_address[good.address].status.code == grpc.StatusCode.OK.value[0]
    assert by_address[good.address].policy_version == version
    refused = by_address[stale.address].status
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "serves version 10000" in refused.message
    unreachable = by_address[dead].status
    assert unreachable.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert unreachable.message.startswith("negotiate: ")
