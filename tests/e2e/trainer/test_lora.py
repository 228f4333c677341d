"""LoRA on the trainer: only the adapters train and travel; FSDP2 over the frozen base
equals one plain process; exports hold the adapter (and the merged model on request)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from areal_servers.trainer.engine import TrainerEngine
from areal_servers.trainer.weight_publisher import published_tensors, tensor_metas
from peft import PeftModel

from areal_grpc.config import LoraSettings, ModelConfig, PPOSettings
from areal_grpc.model import load_model
from tests.support.trainer import MODEL, config, max_diff, params, rows_of, two_ranks

LORA = LoraSettings(rank=4, alpha=8.0)
POLICY = ModelConfig(source=MODEL, lora=LORA)


def lora_config(fsdp: bool, dtype: str = "float32", lr: float = 1e-2, **ppo: object):
    """The trainer section of these tests (the policy, POLICY, carries the adapters)."""
    cfg = config(fsdp=fsdp, dtype=dtype, lr=lr)
    if ppo:
        cfg.ppo = PPOSettings(**ppo)  # type: ignore[arg-type]
    return cfg


def adapters(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "lora_" in k}


def test_a_step_trains_the_adapters_only_and_publishes_only_them(make_batch):
    engine = TrainerEngine(lora_config(fsdp=False), POLICY)
    before = params(engine)
    # (seed 2's groups have equal rewards: no advantage, no gradient.)
    engine.train_step(make_batch(seed=1))
    engine.train_step(make_batch(seed=3))
    after = params(engine)
    base = [k for k in before if "lora_" not in k]
    assert base and all(torch.equal(before[k], after[k]) for k in base)
    # B starts at zero, so the first step moves only B; the second moves A through it.
    moved = [k for k in adapters(before) if not torch.equal(before[k], after[k])]
    assert moved == list(adapters(before))
    names = [n for n, _ in published_tensors(engine.model)]
    assert names == list(adapters(before))
    full = sum(p.numel() * p.element_size() for p in load_model(MODEL).parameters())
    lora = sum(m.nbytes for m in tensor_metas(engine.model))
    print(f"LoRA rank {LORA.rank} publishes {lora} of {full} bytes ({lora / full:.3%})")
    assert lora < 0.1 * full


def test_two_rank_fsdp_lora_steps_equal_one_plain_process(make_batch):
    batch1, batch2 = make_batch(seed=1), make_batch(seed=2)
    shards = [
        [rows_of(batch1, [0, 1, 2, 3, 4, 5]), rows_of(batch1, [6, 7])],
        [batch2, None],
    ]
    got = two_ranks(shards, lora_config(fsdp=True, dtype="float64"), POLICY)
    plain = TrainerEngine(lora_config(fsdp=False, dtype="float64"), POLICY)
    plain.train_step(batch1)
    plain.train_step(batch2)
    sharded = {k: torch.from_numpy(v) for k, v in got[0][1].items()}
    assert max_diff(sharded, params(plain)) <= 1e-9
    assert (
        max_diff(adapters(sharded), adapters(params(TrainerEngine(lora_config(False), POLICY)))) > 0
    )


def test_the_reference_policy_is_the_base_model_with_adapters_off(make_batch):
    """No second model is loaded: the KL term reads the policy with its adapters disabled,
    which is the initial policy (zero KL on the first step, a positive one after)."""
    engine = TrainerEngine(lora_config(fsdp=False, dtype="float64", kl_loss_coef=0.5), POLICY)
    assert engine.ref_model is None
    batch = make_batch(seed=3)
    assert engine.train_step(batch).extra["kl_loss_mean"] == pytest.approx(0.0, abs=1e-12)
    assert engine.train_step(batch).extra["kl_loss_mean"] > 0.0


def test_export_holds_the_adapter_and_on_request_the_merged_model(make_batch, tmp_path):
    merged = replace(POLICY, lora=replace(LORA, merged_export=True))
    engine = TrainerEngine(lora_config(fsdp=False), merged)
    engine.train_step(make_batch(seed=1))
    engine.train_step(make_batch(seed=3))
    out = tmp_path / "export"
    engine.export_hf(str(out))
    assert (out / "adapter_config.json").is_file()
    assert (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()  # the base is not duplicated
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    engine.model.eval()
    with torch.no_grad():
        want = engine.model(input_ids=ids).logits
        reloaded = PeftModel.from_pretrained(load_model(MODEL), str(out)).eval()
        merged = load_model(str(out / "merged")).eval()
        torch.testing.assert_close(reloaded(input_ids=ids).logits, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)
        # And the adapter did change the model.
        assert (load_model(MODEL)(input_ids=ids).logits - want).abs().max() > 1e-4


def test_a_lora_checkpoint_resumes_to_the_same_next_step(make_batch, tmp_path):
    """Adapters, their AdamW state and the version survive save/load: the restored engine's
    next step equals the original's."""
    a = TrainerEngine(lora_config(fsdp=False, dtype="float64"), POLICY)
    a.train_step(make_batch(seed=1))
    a.save_checkpoint(str(tmp_path / "ckpt"))
    b = TrainerEngine(lora_config(fsdp=False, dtype="float64"), POLICY)
    assert b.load_checkpoint(str(tmp_path / "ckpt"))[1] == a.version == 1
    assert max_diff(params(a), params(b)) == 0.0
    a.train_step(make_batch(seed=3))
    b.train_step(make_batch(seed=3))
    assert max_diff(params(a), params(b)) <= 1e-12
