"""Each method moves a trained 2-rank FSDP2 trainer's weights into 2 rollout servers.

Two real ``areal-trainer`` processes (FSDP2 over gloo) train a step, then the coordinator's
fleet update (``clients.fleet.update_fleet_weights``: pause -> PublishWeights on both ranks ->
confirm -> resume; ``publish`` checks it) moves the weights by one method into two real
rollout servers. The served weights must be bit-identical to the trainer's own HF export, and
greedy generation must equal generation from that exported model.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.weightsync import (
    MakeRollout,
    Trainers,
    exported_state_dict,
    publish,
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

    result = publish(trainers, rollouts, (method,))

    assert result.version == version
    assert [s.method for s in result.servers] == [method, method]
    export = trainers.export(f"export-{method}-v{version}")
    expected = {k: tensor_digest(v) for k, v in exported_state_dict(export).items()}
    for r in rollouts:
        served = r.digests()
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
    result = publish(trainers, [same_host, elsewhere])
    assert result.version == version
    assert [s.method for s in result.servers] == ["shared_memory", "distributed"]
    export = trainers.export(f"export-default-v{version}")
    expected = {k: tensor_digest(v) for k, v in exported_state_dict(export).items()}
    for r in (same_host, elsewhere):
        served = r.digests()
        assert all(served[name] == digest for name, digest in expected.items())


def test_distributed_group_is_formed_once_and_reused_by_later_updates(
    trainers: Trainers, make_rollout: MakeRollout
) -> None:
    rollouts = [make_rollout() for _ in range(2)]
    groups = []
    for _ in range(2):
        version = trainers.train_step()
        assert publish(trainers, rollouts, ("distributed",)).version == version
        groups.append([r.weight_sync.group for r in rollouts])
    # The same process-group objects carried the second update: no new rendezvous.
    assert all(g is not None for g in groups[0])
    assert [id(g) for g in groups[1]] == [id(g) for g in groups[0]]
    assert [g.params.rank for g in groups[1]] == [1, 2]
    assert rollouts[0].digests() == rollouts[1].digests()


@pytest.mark.parametrize("method", ["stream", "disk", "distributed", "socket", "shared_memory"])
def test_bf16_servers_get_the_trained_weights_in_bf16_half_the_bytes_by_every_method(
    trainers: Trainers, make_rollout: MakeRollout, method: str
) -> None:
    """The trainer holds fp32; servers that serve bf16 get bf16 (cast once by the sender),
    equal to the exported fp32 weights rounded to bf16, in half of fp32's bytes."""
    version = trainers.train_step()
    rollouts = [make_rollout(disk_root=trainers.weights_root, dtype="bfloat16") for _ in range(2)]
    result = publish(trainers, rollouts, (method,))
    assert result.version == version
    export = exported_state_dict(trainers.export(f"export-bf16-{method}-v{version}"))
    # The micro model's tensors are all floating point, the trainer's all fp32.
    fp32_bytes = sum(t.numel() * 4 for t in export.values())
    assert result.total_bytes == fp32_bytes
    assert [s.sent_bytes for s in result.servers] == [fp32_bytes // 2] * 2
    for r in rollouts:
        served = r.digests()
        for name, t in export.items():
            assert served[name] == tensor_digest(t.to(torch.bfloat16)), name


def test_a_fleet_serving_bf16_and_fp32_gets_one_fp32_copy_by_shared_memory(
    trainers: Trainers, make_rollout: MakeRollout
) -> None:
    """One copy serves every receiver of a method: when they serve different dtypes it goes
    in fp32, which each takes (the bf16 server rounds it on arrival)."""
    version = trainers.train_step()
    narrow = make_rollout(dtype="bfloat16")
    wide = make_rollout()
    result = publish(trainers, [narrow, wide], ("shared_memory",))
    assert result.version == version
    assert [s.sent_bytes for s in result.servers] == [result.total_bytes] * 2
    export = exported_state_dict(trainers.export(f"export-mixed-v{version}"))
    got_narrow, got_wide = narrow.digests(), wide.digests()
    for name, t in export.items():
        assert got_wide[name] == tensor_digest(t), name
        assert got_narrow[name] == tensor_digest(t.to(torch.bfloat16)), name
