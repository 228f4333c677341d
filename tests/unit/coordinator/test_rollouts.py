"""The samples a run writes to ``rollouts/`` (and to TensorBoard): their advantage is the
trainer's, their text the tokenizer's, and with output.tensorboard they can be read back from
the event file (the run that writes them: tests/e2e/coordinator/test_run.py)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from areal_servers.trainer.algorithm import compute_advantages, trainable_mask
from arealgrpc.v1 import common_pb2
from transformers import ByT5Tokenizer

from areal_grpc.config import NormSettings, PPOSettings
from areal_grpc.coordinator.metrics import MetricsWriter
from areal_grpc.coordinator.pool import Finished, Work
from areal_grpc.coordinator.rollouts import RolloutLog, sequence_advantages, text_decoder


def _batch(seed: int) -> list[Finished]:
    """Groups of 1 to 4 samples of varied prompt and completion lengths and rewards."""
    rng = random.Random(seed)
    out = []
    for g in range(5):
        group = common_pb2.TrajectoryGroup(task_id=f"t{g}", group_id=f"t{g}")
        prompt = [rng.randrange(3, 259) for _ in range(rng.randint(1, 4))]
        for _ in range(rng.randint(1, 4)):
            completion = [rng.randrange(3, 259) for _ in range(rng.randint(1, 9))]
            n, k = len(prompt), len(completion)
            group.trajectories.add(
                token_ids=prompt + completion,
                logprobs=[0.0] * n + [-1.0] * k,
                versions=[-1] * n + [0] * k,
                loss_mask=[False] * n + [True] * k,
                reward=rng.choice([0.0, 0.5, 1.0, rng.uniform(-3, 3)]),
                prompt_length=n,
                task_id=f"t{g}",
                group_id=f"t{g}",
            )
        out.append(Finished(Work(g, f"t{g}"), group, 0, 0))
    return out


def _trainers(batch: list[Finished], ppo: PPOSettings) -> list[float]:
    """Each trajectory's advantage as the trainer computes it (its first trained token's)."""
    rows = [t for f in batch for t in f.group.trajectories]
    width = max(len(t.token_ids) for t in rows)
    loss = torch.zeros(len(rows), width, dtype=torch.bool)
    attention = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, t in enumerate(rows):
        loss[i, : len(t.loss_mask)] = torch.tensor(list(t.loss_mask))
        attention[i, : len(t.token_ids)] = True
    groups = torch.tensor([g for g, f in enumerate(batch) for _ in f.group.trajectories])
    mask = trainable_mask(loss, attention)
    rewards = torch.tensor([t.reward for t in rows])
    adv = compute_advantages(rewards, mask, ppo, group_index=groups)
    return [float(adv[i][mask[i]][0]) for i in range(len(rows))]


GROUP = NormSettings(mean_level="group", std_level="group")
BATCH = NormSettings(mean_level="batch", std_level="batch")
SETTINGS = {
    "grpo": PPOSettings(),
    "batch": PPOSettings(reward_norm=BATCH),
    "leave-one-out, biased std": PPOSettings(
        reward_norm=NormSettings(mean_level="group", std_level="none", mean_leave1out=True)
    ),
    "dr.grpo": PPOSettings(reward_norm=NormSettings(mean_level="group", std_level="none")),
    "token norm": PPOSettings(reward_norm=GROUP, adv_norm=BATCH),
    "group token norm": PPOSettings(
        reward_norm=NormSettings(mean_level="none", std_level="none"),
        adv_norm=NormSettings(mean_level="group", std_level="batch", std_unbiased=False),
    ),
    "shaped, overlong": PPOSettings(
        reward_bias=-0.5,
        reward_scale=3.0,
        reward_clip=2.0,
        overlong_max_len=6,
        overlong_cache=3,
        overlong_factor=2.0,
    ),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_samples_advantage_is_the_trainers(name: str) -> None:
    ppo = SETTINGS[name]
    for seed in range(4):
        batch = _batch(seed)
        ours = [a for group in sequence_advantages(batch, ppo) for a in group]
        assert ours == pytest.approx(_trainers(batch, ppo), abs=1e-4), (name, seed)


def test_with_a_kl_penalty_the_advantage_is_per_token_and_left_out() -> None:
    batch = _batch(0)
    kl = dataclasses.replace(PPOSettings(), kl_ctl=0.1)
    assert all(a is None for group in sequence_advantages(batch, kl) for a in group)


def test_the_builtin_models_text_is_the_tokenizers() -> None:
    decode = text_decoder("builtin:micro")
    assert decode is not None
    tokenizer = ByT5Tokenizer()
    rng = random.Random(0)
    cases = [[0, 1, 2, 3 + 72, 3 + 105, 259, 383], [3 + 0xE2, 3 + 0x82], list(b"\xe2\x82\xac")]
    cases += [[rng.randrange(384) for _ in range(rng.randint(0, 30))] for _ in range(200)]
    for ids in cases:
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=False), ids


def test_a_step_writes_its_first_groups_with_text_and_advantage(tmp_path: Path) -> None:
    batch = _batch(1)
    log = RolloutLog(tmp_path, 2, 1.0, ppo=PPOSettings(), model_source="builtin:micro")
    records = log.write(3, 3, batch)
    assert len(records) == sum(len(f.group.trajectories) for f in batch[:2])
    assert (tmp_path / "rollouts" / "step-000003.jsonl").read_text().count("\n") == len(records)
    tokenizer = ByT5Tokenizer()
    whole = [a for group in sequence_advantages(batch, PPOSettings()) for a in group]
    for r, advantage in zip(records, whole, strict=False):
        assert r["completion"] == tokenizer.decode(r["completion_ids"], skip_special_tokens=False)
        assert r["prompt"] == tokenizer.decode(r["prompt_ids"], skip_special_tokens=False)
        assert r["advantage"] == pytest.approx(advantage, abs=1e-6)


def test_with_tensorboard_a_steps_samples_are_text_in_the_event_file(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="output.tensorboard needs the tensorboard package")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    batch = _batch(2)
    log = RolloutLog(tmp_path, 1, 1.0, ppo=PPOSettings(), model_source="builtin:micro")
    writer = MetricsWriter(tmp_path, tensorboard=True)
    records = log.write(4, 4, batch)
    writer.log_samples(4, records)
    writer.log("train", 5, {"reward_mean": 0.5})
    writer.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert "train/reward_mean" in events.Tags()["scalars"]
    (text,) = events.Tensors("samples/text_summary")
    # Shown at the step of the scalars it was trained in, with each sample's reply.
    assert text.step == 5
    shown = text.tensor_proto.string_val[0].decode()
    first = records[0]
    assert f"{first['task_id']} #0" in shown and f"reward {first['reward']:g}" in shown
    for r in records:
        for line in r["completion"].splitlines() or [r["completion"]]:
            assert line.strip() in shown
