"""Real-scale correctness on the real model (SmolLM2-135M-Instruct: llama, tied embeddings).

One module-wide mesh, all in this process and all real: a trainer service whose engine shards
the model with FSDP2 (``fully_shard`` per decoder layer and at the root, a one-rank gloo
process group on loopback) and a rollout server (the ``hf`` engine behind RolloutService and
WeightSync), each served over real gRPC on loopback. The tests check what a user relies on:

1. a trained FSDP2 model exports (ExportModel) to a directory that
   ``AutoModelForCausalLM.from_pretrained`` reloads with the trainer's exact weights and
   logits, its output layer still tied to its embeddings;
2. greedy RunEpisodes on chat prompts equals ``model.generate(do_sample=False)`` token for
   token, from exactly the prompt ids the model's own chat template gives;
3. the log-probs the rollout server reports for sampled tokens equal the trainer's own
   recomputation (the values decoupled PPO's importance weights are built from).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import transformers
from areal_servers.rollout.service import item_to_struct
from areal_servers.trainer.algorithm import trainable_mask
from areal_servers.trainer.engine import DistConfig, TrainerEngine
from areal_servers.trainer.publish.base import PublisherConfig
from areal_servers.trainer.service import TrainerService, TrainerServiceConfig
from arealgrpc.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from arealgrpc.v1 import weight_sync_pb2 as wpb
from torch.distributed.tensor import DTensor

from areal_grpc.batch import groups_to_batch
from areal_grpc.config import ModelConfig, OptimizerSettings, TrainerConfig
from areal_grpc.model import load_tokenizer
from areal_grpc.ports import free_port

TIMEOUT = 300.0
# The ``serve`` fixture (conftest.py): (trainer service, model dir, weights root) -> Served.
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
                trainer=TrainerConfig(
                    fsdp=True, device="cpu", optimizer=OptimizerSettings(lr=1e-4)
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


@pytest.fixture(scope="module")
def mesh(
    real_model_dir: str, tmp_path_factory: pytest.TempPathFactory, serve: Serve
) -> Iterator[Mesh]:
    m = Mesh(real_model_dir, tmp_path_factory.mktemp("real-correctness"), serve)
    yield m
    m.close()


@pytest.fixture(scope="module")
def tokenizer(real_model_dir: str):
    return load_tokenizer(real_model_dir)


@pytest.fixture(scope="module")
def reference(real_model_dir: str) -> transformers.PreTrainedModel:
    """The initial checkpoint as a user loads it."""
    model = transformers.AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)
    return model.eval()


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


def test_fsdp2_trained_tied_model_exports_to_an_identical_hf_reload(
    mesh: Mesh, tokenizer, reference: transformers.PreTrainedModel
) -> None:
    """A GRPO step under FSDP2, ExportModel, then ``from_pretrained`` gives the trainer's model.

    Guards against: FSDP2 untying lm_head from embed_tokens while sharding (the two would then
    train apart, and the tied reload would silently drop the head's updates); an export that
    writes the initial or a partially gathered (sharded) state dict; a config that loses
    ``tie_word_embeddings``; an export path outside the trainer's root.
    """
    engine = mesh.engine
    model = engine.model
    # FSDP2 is really applied: parameters are DTensors, and the tie survived the sharding.
    assert isinstance(model.model.embed_tokens.weight, DTensor)
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert engine.world_size == 1 and engine.backend == "gloo"

    # Cloned: on one CPU rank, FSDP's full state dict aliases the live parameters.
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    stats = mesh.train_step([chat_group(tokenizer, "g0", engine.version)])
    assert stats.policy_version == engine.version == 1
    assert stats.trained_tokens > 0 and stats.grad_norm > 0
    after = engine.full_state_dict()
    changed = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert changed > 1e-5, "the step left the weights as they were"
    emb_change = float(
        (after["model.embed_tokens.weight"] - before["model.embed_tokens.weight"]).abs().max()
    )
    assert emb_change > 0, "the tied embedding did not train"
    if "lm_head.weight" in after:
        assert torch.equal(after["lm_head.weight"], after["model.embed_tokens.weight"])

    reply = mesh.trainer_stub.ExportModel(
        trainer_pb2.ExportModelRequest(path="export/step-1"), timeout=TIMEOUT
    )
    exported = Path(reply.path)
    assert exported == (mesh.root / "trainer" / "export" / "step-1").resolve()
    assert reply.policy_version == 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    reloaded.eval()
    assert reloaded.config.tie_word_embeddings is True
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    got = reloaded.state_dict()
    assert set(got) == set(after)
    mismatched = [k for k in after if not torch.equal(got[k], after[k])]
    assert not mismatched, f"reloaded tensors differ from the trainer's: {mismatched[:5]}"
    # The exported tokenizer renders the same chat prompts.
    prompt = chat_ids(tokenizer, *CHATS[1])
    assert chat_ids(load_tokenizer(str(exported)), *CHATS[1]) == prompt

    ids = torch.tensor([prompt])
    with torch.no_grad():
        trainer_logits = model(input_ids=ids, use_cache=False).logits
        reload_logits = reloaded(input_ids=ids, use_cache=False).logits
        initial_logits = reference(input_ids=ids, use_cache=False).logits
    diff = float((trainer_logits - reload_logits).abs().max())
    moved = float((trainer_logits - initial_logits).abs().max())
    print(f"\nexport: reload vs trainer logits max abs diff {diff:.3e}; vs initial {moved:.3e}")
    assert diff < 1e-5
    assert moved > 1e-3, "the exported model's logits are the initial model's"


def test_greedy_run_episodes_equals_hf_generate_on_chat_prompts(
    mesh: Mesh, tokenizer, reference: transformers.PreTrainedModel
) -> None:
    """Greedy RunEpisodes (temperature 0, chat template on) equals ``generate(do_sample=False)``.

    Guards against: a chat prompt rendered differently from the model's own template (a
    missing generation prompt, a lost system prompt, an added BOS); wrong positions or masks
    in the continuous-batching KV cache (left padding, rows joining mid-decode); a sampler
    that is not argmax at temperature 0; not stopping at the end-of-turn token.
    """
    check_greedy_equals_generate(mesh, tokenizer, reference)


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


def test_rollout_logprobs_equal_the_trainers_recomputation(mesh: Mesh, tokenizer) -> None:
    """Sampled (temperature 1) log-probs from RunEpisodes equal the trainer's recomputation.

    After PublishWeights brings the rollout server to the trainer's version, the log-prob the
    server reports for each sampled token must equal the one the FSDP2 trainer computes for
    it from the same trajectory (its batch assembly, padding, masks and forward path).
    Guards against: behaviour log-probs taken before temperature or after top-p truncation,
    from the wrong position, or from stale weights; KV-cache drift in long batched decodes;
    a trainer forward that misaligns tokens and predictions or mishandles padding — any of
    which biases decoupled PPO's importance weights.
    """
    check_logprobs_equal_recomputation(mesh, tokenizer, tolerance=1e-3)


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
