"""Staleness admission: AReaL's capacity rule, recovery, checkpointed counters, the lag bound."""

from __future__ import annotations

import random
import threading
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_grpc.errors import FieldError
from areal_grpc.staleness import RolloutStats, StalenessManager, StalenessStateError


def _manager(b, eta, c, v, enq=0, run=0, acc=0, rej=0):
    m = StalenessManager(b, eta, max_concurrent_rollouts=c, version=v)
    m.load_state_dict(
        {"enqueued": enq, "running": run, "accepted": acc, "rejected": rej},
        requeue_running=False,
    )
    return m


# capacity = min(C - running, (eta + V + 1) * B - (accepted + running)), checked by hand.
@pytest.mark.parametrize(
    ("b", "eta", "c", "v", "enq", "run", "acc", "rej", "expected"),
    [
        pytest.param(4, 0, None, 0, 0, 0, 0, 0, 4, id="fresh-C-defaults-to-B"),
        pytest.param(8, 2, 3, 0, 0, 1, 0, 0, 2, id="concurrency-bound"),
        pytest.param(4, 1, 100, 0, 0, 3, 4, 0, 1, id="staleness-bound"),
        pytest.param(4, 1, 100, 1, 0, 3, 4, 0, 5, id="version-advanced"),
        pytest.param(4, 1, 100, 3, 0, 3, 4, 0, 13, id="version-advanced-more"),
        pytest.param(4, 0, 100, 0, 0, 0, 2, 10, 2, id="rejections-free-budget"),
        pytest.param(4, 0, 100, 0, 0, 0, 2, 0, 2, id="same-without-rejections"),
        pytest.param(4, 0, 4, 0, 100, 0, 0, 0, 4, id="queued-does-not-count"),
        pytest.param(4, 0, 2, 0, 0, 5, 0, 0, -3, id="negative-concurrency"),
        pytest.param(2, 1, 100, 0, 0, 0, 6, 0, -2, id="negative-staleness"),
        pytest.param(1, 10, 5, 3, 0, 2, 3, 0, 3, id="large-eta-concurrency-bound"),
        pytest.param(3, 2, 50, 5, 0, 4, 20, 0, 0, id="exactly-exhausted"),
        pytest.param(16, 4, 64, 2, 7, 10, 40, 3, 54, id="concurrency-54-vs-staleness-62"),
    ],
)
def test_capacity_formula(b, eta, c, v, enq, run, acc, rej, expected):
    assert _manager(b, eta, c, v, enq, run, acc, rej).capacity() == expected


def test_counter_transitions_and_pending_limit():
    m = StalenessManager(4, 2)
    assert m.pending_limit == 12
    m.on_enqueued(3)
    m.on_submitted()
    m.on_submitted()
    m.on_accepted()
    m.on_rejected()
    assert m.stats() == RolloutStats(enqueued=1, running=0, accepted=1, rejected=1)
    m.on_dequeued()
    assert m.stats().enqueued == 0


@pytest.mark.parametrize(
    ("event", "counter"),
    [
        ("on_submitted", "enqueued"),
        ("on_dequeued", "enqueued"),
        ("on_accepted", "running"),
        ("on_rejected", "running"),
        ("on_dropped", "accepted"),
    ],
)
def test_impossible_transition_raises_and_leaves_counters(event, counter):
    m = _manager(4, 1, 8, 0, enq=0, run=0, acc=0, rej=5)
    with pytest.raises(StalenessStateError, match=counter):
        getattr(m, event)()
    assert m.stats() == RolloutStats(rejected=5)


def test_try_submit_from_queue_needs_a_queued_prompt():
    m = StalenessManager(4, 0)
    with pytest.raises(StalenessStateError, match="enqueued"):
        m.try_submit()
    assert m.try_submit(from_queue=False)
    assert m.stats() == RolloutStats(running=1)


