"""Precision by hardware (``rollout.dtype``): what ``auto`` picks, and the hf engine in bf16."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F
from areal_servers.rollout.engine import SamplingConfig
from areal_servers.rollout.hf_engine import HFEngine

from areal_grpc import precision
from areal_grpc.config import ModelConfig, RolloutConfig
from areal_grpc.model import load_model
from areal_grpc.precision import bf16_units, choose_dtype
from tests.support.precision import bf16_logprob_tol


@pytest.mark.parametrize(
    ("flags", "units"),
    [
        ({"avx512f", "amx_tile", "amx_bf16", "avx512_bf16"}, "AMX-BF16"),
        ({"avx512f", "avx512_bf16"}, "AVX512-BF16"),
        ({"avx2", "avx512f"}, None),
    ],
)
def test_auto_is_bf16_exactly_where_the_cpu_has_bf16_units(monkeypatch, flags, units):
    # The CPU's flags stand for the hardware (the machine has one answer).
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset(flags))
    assert bf16_units("cpu") == units
    dtype, why = choose_dtype("auto", "cpu")
    assert dtype == ("bfloat16" if units else "float32")
    assert why == (
        f"auto: this CPU has {units}" if units else "auto: this CPU has no fast bf16 units"
    )
    # An explicit dtype is taken as set, whatever the hardware.
    for name in ("float32", "bfloat16", "float16"):
        assert choose_dtype(name, "cpu") == (name, "as set")


def test_the_cpu_flags_are_the_ones_torch_finds():
    flags = precision.cpu_flags()
    assert ("avx512_bf16" in flags) == torch.cpu._is_avx512_bf16_supported()
    assert ("amx_tile" in flags) == torch.cpu._is_amx_tile_supported()


def test_auto_on_a_machine_without_cuda_picks_fp32_for_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: its answer is the GPU's")
    assert bf16_units("cuda") is None
    assert choose_dtype("auto", "cuda")[0] == "float32"


def forward_logprobs(model, prompt: list[int], output: list[int]) -> tuple[torch.Tensor, float]:
    """Log-probs of ``output`` under one full forward (float32 softmax of the model's logits),
    and the largest logit's magnitude."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = F.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(1, torch.tensor(output)[:, None])[:, 0], float(logits.abs().max())


def test_the_hf_engine_serves_bf16_with_fp32_logprobs_and_updates_rounded_to_it():
    """rollout.dtype=bfloat16: the engine's weights are bf16 (a float32 update lands as its
    bf16 rounding), and its log-probs are float32 log_softmax of its bf16 logits."""
    prompt = [5, 17, 42, 99, 7, 64]
    params = SamplingConfig(temperature=1.0, max_new_tokens=24, ignore_eos=True)

    async def run():
        engine = HFEngine(
            ModelConfig(source="builtin:micro", seed=0),
            RolloutConfig(device="cpu", dtype="bfloat16"),
        )
        try:
            assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
            before = await asyncio.gather(*[engine.generate(prompt, params) for _ in range(4)])
            new = load_model("builtin:micro", seed=1).state_dict()
            await engine.load_weights(new, version=1)
            for name, t in engine.model.state_dict().items():
                assert torch.equal(t, new[name].to(torch.bfloat16)), name
            after = await engine.generate(prompt, params)
            return before, after
        finally:
            await engine.close()

    before, after = asyncio.run(run())
    for seed, results in ((0, before), (1, [after])):
        model = load_model("builtin:micro", seed=seed, dtype=torch.bfloat16).eval()
        for res in results:
            logprobs = torch.tensor(res.output_logprobs)
            # float32 arithmetic, not bf16 values: almost none is a bf16 number.
            assert (logprobs.to(torch.bfloat16).float() != logprobs).float().mean() > 0.5
            ref, max_logit = forward_logprobs(model, prompt, res.output_ids)
            # The cached decode and the full forward round their bf16 activations at other
            # places.
            tol = bf16_logprob_tol(max_logit)
            assert (logprobs - ref).abs().max() <= tol, ((logprobs - ref).abs().max(), tol)
