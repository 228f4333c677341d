"""The real pretrained model's test mesh: a trainer service beside a real rollout server, in
this process (:func:`serve_beside`, the ``serve`` fixture of tests/system/realmodel), and the
checks the hf and vLLM engines share: greedy RunEpisodes against ``generate``, served
log-probs against the trainer's recomputation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
import transformers
from areal_servers.rollout.engine import InferenceEngine
from areal_servers.rollout.hf_engine import HFEngine
from areal_servers.rollout.receive.base import ReceiverConfig
from areal_servers.rollout.service import RolloutServicer, item_to_struct
from areal_servers.rollout.weight_sync import build_weight_sync_service
from areal_servers.trainer.algorithm import trainable_mask
from areal_servers.trainer.engine import DistConfig, TrainerEngine
from areal_servers.trainer.publish.base import PublisherConfig
from areal_servers.trainer.service import TrainerService, TrainerServiceConfig
from arealgrpc.v1 import (
    common_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from arealgrpc.v1 import weight_sync_pb2 as wpb

from areal_grpc.batch import groups_to_batch
from areal_grpc.config import (
    ModelConfig,
    OptimizerSettings,
    RolloutConfig,
    TrainerConfig,
)
from areal_grpc.model import load_tokenizer
from areal_grpc.ports import free_port
from areal_grpc.server import BackgroundServer, service

REAL_MODEL = "smollm2-135m-instruct"


@dataclass
class Served:
    """A trainer service and a real rollout server (hf engine, RolloutService, WeightSync),
    each on its own loopback gRPC server."""

    rollout_engine: InferenceEngine
    weight_sync: Any
    servers: list[BackgroundServer]
    trainer_address: str
    rollout_address: str

    def close(self) -> None:
        """Stops both servers (the rollout side's engine and weight groups first)."""
        self.servers[1].call(self.weight_sync.close())
        self.servers[1].call(self.rollout_engine.close(), timeout_s=120)
        for s in self.servers:
            s.stop()


def serve_beside(
    trainer: TrainerService,
    model_dir: str,
    weights_root: Path,
    engine: InferenceEngine | None = None,
) -> Served:
    """Serves ``trainer`` beside a real rollout server of ``model_dir`` (an hf engine unless
    ``engine`` is given), each on its own loopback gRPC server."""
    engine = engine or HFEngine(
        ModelConfig(source=model_dir), RolloutConfig(device="cpu", dtype="float32")
    )
    ws = build_weight_sync_service(
        engine, ReceiverConfig(disk_root=str(weights_root), group_timeout_s=120)
    )
    rollout = RolloutServicer(engine, load_tokenizer(model_dir))
    servers = [
        BackgroundServer(
            [service(trainer, trainer_pb2_grpc.add_TrainerServiceServicer_to_server, trainer_pb2)]
        ),
        BackgroundServer(
            [
                service(
                    rollout, rollout_pb2_grpc.add_RolloutServiceServicer_to_server, rollout_pb2
                ),
                ws,
            ]
        ),
    ]
    trainer_address = servers[0].start().address
    rollout_address = servers[1].start().address
    # An engine with processes of its own (vllm) starts on the loop that serves it.
    servers[1].call(engine.start(), timeout_s=600)
    return Served(engine, ws.servicer, servers, trainer_address, rollout_address)


TIMEOUT = 300.0


# The ``serve`` fixture (tests/system/realmodel/conftest.py): (trainer service, model dir,
# weights root) -> Served.
Serve = Callable[[TrainerService, str, Path], Any]


SYSTEM = "You are a concise assistant. Answer in one short sentence."


# (user message, system prompt or None for the template's default one)
CHATS: list[tuple[str, str | None]] = [
    ("What is the capital of France?", None),
    ("How many legs does a spider have?", SYSTEM),
    ("Name the three primary colors.", None),
    ("Say hello in Spanish.", SYSTEM),
]


GREEDY_TOKENS = 12


def chat_ids(tokenizer, user: str, system: str | None) -> list[int]:
    """The prompt ids a user builds with the model's chat template (generation prompt on)."""
    messages = [{"role": "user", "content": user}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


class Mesh:
    """An FSDP2 trainer service (one gloo rank) and a rollout server, over loopback gRPC."""

    def __init__(self, model_dir: str, root: Path, serve: Serve) -> None:
        torch.set_num_threads(1)
        self.root = root
        self.trainer = TrainerService(
            TrainerServiceConfig(
                # fp32 compute: the tests compare with fp32 engines and references.
                trainer=TrainerConfig(
                    fsdp=True,
                    device="cpu",
                    mixed_precision="off",
                    optimizer=OptimizerSettings(lr=1e-4),
                ),
                model=ModelConfig(source=model_dir),
                distributed=True,
                dist=DistConfig("gloo", "127.0.0.1", free_port(), 0, 1, timeout_s=TIMEOUT),
                path_roots=(str(root / "trainer"),),
                weights=PublisherConfig(disk_root=str(root / "weights"), timeout_s=TIMEOUT),
            )
        )
        try:
            self.engine: TrainerEngine = self.trainer.wait_ready(TIMEOUT)
            self._start_rollout(model_dir, root, serve)
        except BaseException:
            self.trainer.close()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            raise

    def _start_rollout(self, model_dir: str, root: Path, serve: Serve) -> None:
        self.served = serve(self.trainer, model_dir, root / "weights")
        self.rollout = self.served.rollout_engine
        self.rollout_address = self.served.rollout_address
        trainer_address = self.served.trainer_address
        self.channels = [
            grpc.insecure_channel(trainer_address),
            grpc.insecure_channel(self.rollout_address),
        ]
        self.trainer_stub = trainer_pb2_grpc.TrainerServiceStub(self.channels[0])
        self.rollout_stub = rollout_pb2_grpc.RolloutServiceStub(self.channels[1])

    def train_step(self, groups: Sequence[common_pb2.TrajectoryGroup]) -> trainer_pb2.StepStats:
        messages = [
            trainer_pb2.TrainStepRequest(
                begin=trainer_pb2.StepBegin(
                    policy_version=self.engine.version, group_count=len(groups)
                )
            ),
            *(trainer_pb2.TrainStepRequest(group=g) for g in groups),
            trainer_pb2.TrainStepRequest(end=trainer_pb2.StepEnd()),
        ]
        *_, last = self.trainer_stub.TrainStep(iter(messages), timeout=TIMEOUT)
        return last.stats

    def run_episodes(
        self,
        chats: Sequence[tuple[str, str | None]],
        sampling: common_pb2.SamplingParams,
        group_size: int = 1,
    ) -> list[rollout_pb2.RunEpisodesResponse]:
        """One RLVR task per chat (chat template on), results in the order of ``chats``."""
        tasks = []
        for i, (user, system) in enumerate(chats):
            params = {"chat_template": "on", "reward_fn": "exact_match"}
            if system is not None:
                params["system_prompt"] = system
            task = rollout_pb2.EpisodeTask(
                task_id=f"chat-{i}",
                data=item_to_struct({"prompt": user, "answer": ""}),
                workflow="rlvr",
                workflow_params=item_to_struct(params),
                group_size=group_size,
                sampling=sampling,
            )
            tasks.append(rollout_pb2.RunEpisodesRequest(task=task))
        replies = list(self.rollout_stub.RunEpisodes(iter(tasks), timeout=TIMEOUT))
        by_id = {r.task_id: r for r in replies}
        assert sorted(by_id) == sorted(f"chat-{i}" for i in range(len(chats)))
        for r in replies:
            assert r.outcome == rollout_pb2.EPISODE_OUTCOME_ACCEPTED, r.reason
        return [by_id[f"chat-{i}"] for i in range(len(chats))]

    def close(self) -> None:
        for c in self.channels:
            c.close()
        self.served.close()
        self.trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def chat_group(tokenizer, task_id: str, version: int) -> common_pb2.TrajectoryGroup:
    """Two replies to one chat prompt, one rewarded: a GRPO group with a real gradient."""
    prompt = chat_ids(tokenizer, "What is the capital of France?", None)
    group = common_pb2.TrajectoryGroup(task_id=task_id, group_id=task_id)
    for reward, reply in ((1.0, "Paris."), (0.0, "I do not know.")):
        completion = [*tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_token_id]
        n, m = len(prompt), len(completion)
        group.trajectories.append(
            common_pb2.Trajectory(
                token_ids=prompt + completion,
                logprobs=[0.0] * n + [-1.0] * m,
                versions=[-1] * n + [version] * m,
                loss_mask=[False] * n + [True] * m,
                reward=reward,
                prompt_length=n,
                task_id=task_id,
                group_id=task_id,
            )
        )
    return group


def check_greedy_equals_generate(
    mesh: Mesh, tokenizer, reference: transformers.PreTrainedModel
) -> None:
    """Greedy RunEpisodes on CHATS equals ``reference.generate`` token for token."""
    assert mesh.rollout.version == 0, "this test compares against the initial checkpoint"
    sampling = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=GREEDY_TOKENS)
    replies = mesh.run_episodes(CHATS, sampling)
    eos = tokenizer.eos_token_id
    assert eos == 2 and tokenizer.eos_token == "<|im_end|>"
    compared = stops = 0
    for (user, system), reply in zip(CHATS, replies, strict=True):
        [traj] = reply.group.trajectories
        prompt = chat_ids(tokenizer, user, system)
        n = traj.prompt_length
        assert list(traj.token_ids[:n]) == prompt
        served = list(traj.token_ids[n:])
        with torch.no_grad():
            out = reference.generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=GREEDY_TOKENS,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        want = out[0, len(prompt) :].tolist()
        print(f"\n{user!r} -> {tokenizer.decode(served)!r}")
        assert served == want
        assert list(traj.versions[n:]) == [0] * len(served)
        assert all(traj.loss_mask[n:]) and not any(traj.loss_mask[:n])
        if served[-1] == eos:
            stops += 1
            assert traj.finish_reason == common_pb2.FINISH_REASON_STOP
        else:
            assert len(served) == GREEDY_TOKENS
            assert traj.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert eos not in served[:-1]
        compared += len(served)
    print(f"greedy: {compared} tokens compared, {stops} of {len(CHATS)} stopped at eos")


def check_logprobs_equal_recomputation(mesh: Mesh, tokenizer, tolerance: float) -> float:
    """Publishes the trainer's weights (training a step first when needed), samples CHATS,
    and checks the served log-probs against the trainer's own; the largest difference."""
    engine = mesh.engine
    if engine.version <= mesh.rollout.version:
        # Run on its own (no earlier step here): train one, so a new version is published.
        mesh.train_step([chat_group(tokenizer, "g1", engine.version)])
    reply = mesh.trainer_stub.PublishWeights(
        trainer_pb2.PublishWeightsRequest(
            rollout_addresses=[mesh.rollout_address], methods=[wpb.TRANSFER_METHOD_STREAM]
        ),
        timeout=TIMEOUT,
    )
    [target] = reply.results
    assert target.status.code == 0, target.status
    version = engine.version
    assert target.policy_version == version == mesh.rollout.version

    sampling = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=16)
    replies = mesh.run_episodes(CHATS[:3], sampling, group_size=4)
    groups = [r.group for r in replies]
    for g in groups:
        for t in g.trajectories:
            assert set(t.versions[t.prompt_length :]) == {version}

    batch = groups_to_batch(groups, pad_token_id=engine.pad_token_id, vocab_size=engine.vocab_size)
    mask = trainable_mask(batch["loss_mask"], batch["attention_mask"])
    assert engine.temperature == 1.0
    with torch.no_grad():
        recomputed, _ = engine._forward_logprobs(
            engine.model,
            {
                "input_ids": batch["input_ids"],
                "attention_mask": batch["attention_mask"],
                "train_mask": mask,
            },
        )
    tokens = int(mask.sum())
    expected = sum(len(t.token_ids) - t.prompt_length for g in groups for t in g.trajectories)
    assert tokens == expected > 0
    served = batch["logprobs"][mask]
    diff = float((recomputed[mask] - served).abs().max())
    print(f"\nlogprobs: {tokens} sampled tokens, max abs diff {diff:.3e}")
    assert torch.isfinite(served).all() and (served <= 0).all()
    assert diff < tolerance
    return diff
