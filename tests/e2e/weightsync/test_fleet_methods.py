"""Each method moves a trained 2-rank FSDP2 trainer's weights into 2 rollout servers.

Two real ``areal-trainer`` processes (FSDP2 over gloo) train a step, then the coordinator's
fleet update (``clients.fleet.update_fleet_weights``: pause -> PublishWeights on both ranks ->
confirm -> resume) moves the weights by one method into two real rollout servers. The served
weights must be bit-identical to the trainer's own HF export, and greedy generation must equal
generation from that exported model.
"""

from __future__ import annotations

import asyncio

import pytest
from areal_clients.fleet import update_fleet_weights

from tests.support.weightsync import (
    MakeRollout,
    Trainers,
    exported_state_dict,
    reference_greedy,
    tensor_digest,
)

PROMPT = [5, 17, 42, 99, 7]


@pytest.mark.parametrize("method", ["stream", "disk", "distributed", "socket", "shared_memory"])
def test_method_moves_trained_fsdp_weights_into_two_rollout_servers(
    trainers: Trainers, make_rollout: MakeRollout, method: str
) -> None:
    version = trainers.train_step()
    rollouts = [make_rollout(disk_root=trainers.weights_root) for _ in range(2)]
    initial = rollouts[0].digests()

    result = asyncio.run(
        update_fleet_weights(
            trainers.addresses,
            [r.address for r in rollouts],
            methods=(method,),
            timeout_s=120,
        )
    )

    assert result.failed_servers == [], [s.error for s in result.servers]
    assert result.version == version
    assert [s.method for s in result.servers] == [method, method]
    export = trainers.export(f"export-{method}-v{version}")
    expected = {k: tensor_digest(v) for k, v in exported_state_dict(export).items()}
    for r in rollouts:
        served = r.digests()
        assert r.version() == version
        for name, digest in expected.items():
            assert served[name] == digest, name
        # The trained weights really differ from the initial ones.
        assert any(served[k] != initial[k] for k in expected)
        # Resumed: generation works and equals the exported model's.
        assert r.greedy(PROMPT) == reference_greedy(export, PROMPT)


def test_with_no_methods_named_a_cpu_trainer_offers_shared_memory_first_then_distributed(
    trainers: Trainers, make_rollout: MakeRollout
) -> None:
    """The default order on CPU: servers on the trainer's host map its shared memory; one
    that cannot (another host; here a server that does not take it) joins the weight group."""
    version = trainers.train_step()
    same_host = make_rollout()
    elsewhere = make_rollout(methods=("distributed", "socket", "stream", "disk"))
    result = asyncio.run(
        update_fleet_weights(
            trainers.addresses, [same_host.address, elsewhere.address], timeout_s=120
        )
    )
    assert result.failed_servers == [], [s.error for s in result.servers]
    assert [s.method for s in result.servers] == ["shared_memory", "distributed"]
    export = trainers.export(f"export-default-v{version}")
    expected = {k: tensor_digest(v) for k, v in exported_state_dict(export).items()}
    for r in (same_host, elsewhere):
        assert r.version() == version
        served = r.digests()
        assert all(served[name] == digest for name, digest in expected.items())


def test_distributed_group_is_formed_once_and_reused_by_later_updates(
    trainers: Trainers, make_rollout: MakeRollout
) -> None:
    rollouts = [make_rollout() for _ in range(2)]
    addresses = [r.address for r in rollouts]
    groups = []
    for _ in range(2):
        version = trainers.train_step()
        result = asyncio.run(
            update_fleet_weights(
                trainers.addresses, addresses, methods=("distributed",), timeout_s=120
            )
        )
        assert result.failed_servers == [], [s.error for s in result.servers]
        assert [r.version() for r in rollouts] == [version, version]
        groups.append([r.weight_sync.group for r in rollouts])
    # The same process-group objects carried the second update: no new rendezvous.
    assert all(g is not None for g in groups[0])
    assert [id(g) for g in groups[1]] == [id(g) for g in groups[0]]
    assert [g.params.rank for g in groups[1]] == [1, 2]
    assert rollouts[0].digests() == rollouts[1].digests()
