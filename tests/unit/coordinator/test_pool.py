"""The work pool: admission under the staleness rule, oldest-first batches, leases, recovery."""

from __future__ import annotations

import asyncio
import json

import pytest

from areal_grpc.config import load_config
from areal_grpc.coordinator.dataloader import PromptLoader
from areal_grpc.coordinator.loop import Coordinator
from areal_grpc.coordinator.pool import NoCapacity, WorkPool, head_version
from areal_grpc.errors import FieldError
from areal_grpc.trajectory import make_group

ITEMS = [{"prompt": f"{c}=", "answer": c, "id": f"i{n}"} for n, c in enumerate("abcdefghij")]


def group(task_id: str, versions=(0, 0), reward: float = 1.0, n: int = 2):
    return make_group(task_id, [reward] * n, versions=versions)


def make_pool(batch=2, eta=0, concurrency=8, items=ITEMS, shuffle=False):
    return WorkPool(
        batch, eta, concurrency, PromptLoader(items, shuffle=shuffle, seed=0), vocab_size=384
    )


def test_loader_position_is_exact_and_epochs_reshuffle_deterministically():
    a = PromptLoader(ITEMS, shuffle=True, seed=3)
    first = [a.next().item["id"] for _ in range(25)]
    b = PromptLoader(ITEMS, shuffle=True, seed=3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())) | {"position": 7})
    assert [b.next().item["id"] for _ in range(18)] == first[7:]
    # Each epoch visits every item once.
    for e in range(2):
        assert sorted(first[e * 10 : (e + 1) * 10]) == sorted(i["id"] for i in ITEMS)
    assert first[:10] != first[10:20]


def test_capacity_is_one_batch_per_version_when_synchronous():
    pool = make_pool(batch=2, eta=0)
    claimed = [pool.claim("s") for _ in range(3)]
    assert [w.task_id for w in claimed[:2]] == ["p0", "p1"] and claimed[2] is None
    pool.finish("p0", group("p0"))
    pool.finish("p1", group("p1"))
    assert pool.claim("s") is None  # the batch is complete, but not trained yet
    assert [f.work.task_id for f in pool.take_batch(2, 0)] == ["p0", "p1"]
    pool.set_version(1)
    assert pool.claim("s").task_id == "p2"


def test_batches_take_the_oldest_finished_groups_first():
    pool = make_pool(batch=2, eta=1)
    works = [pool.claim("s") for _ in range(4)]
    for w in reversed(works):
        pool.finish(w.task_id, group(w.task_id))
    assert [f.work.task_id for f in pool.take_batch(2, 0)] == ["p0", "p1"]
    assert pool.take_batch(3, 0) is None


def test_stale_groups_are_dropped_and_their_prompts_requeued():
    pool = make_pool(batch=1, eta=1)
    w0 = pool.claim("s")
    w1 = pool.claim("s")
    pool.finish(w1.task_id, group(w1.task_id, versions=(0, 0)))
    pool.set_version(2)
    pool.finish(w0.task_id, group(w0.task_id, versions=(2, 2)))
    # Trained at version 2 with eta 1: the version-0 group is too old.
    batch = pool.take_batch(1, 2)
    assert [f.work.task_id for f in batch] == ["p0"]
    assert pool.stats.dropped_stale == 1
    assert [w.task_id for w in pool.pending] == ["p1"]
    # The requeued prompt is claimed again before new prompts.
    assert pool.claim("s").task_id == "p1"


def test_requeued_work_keeps_its_place_and_counters_stay_consistent():
    pool = make_pool(batch=3, eta=0)
    works = [pool.claim("a") for _ in range(3)]
    pool.requeue(works[1].task_id)
    st = pool.staleness.stats()
    assert (st.enqueued, st.running) == (1, 2)
    assert pool.claim("b").task_id == "p1"
    assert pool.running["p1"].producer == "b"


def test_leases_expire_and_free_capacity():
    pool = make_pool(batch=1, eta=0)
    lease = pool.acquire("agent", 2, ttl_s=0.0)
    # The expired lease is swept by the next acquire, which then succeeds.
    second = pool.acquire("agent", 2, ttl_s=60.0)
    assert second.work.task_id != lease.work.task_id
    with pytest.raises(NoCapacity):
        pool.acquire("agent", 2)
    pool.release(second.work.task_id)
    pool.acquire("agent", 2)


