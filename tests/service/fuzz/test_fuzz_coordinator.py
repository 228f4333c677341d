"""Fuzzing CoordinatorService (a standalone work pool) with malformed messages.

Leases are acquired and released with random ids and sizes, trajectory groups are submitted
under random (valid, unknown, used, empty) leases with malformed groups in between, and
workers are registered and deregistered with random roles, addresses and ids. The test keeps
its own model of what the coordinator must hold (leases, accepted groups, workers) and checks
GetCoordinatorStatus against it after every example.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from arealgrpc.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

from areal_grpc.coordinator.pool import WorkPool
from areal_grpc.coordinator.service import CoordinatorServicer
from areal_grpc.server import BackgroundServer, service
from areal_grpc.trajectory import make_group
from tests.support.fuzz import Tally, fuzz

VOCAB = 384
CONCURRENT = 8
TIMEOUT = 60.0
I32 = st.integers(-(2**31), 2**31 - 1)
pb = coordinator_pb2


@dataclass
class Coordinator:
    server: BackgroundServer
    pool: WorkPool
    servicer: CoordinatorServicer
    channel: grpc.Channel
    stub: coordinator_pb2_grpc.CoordinatorServiceStub
    leases: set[str] = field(default_factory=set)
    used: set[str] = field(default_factory=set)
    accepted: int = 0
    workers: dict[str, tuple[int, str]] = field(default_factory=dict)

    def status(self) -> pb.GetCoordinatorStatusResponse:
        return self.stub.GetCoordinatorStatus(pb.GetCoordinatorStatusRequest(), timeout=TIMEOUT)

    def check_intact(self) -> None:
        """The coordinator holds exactly what the accepted calls gave it."""
        s = self.status()
        assert (s.policy_version, s.global_step) == (0, 0)
        assert s.running == len(self.leases)
        assert s.accepted == self.accepted
        assert s.capacity == CONCURRENT - len(self.leases)
        assert {w.worker_id: (w.role, w.address) for w in s.workers} == self.workers

    def acquire(self, size: int = 2) -> str:
        lease = self.stub.AcquireRollout(
            pb.AcquireRolloutRequest(producer_id="fuzz", group_size=size), timeout=TIMEOUT
        ).lease
        self.leases.add(lease.lease_id)
        return lease.lease_id

    def release_all(self) -> None:
        for lid in sorted(self.leases):
            self.stub.ReleaseRollout(pb.ReleaseRolloutRequest(lease_id=lid), timeout=TIMEOUT)
        self.used |= self.leases
        self.leases.clear()

    def check_valid_flow(self) -> None:
        """A producer can still lease, submit a valid group and have it accepted."""
        if len(self.leases) >= CONCURRENT:
            self.release_all()
        lid = self.acquire()
        reply = self.stub.SubmitTrajectories(
            iter([pb.SubmitTrajectoriesRequest(lease_id=lid, group=valid_group(lid))]),
            timeout=TIMEOUT,
        )
        assert reply.accepted_groups == 1 and not reply.rejections
        self.leases.discard(lid)
        self.used.add(lid)
        self.accepted += 1
        self.check_intact()


def valid_group(lease_id: str, n: int = 2) -> common_pb2.TrajectoryGroup:
    return make_group(lease_id, [float(i) for i in range(n)], logprobs=[-1.0, -1.5])


@pytest.fixture(scope="module")
def coordinator() -> Iterator[Coordinator]:
    # A large batch size: capacity is bounded by the concurrency limit only.
    pool = WorkPool(100_000, 0, CONCURRENT, vocab_size=VOCAB, lease_ttl_s=600)
    servicer = CoordinatorServicer(pool)
    server = BackgroundServer(
        [service(servicer, coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server, pb)]
    )
    running = server.start()

    async def start() -> None:
        servicer.start()

    server.call(start())
    channel = grpc.insecure_channel(running.address)
    c = Coordinator(
        server, pool, servicer, channel, coordinator_pb2_grpc.CoordinatorServiceStub(channel)
    )
    c.check_intact()
    yield c
    channel.close()
    server.call(servicer.stop())
    server.stop()


# ----------------------------------------------------------------------- Acquire / Release


@fuzz(40)
@given(
    producer=st.text(max_size=30),
    size=st.one_of(st.integers(-3, 4), I32),
    hold=st.booleans(),
)
def test_acquire_random_requests(
    coordinator: Coordinator, tally: Tally, producer, size, hold
) -> None:
    req = pb.AcquireRolloutRequest(
        producer_id=producer,
        group_size=size,
        trace_context=common_pb2.TraceContext(traceparent=producer),
    )
    code, resp = tally.call(
        "Coordinator.AcquireRollout", lambda: coordinator.stub.AcquireRollout(req, timeout=TIMEOUT)
    )
    if size < 1:
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    elif len(coordinator.leases) >= CONCURRENT:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    else:
        assert code == grpc.StatusCode.OK
        lease = resp.lease
        assert lease.lease_id and lease.group_size == size and lease.policy_version == 0
        coordinator.leases.add(lease.lease_id)
        if not hold:
            coordinator.release_all()
    coordinator.check_intact()


@fuzz(40)
@given(lease_id=st.one_of(st.just(""), st.text(max_size=40), st.sampled_from(["used", "twice"])))
def test_release_unknown_or_used_leases(coordinator: Coordinator, tally: Tally, lease_id) -> None:
    if lease_id == "twice" and len(coordinator.leases) < CONCURRENT:
        lid = coordinator.acquire()
        coordinator.release_all()
        lease_id = lid
    elif lease_id == "used":
        lease_id = next(iter(sorted(coordinator.used)), "never-issued")
    code, _ = tally.call(
        "Coordinator.ReleaseRollout",
        lambda: coordinator.stub.ReleaseRollout(
            pb.ReleaseRolloutRequest(lease_id=lease_id), timeout=TIMEOUT
        ),
    )
    if lease_id in coordinator.leases:
        assert code == grpc.StatusCode.OK
        coordinator.leases.discard(lease_id)
    else:
        assert code == grpc.StatusCode.NOT_FOUND
    coordinator.check_intact()


@fuzz(40)
@given(lease_id=st.one_of(st.just(""), st.text(max_size=40), st.sampled_from(["live", "used"])))
def test_renew_live_unknown_or_used_leases(
    coordinator: Coordinator, tally: Tally, lease_id
) -> None:
    """A live lease is renewed (its deadline a lease time from now); anything else is
    NOT_FOUND, and nothing about the pool changes."""
    if lease_id == "live" and len(coordinator.leases) < CONCURRENT:
        lease_id = coordinator.acquire()
    elif lease_id in ("live", "used"):
        lease_id = next(iter(sorted(coordinator.used)), "never-issued")
    before = time.time()
    code, resp = tally.call(
        "Coordinator.RenewRollout",
        lambda: coordinator.stub.RenewRollout(
            pb.RenewRolloutRequest(lease_id=lease_id), timeout=TIMEOUT
        ),
    )
    if lease_id in coordinator.leases:
        assert code == grpc.StatusCode.OK
        assert resp.deadline.seconds >= int(before) + 600 - 1  # lease_ttl_s=600 here
    else:
        assert code == grpc.StatusCode.NOT_FOUND
    coordinator.check_intact()


# ------------------------------------------------------------------------ SubmitTrajectories

GROUP_FLAWS = [
    "no_trajectories",
    "lengths_disagree",
    "nan_reward",
    "inf_reward",
    "nan_logprob",
    "positive_logprob",
    "negative_id",
    "out_of_vocab_id",
    "empty_tokens",
    "prompt_length",
    "mask_on_prompt",
    "version_below_minus_one",
    "trained_token_without_version",
    "group_task_id",
    "trajectory_task_id",
    "group_id_mismatch",
]


def broken_group(lease_id: str, flaw: str, data: st.DataObject) -> common_pb2.TrajectoryGroup:
    g = valid_group(lease_id, data.draw(st.integers(1, 3)))
    t = g.trajectories[data.draw(st.integers(0, len(g.trajectories) - 1))]
    if flaw == "no_trajectories":
        del g.trajectories[:]
    elif flaw == "lengths_disagree":
        rep = getattr(t, data.draw(st.sampled_from(["logprobs", "versions", "loss_mask"])))
        rep.append(rep[-1]) if data.draw(st.booleans()) else rep.pop()
    elif flaw == "nan_reward":
        t.reward = math.nan
    elif flaw == "inf_reward":
        t.reward = data.draw(st.sampled_from([math.inf, -math.inf]))
    elif flaw == "nan_logprob":
        t.logprobs[data.draw(st.integers(0, 3))] = data.draw(
            st.sampled_from([math.nan, math.inf, -math.inf])
        )
    elif flaw == "positive_logprob":
        t.logprobs[data.draw(st.integers(0, 3))] = data.draw(st.floats(2.0**-6, 2.0**127, width=32))
    elif flaw == "negative_id":
        t.token_ids[data.draw(st.integers(0, 3))] = data.draw(st.integers(-(2**31), -1))
    elif flaw == "out_of_vocab_id":
        t.token_ids[data.draw(st.integers(0, 3))] = data.draw(st.integers(VOCAB, 2**31 - 1))
    elif flaw == "empty_tokens":
        for name in ("token_ids", "logprobs", "versions", "loss_mask"):
            del getattr(t, name)[:]
        t.prompt_length = 0
    elif flaw == "prompt_length":
        t.prompt_length = data.draw(st.one_of(st.integers(-(2**31), -1), st.integers(5, 2**31 - 1)))
    elif flaw == "mask_on_prompt":
        t.loss_mask[data.draw(st.integers(0, 1))] = True
    elif flaw == "version_below_minus_one":
        t.versions[data.draw(st.integers(0, 3))] = data.draw(st.integers(-(2**31), -2))
    elif flaw == "trained_token_without_version":
        t.versions[data.draw(st.integers(2, 3))] = -1
    elif flaw == "group_task_id":
        g.task_id = data.draw(
            st.text(min_size=1, max_size=10).map(lambda s: s if s != lease_id else s + "x")
        )
    elif flaw == "trajectory_task_id":
        t.task_id = data.draw(
            st.text(min_size=1, max_size=10).map(lambda s: s if s != lease_id else s + "x")
        )
    else:
        t.group_id = data.draw(
            st.text(min_size=1, max_size=10).map(lambda s: s if s != lease_id else s + "x")
        )
    return g


@st.composite
def submissions(draw: st.DrawFn) -> list[tuple[str, str | None]]:
    """(lease kind, group flaw or None) per message of one SubmitTrajectories stream."""
    return draw(
        st.lists(
            st.tuples(
                st.sampled_from(["fresh", "fresh", "unknown", "empty", "used"]),
                st.none() | st.sampled_from(GROUP_FLAWS),
            ),
            min_size=0,
            max_size=4,
        )
    )


@fuzz(40)
@given(
    plan=submissions(),
    extras=st.sampled_from(["none", "huge", "unknown_finish_reason", "size_mismatch"]),
    data=st.data(),
)
def test_submit_trajectories_malformed(
    coordinator: Coordinator, tally: Tally, plan, extras, data
) -> None:
    c = coordinator
    msgs: list[pb.SubmitTrajectoriesRequest] = []
    # The coordinator's expected answer, computed message by message.
    accepted, rejections, error = 0, 0, False
    taken: list[str] = []
    leases = set(c.leases)  # valid leases, in the model
    for kind, flaw in plan:
        # Drawn whatever the state, so the examples replay identically.
        stranger = data.draw(
            st.text(min_size=1, max_size=20).filter(lambda s: not s.startswith("lease-"))
        )
        if kind == "fresh" and len(c.leases) < CONCURRENT:
            lid = c.acquire()
            leases.add(lid)
        elif kind == "empty":
            lid = ""
        elif kind == "used" and c.used:
            lid = sorted(c.used)[0]
        else:
            lid = stranger
        group = valid_group(lid) if flaw is None else broken_group(lid, flaw, data)
        if flaw is None and extras == "huge":
            # A huge but valid repeated field: one long trajectory, well under 64 MiB.
            n = data.draw(st.integers(1000, 200_000))
            t = group.trajectories[0]
            t.token_ids.extend([9] * n)
            t.logprobs.extend([-1.0] * n)
            t.versions.extend([0] * n)
            t.loss_mask.extend([True] * n)
        elif flaw is None and extras == "unknown_finish_reason":
            group.trajectories[0].finish_reason = data.draw(st.integers(5, 2**31 - 1))
        elif flaw is None and extras == "size_mismatch":
            group.trajectories.add().CopyFrom(group.trajectories[0])
        msgs.append(pb.SubmitTrajectoriesRequest(lease_id=lid, group=group))
        if not error:
            if not lid:
                error = True
            elif lid not in leases:
                rejections += 1
            elif flaw is not None:
                error = True
            else:
                accepted += 1
                leases.discard(lid)
                taken.append(lid)
    code, resp = tally.call(
        "Coordinator.SubmitTrajectories",
        lambda: c.stub.SubmitTrajectories(iter(msgs), timeout=TIMEOUT),
    )
    if error:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (plan, code)
    else:
        assert code == grpc.StatusCode.OK, (plan, resp)
        assert (resp.accepted_groups, len(resp.rejections)) == (accepted, rejections)
    c.accepted += accepted
    c.leases -= set(taken)
    c.used |= set(taken)
    c.check_intact()
    if len(c.leases) > CONCURRENT // 2:
        c.release_all()
        c.check_intact()
    if tally.sent["Coordinator.SubmitTrajectories"] % 10 == 0:
        c.check_valid_flow()


@fuzz(6)
@given(sent=st.integers(0, 3), how=st.sampled_from(["iterator_raises", "client_cancel"]))
def test_submit_trajectories_broken_stream(
    coordinator: Coordinator, tally: Tally, sent, how
) -> None:
    """A stream that breaks mid-way keeps exactly the groups the server had already taken."""
    c = coordinator
    c.release_all()
    lids = [c.acquire() for _ in range(sent)]
    holder: list[grpc.Future] = []

    def requests() -> Iterator[pb.SubmitTrajectoriesRequest]:
        for lid in lids:
            yield pb.SubmitTrajectoriesRequest(lease_id=lid, group=valid_group(lid))
        # Wait (bounded) until the server has taken what was sent, then break the stream.
        give_up = time.monotonic() + TIMEOUT
        while not holder or c.status().accepted != c.accepted + sent:
            assert time.monotonic() < give_up
            time.sleep(0.01)
        if how == "iterator_raises":
            raise RuntimeError("client iterator broke")
        holder[0].cancel()

    def run() -> pb.SubmitTrajectoriesResponse:
        call = c.stub.SubmitTrajectories.future(requests(), timeout=TIMEOUT)
        holder.append(call)
        try:
            return call.result()
        except grpc.FutureCancelledError:
            raise ClientCancelled() from None

    code, _ = tally.call(
        f"Coordinator.SubmitTrajectories({how})",
        run,
        allowed={grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN},
    )
    assert code != grpc.StatusCode.OK
    c.accepted += sent
    c.leases -= set(lids)
    c.used |= set(lids)
    c.check_intact()
    c.check_valid_flow()


class ClientCancelled(grpc.RpcError):
    """A call this client cancelled itself, reported like the status it ends with."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return "cancelled by the client"


