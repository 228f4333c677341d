"""CoordinatorService over real gRPC: leases, submissions, version watch, status, workers."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from areal_clients.coordinator import CoordinatorClient
from arealgrpc.v1 import common_pb2, coordinator_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from areal_grpc.coordinator.pool import WorkPool
from areal_grpc.coordinator.service import CoordinatorServicer
from areal_grpc.errors import field_violations
from areal_grpc.launch import python_module_argv, start_child, stop_children
from areal_grpc.server import ServerOptions, start_server
from areal_grpc.trajectory import make_group


def group(task_id: str, versions=(0, 0), n: int = 2) -> common_pb2.TrajectoryGroup:
    return make_group(task_id, [1.0] * n, versions=versions)


@pytest.fixture
def standalone(tmp_path_factory):
    """``areal-coordinator`` as a real process: B = 1, eta = 0, leases live 1 s."""
    child = start_child(
        "coordinator",
        python_module_argv(
            "areal_grpc.coordinator.serve",
            "--port",
            "0",
            "--vocab-size",
            "384",
            "staleness.batch_size=1",
            "staleness.max_staleness=0",
            "rollout.max_concurrent_rollouts=4",
            "staleness.lease_ttl_s=1",
        ),
        log_dir=tmp_path_factory.mktemp("coord-logs"),
    )
    yield child.address
    assert stop_children([child]) == {"coordinator": 0}


def test_capacity_exhaustion_gives_retry_info_and_an_expired_lease_frees_it(standalone):
    async def scenario():
        client = CoordinatorClient(standalone)
        lease = await client.acquire("agent-a", group_size=2)
        assert lease.lease_id and lease.group_size == 2 and lease.policy_version == 0
        assert lease.deadline.ToNanoseconds() > time.time_ns()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.acquire("agent-b", group_size=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        detail = rpc_status.from_call(err.value).details[0]
        retry = error_details_pb2.RetryInfo()
        assert detail.Unpack(retry) and retry.retry_delay.ToNanoseconds() > 0
        # Nobody submits under the lease: when it expires its capacity comes back.
        status = await client.status()
        assert status.running == 1 and status.capacity == 0
        while (await client.status()).running:
            await asyncio.sleep(0.1)
        status = await client.status()
        assert status.capacity == 1 and status.rejected == 1
        second = await client.acquire("agent-b", group_size=2)
        # A submission under the expired lease is rejected with the reason, not an error.
        reply = await client.submit([(lease.lease_id, group(lease.lease_id))])
        assert reply.accepted_groups == 0
        assert "expired" in reply.rejections[0].reason
        await client.release(second.lease_id)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.release(second.lease_id)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        await client.close()

    asyncio.run(scenario())


def test_bad_submission_is_invalid_argument_naming_the_field_and_nothing_is_lost(standalone):
    async def scenario():
        client = CoordinatorClient(standalone)
        lease = await client.acquire("agent", 2)
        bad = group(lease.lease_id)
        del bad.trajectories[1].logprobs[3]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.submit([(lease.lease_id, bad)])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(err.value)[0][0] == "requests[0].group.trajectories[1].logprobs"
        wrong_vocab = group(lease.lease_id)
        wrong_vocab.trajectories[0].token_ids[3] = 384
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.submit([(lease.lease_id, wrong_vocab)])
        assert field_violations(err.value)[0][0] == "requests[0].group.trajectories[0].token_ids[3]"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.submit([("", group("x"))])
        assert field_violations(err.value)[0][0] == "requests[0].lease_id"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.acquire("agent", group_size=0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(err.value)[0][0] == "group_size"
        # The server is still up and the lease survived: the corrected group is accepted.
        reply = await client.submit([(lease.lease_id, group(lease.lease_id))])
        assert reply.accepted_groups == 1 and not reply.rejections
        status = await client.status()
        assert (status.accepted, status.running, status.capacity) == (1, 0, 0)
        # A second submission under the used lease is a rejection, and counts nothing twice.
        reply = await client.submit([(lease.lease_id, group(lease.lease_id))])
        assert reply.accepted_groups == 0 and reply.rejections[0].reason.startswith("lease_id")
        assert (await client.status()).accepted == 1
        # The lease is checked before the group (the order coordinator.proto documents): even
        # a malformed group under an unknown lease is a rejection, not an error of the call.
        reply = await client.submit([(lease.lease_id, bad)])
        assert reply.accepted_groups == 0 and reply.rejections[0].reason.startswith("lease_id")
        await client.close()

    asyncio.run(scenario())


def test_worker_registry(standalone):
    async def scenario():
        client = CoordinatorClient(standalone)
        reply = await client.register_worker(
            coordinator_pb2.WORKER_ROLE_ROLLOUT, "127.0.0.1:50999", "r9"
        )
        assert reply.worker_id == "r9"
        status = await client.status()
        assert [(w.worker_id, w.address) for w in status.workers] == [("r9", "127.0.0.1:50999")]
        for role, address, field in [
            (coordinator_pb2.WORKER_ROLE_UNSPECIFIED, "127.0.0.1:1", "role"),
            (coordinator_pb2.WORKER_ROLE_ROLLOUT, "no-port", "address"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.register_worker(role, address)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field_violations(err.value)[0][0] == field
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.register_worker(coordinator_pb2.WORKER_ROLE_ROLLOUT, "127.0.0.1:50999")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # Leases point producers at a registered rollout server.
        lease = await client.acquire("agent", 1)
        assert lease.rollout_address == "127.0.0.1:50999"
        await client.release(lease.lease_id)
        assert (await client.deregister_worker("r9")).requeued_tasks == 0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.deregister_worker("r9")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        await client.close()

    asyncio.run(scenario())


def test_stale_submission_is_rejected_with_the_reason_and_watch_version_follows():
    async def scenario():
        pool = WorkPool(2, 1, 8, vocab_size=384)
        servicer = CoordinatorServicer(pool)
        server = await start_server(
            [servicer.as_service()],
            ServerOptions(port=0),
        )
        servicer.start()
        client = CoordinatorClient(server.address)
        watch = client.watch_version()
        seen = [(await anext(aiter(watch))).policy_version]
        old = await client.acquire("agent", 2)
        pool.global_step = 3
        pool.set_version(3)
        seen.append((await anext(aiter(watch))).policy_version)
        watch.cancel()
        # Produced at version 1 (the lease's), trained no earlier than 3: 2 > eta = 1 behind.
        reply = await client.submit([(old.lease_id, group(old.lease_id, versions=(1, 1)))])
        assert reply.accepted_groups == 0
        reason = reply.rejections[0].reason
        assert "version 1" in reason and "max_staleness=1" in reason and "version 3" in reason
        fresh = await client.acquire("agent", 2)
        reply = await client.submit([(fresh.lease_id, group(fresh.lease_id, versions=(2, 3)))])
        assert reply.accepted_groups == 1
        assert [f.work.task_id for f in pool.buffer] == [fresh.lease_id]
        await client.close()
        await servicer.stop()
        await server.stop(0)
        return seen

    assert asyncio.run(scenario()) == [0, 3]