def test_a_renewed_lease_outlives_its_first_deadline_and_an_abandoned_one_expires():
    """The lease time is the pool's setting (staleness.lease_ttl_s in a run): each renewal
    gives the lease that much again from now; once it ran out it cannot be renewed (its
    capacity went back) and the pool says so naming the field."""
    pool = WorkPool(1, 0, lease_ttl_s=10.0, vocab_size=384)
    lease = pool.acquire("agent", 2, ttl_s=None)
    lid = lease.work.task_id
    start = lease.deadline
    # Kept alive well past its first deadline by renewals less than a lease time apart.
    for t in (8.0, 16.0, 24.0):
        assert pool.renew(lid, now=start - 10.0 + t).deadline == pytest.approx(start + t)
    assert pool.leases[lid].deadline == pytest.approx(start + 24.0)
    assert pool.submit(lid, group(lid), "r") is None  # accepted at t = 30, after 3 ttl
    # Abandoned: the next renewal comes after the deadline.
    pool.set_version(1)
    other = pool.acquire("agent", 2).work.task_id
    with pytest.raises(FieldError) as err:
        pool.renew(other, now=pool.leases[other].deadline + 0.1)
    assert err.value.field == "lease_id" and "expired" in str(err.value)
    assert other not in pool.leases and pool.stats.rejected_reasons["lease expired"] == 1
    # Its capacity went back: another producer gets the slot.
    pool.acquire("agent-2", 2)
    with pytest.raises(FieldError):
        pool.renew("lease-unknown")


def test_dynamic_sampling_rejects_an_external_group_of_equal_rewards_and_frees_its_slot():
    """With the run's dynamic sampling on (rollout.workflow_params.accept=nonuniform), a
    submitted group whose rewards are all equal has no advantage: it is rejected, saying
    why and naming the setting, and its slot goes to the producer's next lease."""
    pool = WorkPool(1, 0, vocab_size=384, drop_uniform_external=True)
    lid = pool.acquire("agent", 2).work.task_id
    reason = pool.submit(lid, make_group(lid, [1.0, 1.0]), "r")
    assert reason is not None and "every reward is 1" in reason
    assert "rollout.workflow_params.accept=nonuniform" in reason
    assert pool.stats.rejected_reasons["uniform rewards"] == 1 and not pool.buffer
    lid = pool.acquire("agent", 2).work.task_id  # the slot is free again
    assert pool.submit(lid, make_group(lid, [1.0, 0.0]), "r") is None
    assert [f.work.task_id for f in pool.buffer] == [lid]
    # Off (the default): equal rewards are trained like any others.
    plain = WorkPool(1, 0, vocab_size=384)
    lid = plain.acquire("agent", 2).work.task_id
    assert plain.submit(lid, make_group(lid, [1.0, 1.0]), "r") is None


@pytest.mark.parametrize("bad", ["0", "-5", "nan", "inf"])
def test_the_lease_time_is_a_setting_and_a_bad_one_names_it(bad: str):
    assert load_config(None, ["staleness.lease_ttl_s=300"]).staleness.lease_ttl_s == 300.0
    with pytest.raises(FieldError) as err:
        load_config(None, [f"staleness.lease_ttl_s={bad}"])
    assert err.value.field == "staleness.lease_ttl_s"


def test_external_submission_validation_staleness_and_acceptance():
    pool = make_pool(batch=1, eta=1)
    lease = pool.acquire("agent", 2)
    lid = lease.work.task_id
    bad = group(lid)
    bad.trajectories[1].token_ids[2] = 9999
    with pytest.raises(FieldError) as err:
        pool.submit(lid, bad, "requests[0]")
    assert err.value.field == "requests[0].group.trajectories[1].token_ids[2]"
    # The lease survives a malformed submission.
    assert pool.submit(lid, group(lid), "requests[1]") is None
    assert pool.take_batch(1, 0)[0].work.task_id == lid
    # A group whose first generated token is more than eta versions old is rejected.
    pool.set_version(3)
    lease = pool.acquire("agent", 2)
    reason = pool.submit(lease.work.task_id, group(lease.work.task_id, versions=(1, 3)), "r")
    assert reason is not None and "version 1" in reason and "max_staleness=1" in reason
    assert pool.submit("lease-unknown", group("x"), "r").startswith("lease_id")


def test_head_version_is_the_first_generated_token():
    assert head_version(group("t", versions=(4, 5))) == 4


