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

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from arealgrpc.v1 import trainer_pb2
from torch.distributed.tensor import DTensor

from areal_grpc.model import load_tokenizer
from tests.support.realmodel import (
    CHATS,
    TIMEOUT,
    Mesh,
    Serve,
    chat_group,
    chat_ids,
    check_greedy_equals_generate,
    check_logprobs_equal_recomputation,
)


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