# --------------------------------------------------------------------------- workers

# Roles outside the enum have their own regression test below.
ROLES = st.sampled_from([1, 2, 1, 2, 0])
ADDRESSES = st.one_of(
    st.sampled_from(["", ":", "host", "host:", ":50051", "h:p", "127.0.0.1:5", "[::1]:7"]),
    st.builds(
        lambda h, p: f"{h}:{p}",
        st.sampled_from(["127.0.0.1", "localhost", "[::1]", "rollout-3.internal"])
        | st.text(min_size=1, max_size=10),
        st.integers(1, 65535),
    ),
    st.text(max_size=20),
)


def address_ok(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit())


@fuzz(40)
@given(
    op=st.sampled_from(["register", "register", "deregister"]),
    role=ROLES,
    address=ADDRESSES,
    worker_id=st.one_of(st.just(""), st.sampled_from(["w1", "w2"]), st.text(max_size=10)),
)
def test_register_and_deregister_random_workers(
    coordinator: Coordinator, tally: Tally, op, role, address, worker_id
) -> None:
    c = coordinator
    if op == "deregister":
        code, _ = tally.call(
            "Coordinator.DeregisterWorker",
            lambda: c.stub.DeregisterWorker(
                pb.DeregisterWorkerRequest(worker_id=worker_id), timeout=TIMEOUT
            ),
        )
        if worker_id in c.workers:
            assert code == grpc.StatusCode.OK
            del c.workers[worker_id]
        else:
            assert code == grpc.StatusCode.NOT_FOUND
        c.check_intact()
        return
    req = pb.RegisterWorkerRequest(role=role, address=address, worker_id=worker_id)
    code, resp = tally.call(
        "Coordinator.RegisterWorker", lambda: c.stub.RegisterWorker(req, timeout=TIMEOUT)
    )
    taken = any(a == address for _, a in c.workers.values()) or worker_id in c.workers
    if role == 0 or not address_ok(address):
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    elif taken:
        assert code == grpc.StatusCode.FAILED_PRECONDITION
    else:
        assert code == grpc.StatusCode.OK
        assert resp.worker_id and (not worker_id or resp.worker_id == worker_id)
        c.workers[resp.worker_id] = (role, address)
    c.check_intact()


