"""Weights into vLLM and SGLang by every negotiated method (real vLLM, CPU build; real SGLang,
its CPU path).

Two real ``areal-trainer`` processes (FSDP2 over gloo, the built-in tiny model both serve)
train a step, then the coordinator's fleet update moves the weights by one method into a
rollout server on the engine. Every method lands (vLLM: through its layerwise reload in its
worker; SGLang: from files, or from the sender's gloo group, which it joins itself); greedy
tokens and log-probs must then equal an hf engine loaded from the trainer's own HF export.
With LoRA, only the adapters travel and vLLM serves them as a run-time adapter per version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from areal_servers.rollout.engine import SamplingConfig
from areal_servers.rollout.hf_engine import HFEngine
from areal_servers.rollout.sglang_engine import SGLangEngine
from areal_servers.rollout.vllm_engine import VLLMEngine
from peft import PeftModel

from areal_grpc.config import LoraSettings, ModelConfig, RolloutConfig, VllmSettings
from areal_grpc.model import load_model
from tests.support.sglang import SETTINGS as SGLANG_SETTINGS
from tests.support.weightsync import (
    MakeRollout,
    Rollout,
    Trainers,
    publish,
    start_trainers,
    stop_trainers,
)

TINY = "builtin:tiny"
SETTINGS = VllmSettings(kv_cache_gib=0.25, max_model_len=256, max_num_seqs=16)
LORA = LoraSettings(rank=4, alpha=8.0)
PROMPT = [5, 17, 42, 99, 7, 64, 128, 3]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True)
# vLLM's and SGLang's CPU kernels against transformers' eager fp32 forward.
LOGPROB_TOL = 2e-4


@pytest.fixture(scope="module")
def tiny_trainers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainers]:
    t = start_trainers(tmp_path_factory.mktemp("tiny-trainers"), model=TINY)
    yield t
    stop_trainers(t)


@pytest.fixture(scope="module")
def lora_trainers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainers]:
    t = start_trainers(
        tmp_path_factory.mktemp("tiny-lora-trainers"),
        model=TINY,
        extra=(f"model.lora.rank={LORA.rank}", f"model.lora.alpha={LORA.alpha}"),
    )
    yield t
    stop_trainers(t)


def vllm_rollout(make_rollout: MakeRollout, trainers: Trainers, **kw: object) -> Rollout:
    # A fatal engine failure would end a server process; here it is recorded and checked.
    fatal: list[str] = []
    engine = VLLMEngine(TINY, SETTINGS, **kw)  # type: ignore[arg-type]
    engine.on_death(fatal.append)
    rollout = make_rollout(disk_root=trainers.weights_root, engine=engine)
    rollout.fatal = fatal  # type: ignore[attr-defined]
    return rollout


def served_greedy(r: Rollout) -> tuple[list[int], list[float]]:
    async def run():
        return await r.engine.generate(PROMPT, GREEDY)

    result = r.server.call(run())
    return result.output_ids, result.output_logprobs


def hf_greedy(model_dir: str, model=None) -> tuple[list[int], list[float]]:
    async def run():
        engine = HFEngine(
            ModelConfig(source=model_dir), RolloutConfig(device="cpu", dtype="float32"), model=model
        )
        try:
            return await engine.generate(PROMPT, GREEDY)
        finally:
            await engine.close()

    result = asyncio.run(run())
    return result.output_ids, result.output_logprobs


def test_every_method_lands_in_vllm_and_it_serves_the_trained_weights(
    vllm_installed: None, tiny_trainers: Trainers, make_rollout: MakeRollout
) -> None:
    rollout = vllm_rollout(make_rollout, tiny_trainers)
    initial = served_greedy(rollout)
    for method in ("stream", "disk", "distributed", "socket", "shared_memory"):
        version = tiny_trainers.train_step()
        result = publish(tiny_trainers, [rollout], (method,))
        assert [s.method for s in result.servers] == [method]
        assert result.version == version
        # A version stored as files (disk, shared memory) is read by vLLM's worker from
        # them, and a broadcast lands in the worker itself; the others are written once for
        # it.
        wrote = rollout.engine.last_load_s[0]  # type: ignore[attr-defined]
        in_place = ("disk", "shared_memory", "distributed")
        assert (wrote == 0.0) == (method in in_place), (method, wrote)
        ids, logprobs = served_greedy(rollout)
        want_ids, want_logprobs = hf_greedy(str(tiny_trainers.export(f"{method}-v{version}")))
        assert ids == want_ids, method
        assert logprobs == pytest.approx(want_logprobs, abs=LOGPROB_TOL), method
    # The weights really moved.
    assert served_greedy(rollout)[1] != pytest.approx(initial[1], abs=1e-3)
    assert rollout.fatal == []  # type: ignore[attr-defined]


def test_every_method_lands_in_sglang_and_it_serves_the_trained_weights(
    sglang_installed: None, tiny_trainers: Trainers, make_rollout: MakeRollout
) -> None:
    deaths: list[str] = []
    engine = SGLangEngine(TINY, SGLANG_SETTINGS)
    engine.on_death(deaths.append)
    rollout = make_rollout(disk_root=tiny_trainers.weights_root, engine=engine)
    initial = served_greedy(rollout)
    for method in ("stream", "disk", "distributed", "socket", "shared_memory"):
        version = tiny_trainers.train_step()
        result = publish(tiny_trainers, [rollout], (method,))
        assert [s.method for s in result.servers] == [method]
        assert result.version == version
        ids, logprobs = served_greedy(rollout)
        export = tiny_trainers.export(f"sglang-{method}-v{version}")
        want_ids, want_logprobs = hf_greedy(str(export))
        assert ids == want_ids, method
        assert logprobs == pytest.approx(want_logprobs, abs=LOGPROB_TOL), method
    assert served_greedy(rollout)[1] != pytest.approx(initial[1], abs=1e-3)
    assert deaths == []


@pytest.mark.parametrize("method", ["stream", "disk"])
def test_a_lora_update_loads_as_a_vllm_adapter_and_serves_as_the_trainers_adapter_does(
    vllm_installed: None, lora_trainers: Trainers, make_rollout: MakeRollout, method: str
) -> None:
    rollout = vllm_rollout(make_rollout, lora_trainers, lora=LORA)
    base = served_greedy(rollout)
    for _ in range(2):
        # Two versions: the second replaces the first adapter, which vLLM then drops.
        version = lora_trainers.train_step()
        assert publish(lora_trainers, [rollout], (method,)).version == version
    export = lora_trainers.export(f"lora-{method}-v{version}")
    ids, logprobs = served_greedy(rollout)
    want_ids, want_logprobs = hf_greedy(
        TINY, model=PeftModel.from_pretrained(load_model(TINY), str(export))
    )
    assert ids == want_ids
    assert logprobs == pytest.approx(want_logprobs, abs=LOGPROB_TOL)
    assert logprobs != pytest.approx(base[1], abs=1e-4)
    # One adapter left in vLLM: the current version's.
    engine = rollout.engine
    assert isinstance(engine, VLLMEngine)
    rollout.server.call(engine.settle())
    loaded = rollout.server.call(engine._llm.list_loras())
    assert set(loaded) == {version}