def test_eta_zero_is_synchronous_one_batch_at_a_time():
    m = StalenessManager(3, 0, max_concurrent_rollouts=10)
    for version in range(3):
        started = 0
        while m.try_submit(from_queue=False):
            started += 1
        assert started == 3  # exactly one batch
        for _ in range(3):
            m.on_accepted()
            # Finished work does not open room for the next batch before the version bump.
            assert m.capacity() == 0
        m.set_version(version + 1)
    assert m.stats().accepted == 9


def test_dropping_a_stale_rollout_frees_its_budget():
    m = _manager(2, 0, 10, 0, acc=2)
    assert m.capacity() == 0
    m.on_dropped()
    assert m.capacity() == 1
    assert m.stats() == RolloutStats(accepted=1, rejected=1)


def test_is_stale_uses_current_or_given_version():
    box = [5]
    m = StalenessManager(4, 2, version=lambda: box[0])
    assert not m.is_stale(3)
    assert m.is_stale(2)
    box[0] = 6
    assert m.is_stale(3)  # the provider is read on every call
    assert not m.is_stale(3, version=5)


def test_callable_version_provider_drives_capacity():
    box = [0]
    m = StalenessManager(2, 0, max_concurrent_rollouts=10, version=lambda: box[0])
    m.load_state_dict({"enqueued": 0, "running": 0, "accepted": 2, "rejected": 0})
    assert m.capacity() == 0
    box[0] = 1
    assert m.capacity() == 2


def test_recovery_rule_bounds_capacity_after_resume():
    # Resume at version 10 with fresh counters: without the fix the budget is 11 batches.
    m = StalenessManager(4, 2, max_concurrent_rollouts=100, version=10)
    assert m.capacity() == (2 + 10 + 1) * 4  # AReaL's bug: a burst of 52
    m.on_version_recovered(10)
    assert m.stats().accepted == 40
    assert m.capacity() == (2 + 1) * 4


@settings(max_examples=50, deadline=None)
@given(
    b=st.integers(1, 16),
    eta=st.integers(0, 5),
    version=st.integers(0, 50),
    running=st.integers(0, 40),
)
def test_recovery_capacity_is_bounded_by_eta_plus_one_batches_minus_running(
    b, eta, version, running
):
    m = _manager(b, eta, 10_000, version, run=running)
    m.on_version_recovered(version)
    assert m.capacity() == (eta + 1) * b - running


def test_state_dict_round_trip_requeues_in_flight_work():
    m = _manager(4, 1, 8, 3, enq=2, run=3, acc=13, rej=4)
    state = m.state_dict()
    assert state == {"enqueued": 2, "running": 3, "accepted": 13, "rejected": 4}

    exact = StalenessManager(4, 1, max_concurrent_rollouts=8, version=3)
    exact.load_state_dict(state, requeue_running=False)
    assert exact.stats() == m.stats()
    assert exact.capacity() == m.capacity()

    resumed = StalenessManager(4, 1, max_concurrent_rollouts=8, version=3)
    resumed.load_state_dict(state)
    # The 3 in-flight prompts are queued again and will be submitted afresh.
    assert resumed.stats() == RolloutStats(enqueued=5, running=0, accepted=13, rejected=4)
    assert resumed.capacity() == min(8, (1 + 3 + 1) * 4 - 13)