def test_state_dict_round_trip_requeues_inflight_and_keeps_buffered_groups():
    pool = make_pool(batch=2, eta=2)
    works = [pool.claim("s") for _ in range(4)]
    pool.finish("p2", group("p2"))
    pool.requeue("p3")
    lease = pool.acquire("agent", 2)  # noqa: F841 - an external lease in flight
    state = json.loads(json.dumps(pool.state_dict()))
    assert len(works) == 4

    fresh = make_pool(batch=2, eta=2)
    fresh.load_state_dict(state)
    assert [w.task_id for w in fresh.pending] == ["p0", "p1", "p3"]
    assert [f.work.task_id for f in fresh.buffer] == ["p2"]
    assert fresh.buffer[0].group == group("p2")
    st = fresh.staleness.stats()
    assert (st.enqueued, st.running, st.accepted) == (3, 0, 1)
    # Capacity as if the in-flight work had never started: (eta+V+1)B - accepted.
    assert fresh.capacity() == (2 + 0 + 1) * 2 - 1
    assert fresh.loader.position == 4
    assert [fresh.claim("s").task_id for _ in range(3)] == ["p0", "p1", "p3"]
    assert fresh.rng.random() == pool.rng.random()


def test_wait_change_wakes_on_a_finished_group():
    async def scenario():
        pool = make_pool(batch=1, eta=0)
        w = pool.claim("s")
        waiter = asyncio.create_task(pool.wait_batch(1, 0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        pool.finish(w.task_id, group(w.task_id))
        batch = await asyncio.wait_for(waiter, 5)
        return [f.work.task_id for f in batch]

    assert asyncio.run(scenario()) == ["p0"]


def test_a_refused_external_producer_gets_the_next_free_slot():
    pool = make_pool(batch=1, eta=0)
    w = pool.claim("server")
    with pytest.raises(NoCapacity):
        pool.acquire("agent", 2)
    pool.finish(w.task_id, group(w.task_id))
    pool.take_batch(1, 0)
    pool.set_version(1)
    # The dataset submitter would take the new slot at once; it is held for the agent.
    assert pool.claim("server") is None
    lease = pool.acquire("agent", 2)
    assert lease.version == 1
    # Served demand holds nothing back: a released slot goes to the dataset again.
    pool.release(lease.work.task_id)
    assert pool.claim("server") is not None
    # Demand that is not picked up in time stops holding slots back.
    pool.demand_hold_s = 0.0
    with pytest.raises(NoCapacity):
        pool.acquire("agent", 2)
    assert pool.external_demand() == 0


def test_a_run_starting_at_a_later_version_admits_one_window_not_all_versions():
    # Trainers attached from an earlier run serve version 7: the run's first window is still
    # (eta + 1) * B rollouts, not (7 + eta + 1) * B.
    fresh, later = (
        make_pool(batch=2, eta=1, concurrency=64),
        make_pool(batch=2, eta=1, concurrency=64),
    )
    fresh.start_at(0)
    later.start_at(7)
    assert fresh.capacity() == later.capacity() == (1 + 1) * 2
    # And each later version frees exactly one more batch, as at version 0.
    later.set_version(8)
    assert later.capacity() == (1 + 1) * 2 + 2


def test_groups_accepted_before_the_run_starts_keep_counting():
    # External producers can submit before the loop starts; starting at version 3 adds three
    # batches to what was accepted, it does not overwrite it.
    pool = make_pool(batch=2, eta=1, concurrency=64)
    pool.finish(pool.claim("s").task_id, group("p0"))
    pool.start_at(3)
    assert pool.staleness.stats().accepted == 1 + 3 * 2
    assert pool.capacity() == (1 + 1) * 2 - 1


def test_a_runs_settings_reach_its_pool(tmp_path):
    """The lease time and dynamic sampling of external groups are the run's settings."""
    cfg = load_config(
        None,
        [
            "data.task=external",
            "eval.every_steps=0",
            "staleness.lease_ttl_s=7",
            "rollout.workflow_params.accept=nonuniform",
        ],
    )
    pool = Coordinator(cfg, [], [], tmp_path).pool
    assert pool.lease_ttl_s == 7.0 and pool.drop_uniform_external
    default = Coordinator(load_config(None, []), [], [], tmp_path).pool
    assert default.lease_ttl_s == 60.0 and not default.drop_uniform_external
