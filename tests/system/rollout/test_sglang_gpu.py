"""The ``sglang`` engine against a real SGLang server: runs only where sglang and a GPU exist."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from areal_servers.rollout.engine import FinishReason, SamplingConfig, generate_resumable
from areal_servers.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig

from areal_grpc.model import load_model, load_tokenizer, save_pretrained

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None,
        reason="needs a CUDA GPU (and -m gpu) and the sglang package",
    ),
]


async def test_real_sglang_generates_pauses_and_loads_weights(tmp_path):
    model_dir = tmp_path / "tiny"
    save_pretrained(load_model("builtin:tiny"), load_tokenizer("builtin:tiny"), model_dir)
    engine = SGLangEngine(
        SGLangEngineConfig(
            model=str(model_dir),
            launch=True,
            launch_port=30123,
            launch_args=["--skip-tokenizer-init", "--mem-fraction-static", "0.3"],
            weights_dir=str(tmp_path / "weights"),
        )
    )
    try:
        await engine.start()
        res = await generate_resumable(
            engine, [5, 6, 7], SamplingConfig(max_new_tokens=8, ignore_eos=True)
        )
        assert len(res.output_ids) == 8 and res.finish_reason == FinishReason.LENGTH
        assert all(lp <= 0 for lp in res.output_logprobs)
        await engine.pause()
        await engine.load_weights(load_model("builtin:tiny", seed=1).state_dict(), version=1)
        await engine.resume()
        res = await engine.generate([5, 6], SamplingConfig(max_new_tokens=2, ignore_eos=True))
        assert res.output_versions == [1, 1]
    finally:
        await engine.close()