def test_watch_version_and_status_after_fuzzing(coordinator: Coordinator, tally: Tally) -> None:
    call = coordinator.stub.WatchVersion(pb.WatchVersionRequest(), timeout=TIMEOUT)
    first = next(call)
    call.cancel()
    tally.note("Coordinator.WatchVersion(valid)", "OK")
    assert (first.policy_version, first.global_step) == (0, 0)
    coordinator.release_all()
    coordinator.check_valid_flow()


# ------------------------------------------------- regressions found by this fuzzing


def test_unknown_worker_role_is_refused(coordinator: Coordinator) -> None:
    req = pb.RegisterWorkerRequest(role=99, address="127.0.0.1:6", worker_id="role99")
    try:
        resp = coordinator.stub.RegisterWorker(req, timeout=TIMEOUT)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        return
    # Keep the module's model right for any later test, then fail.
    coordinator.workers[resp.worker_id] = (99, req.address)
    raise AssertionError("role 99 was registered")


def test_out_of_range_worker_port_is_refused(coordinator: Coordinator) -> None:
    req = pb.RegisterWorkerRequest(role=1, address="127.0.0.1:99999", worker_id="port99999")
    try:
        resp = coordinator.stub.RegisterWorker(req, timeout=TIMEOUT)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        return
    coordinator.workers[resp.worker_id] = (1, req.address)
    raise AssertionError("port 99999 was registered")


def test_undecodable_bytes_are_invalid_argument(coordinator: Coordinator) -> None:
    """Bytes that are not the request message get INVALID_ARGUMENT naming its type."""
    register = coordinator.channel.unary_unary(
        "/arealgrpc.v1.CoordinatorService/RegisterWorker", request_serializer=lambda b: b
    )
    submit = coordinator.channel.stream_unary(
        "/arealgrpc.v1.CoordinatorService/SubmitTrajectories", request_serializer=lambda b: b
    )
    calls = {
        "arealgrpc.v1.RegisterWorkerRequest": lambda: register(b"\xff", timeout=TIMEOUT),
        "arealgrpc.v1.SubmitTrajectoriesRequest": lambda: submit(iter([b"\xff"]), timeout=TIMEOUT),
    }
    for type_name, send in calls.items():
        with pytest.raises(grpc.RpcError) as info:
            send()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, type_name
        assert f"not a valid {type_name}" in info.value.details()
    coordinator.check_intact()