@pytest.mark.parametrize(
    ("state", "field"),
    [
        ({"enqueued": 0, "running": 0, "accepted": 0}, "rejected"),
        ({"enqueued": 0, "running": 0, "accepted": 0, "rejected": 0, "x": 1}, "x"),
        ({"enqueued": 0, "running": -1, "accepted": 0, "rejected": 0}, "running"),
        ({"enqueued": 0, "running": 0, "accepted": 1.5, "rejected": 0}, "accepted"),
    ],
)
def test_load_state_dict_rejects_bad_state(state, field):
    m = StalenessManager(4, 1)
    with pytest.raises(FieldError) as err:
        m.load_state_dict(state)
    assert err.value.field == field
    assert m.stats() == RolloutStats()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"consumer_batch_size": 0, "max_staleness": 1}, "consumer_batch_size"),
        ({"consumer_batch_size": 4, "max_staleness": -1}, "max_staleness"),
        (
            {"consumer_batch_size": 4, "max_staleness": 1, "max_concurrent_rollouts": 0},
            "max_concurrent_rollouts",
        ),
    ],
)
def test_bad_parameters_name_the_field(kwargs, field):
    with pytest.raises(FieldError) as err:
        StalenessManager(**kwargs)
    assert err.value.field == field


def test_concurrent_try_submit_never_overshoots_capacity():
    m = StalenessManager(16, 1, max_concurrent_rollouts=1000)
    wins: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        n = sum(1 for _ in range(200) if m.try_submit(from_queue=False))
        with lock:
            wins.append(n)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(wins) == (1 + 0 + 1) * 16
    assert m.stats().running == 32
    assert m.capacity() == 0


def _simulate(b, eta, c, seed, fifo, steps=15):
    """Submit/complete/train with random completion order; returns (lags, drops).

    ``fifo``: batches are the B oldest submitted non-rejected rollouts (waiting for them);
    otherwise the B oldest among those already finished, discarding stale ones.
    """
    rng = random.Random(seed)
    m = StalenessManager(b, eta, max_concurrent_rollouts=c)
    submit_version: dict[int, int] = {}
    running: list[int] = []
    accepted: deque[int] = deque()  # untrained, in submission order
    order: deque[int] = deque()  # submitted, not yet trained or rejected
    rejected: set[int] = set()
    lags: list[int] = []
    drops = 0
    next_id = 0
    for _ in range(20_000):
        if m.version == steps:
            return lags, drops
        action = rng.random()
        if action < 0.4:
            m.on_enqueued()
            if m.try_submit():
                submit_version[next_id] = m.version
                running.append(next_id)
                order.append(next_id)
                next_id += 1
            else:
                m.on_dequeued()
        elif action < 0.8 and running:
            task = running.pop(rng.randrange(len(running)))
            if rng.random() < 0.15:
                m.on_rejected()
                rejected.add(task)
            else:
                m.on_accepted()
                accepted.append(task)
        else:
            if fifo:
                head = [t for t in order if t not in rejected][:b]
                if len(head) < b or any(t not in accepted for t in head):
                    continue
                batch = head
            else:
                ordered = sorted(accepted)
                for t in ordered:
                    if m.is_stale(submit_version[t]):
                        m.on_dropped()
                        accepted.remove(t)
                        drops += 1
                if len(accepted) < b:
                    continue
                batch = sorted(accepted)[:b]
            for t in batch:
                accepted.remove(t)
                if t in order:
                    order.remove(t)
                lags.append(m.version - submit_version[t])
            m.set_version(m.version + 1)
    raise AssertionError(f"no progress: stuck at version {m.version} with {m.stats()}")


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 6),
    eta=st.integers(0, 4),
    c=st.integers(1, 30),
    seed=st.integers(0, 2**32 - 1),
)
def test_in_order_training_never_exceeds_eta(b, eta, c, seed):
    lags, _ = _simulate(b, eta, c, seed, fifo=True)
    assert len(lags) == 15 * b
    assert all(0 <= lag <= eta for lag in lags)


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 6),
    eta=st.integers(0, 4),
    c=st.integers(1, 30),
    seed=st.integers(0, 2**32 - 1),
)
def test_completion_order_training_with_drops_stays_live_and_within_eta(b, eta, c, seed):
    # Drops must return budget; otherwise admission stalls and _simulate raises.
    lags, _ = _simulate(b, eta, c, seed, fifo=False)
    assert len(lags) == 15 * b
    assert all(0 <= lag <= eta for lag in lags)
