"""The ``hf`` engine: logprob recompute, continuous batching, pause/resume, weights, cancel."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F
from areal_servers.rollout.engine import FinishReason, SamplingConfig, generate_resumable
from areal_servers.rollout.hf_engine import HFEngine, HFEngineConfig

from areal_grpc.errors import FieldError, PreconditionError
from areal_grpc.model import load_model


@pytest.fixture
def engine():
    # The engine is not bound to an event loop: each test's loop talks to its thread.
    eng = HFEngine(HFEngineConfig(model="builtin:micro", seed=0))
    yield eng
    asyncio.run(eng.close())


def recompute_logprobs(model, prompt, output, temperature):
    """Log-probs of ``output`` under one full forward of prompt + output."""
    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = F.log_softmax(logits / (temperature or 1.0), dim=-1)
    start = len(prompt) - 1
    return logp[start : start + len(output)].gather(1, torch.tensor(output)[:, None]).squeeze(1)


async def wait_for_tokens(engine, at_least):
    while engine.status().generated_tokens < at_least:
        await asyncio.sleep(0.001)


async def test_logprobs_match_full_forward_recompute_under_continuous_batching(engine):
    """Rows with different prompt lengths and sampling params join mid-decode; every returned
    logprob equals log_softmax(logits / T) of a full forward within 1e-4."""
    settings = [
        SamplingConfig(temperature=1.0, max_new_tokens=24, ignore_eos=True),
        SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=17, ignore_eos=True),
        SamplingConfig(temperature=1.3, top_k=20, max_new_tokens=9, ignore_eos=True),
        SamplingConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True),
    ]
    prompts = [[5 + i % 7 + j for j in range(1 + i % 6)] for i in range(12)]
    first = [
        asyncio.create_task(engine.generate(p, settings[i % 4])) for i, p in enumerate(prompts[:6])
    ]
    await wait_for_tokens(engine, 20)  # later requests join a batch that is already decoding
    later = [
        asyncio.create_task(engine.generate(p, settings[(i + 6) % 4]))
        for i, p in enumerate(prompts[6:])
    ]
    results = await asyncio.gather(*first, *later)
    for i, (prompt, res) in enumerate(zip(prompts, results, strict=True)):
        cfg = settings[i % 4]
        assert len(res.output_ids) == cfg.max_new_tokens
        assert res.finish_reason == FinishReason.LENGTH
        assert res.output_versions == [0] * cfg.max_new_tokens
        ref = recompute_logprobs(engine.model, prompt, res.output_ids, cfg.temperature)
        assert torch.allclose(ref, torch.tensor(res.output_logprobs), atol=1e-4), i


async def test_greedy_and_top_k_1_follow_the_argmax(engine):
    prompt = [10, 20, 30]
    greedy = await engine.generate(
        prompt, SamplingConfig(temperature=0, max_new_tokens=8, ignore_eos=True)
    )
    top1 = await engine.generate(
        prompt, SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=8, ignore_eos=True)
    )
    assert greedy.output_ids == top1.output_ids
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(engine.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert greedy.output_ids == ids[len(prompt) :]


async def test_a_short_request_is_not_blocked_by_a_long_one(engine):
    """Continuous batching: a request arriving mid-decode finishes while the long one runs."""
    long_cfg = SamplingConfig(max_new_tokens=400, ignore_eos=True)
    order: list[str] = []

    async def run(name, cfg):
        await engine.generate([7, 8, 9], cfg)
        order.append(name)

    long_task = asyncio.create_task(run("long", long_cfg))
    await wait_for_tokens(engine, 5)
    await run("short", SamplingConfig(max_new_tokens=3, ignore_eos=True))
    await long_task
    assert order == ["short", "long"]


async def test_stop_tokens_and_length(engine):
    greedy = await engine.generate(
        [3, 4, 5], SamplingConfig(temperature=0, max_new_tokens=6, ignore_eos=True)
    )
    stop_at = greedy.output_ids[2]
    first_hit = greedy.output_ids.index(stop_at)
    res = await engine.generate(
        [3, 4, 5],
        SamplingConfig(temperature=0, max_new_tokens=6, stop_token_ids=(stop_at,), ignore_eos=True),
    )
    assert res.finish_reason == FinishReason.STOP
    assert res.output_ids == greedy.output_ids[: first_hit + 1]
    assert greedy.finish_reason == FinishReason.LENGTH


async def test_n_samples_differ_and_are_reproducible_by_seed():
    async def sample(seed):
        eng = HFEngine(HFEngineConfig(model="builtin:micro", seed=seed))
        try:
            res = await eng.generate_n(
                [9, 9, 9], SamplingConfig(max_new_tokens=6, n_samples=4, ignore_eos=True)
            )
        finally:
            await eng.close()
        return [r.output_ids for r in res]

    a, b = await sample(0), await sample(0)
    assert a == b
    assert len({tuple(x) for x in a}) > 1


async def test_pause_interrupts_and_resume_continues_with_both_versions(engine):
    """Pause mid-generation, load version 1, resume: each sequence finishes its full budget,
    holding version-0 tokens then version-1 tokens; the resumed logprobs are the new model's."""
    cfg = SamplingConfig(max_new_tokens=150, ignore_eos=True)
    prompts = [[11, 12, 13 + i] for i in range(6)]
    tasks = [asyncio.create_task(generate_resumable(engine, p, cfg)) for p in prompts]
    await wait_for_tokens(engine, 6 * 10)
    interrupted = await engine.pause()
    assert interrupted == 6
    assert engine.status().paused
    new_model = load_model("builtin:micro", seed=1)
    await engine.load_weights(new_model.state_dict(), version=1)
    assert engine.version == 1
    await engine.resume()
    results = await asyncio.gather(*tasks)
    for prompt, res in zip(prompts, results, strict=True):
        assert len(res.output_ids) == 150 and res.finish_reason == FinishReason.LENGTH
        assert len(res.output_logprobs) == len(res.output_versions) == 150
        v = res.output_versions
        assert v == sorted(v) and v[0] == 0 and v[-1] == 1
        split = v.index(1)
        new_ref = recompute_logprobs(
            new_model, prompt + res.output_ids[:split], res.output_ids[split:], 1.0
        )
        assert torch.allclose(new_ref, torch.tensor(res.output_logprobs[split:]), atol=1e-4)


async def test_requests_submitted_while_paused_wait_for_resume(engine):
    await engine.pause()
    task = asyncio.create_task(engine.generate([5, 6], SamplingConfig(max_new_tokens=3)))
    while engine.status().queued == 0:
        await asyncio.sleep(0.001)
    assert not task.done()
    await engine.resume()
    res = await task
    assert res.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


async def test_load_weights_refuses_stale_versions_and_bad_state_dicts(engine):
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(PreconditionError):
        await engine.load_weights(before, version=0)
    bad = dict(before)
    bad["model.norm.weight"] = torch.zeros(3)
    bad["model.embed_tokens.weight"] = torch.zeros_like(before["model.embed_tokens.weight"])
    with pytest.raises(ValueError, match="shape"):
        await engine.load_weights(bad, version=5)
    assert engine.version == 0
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # Checkpoints omit the tied lm_head; that is accepted.
    sd = {
        k: v
        for k, v in load_model("builtin:micro", seed=3).state_dict().items()
        if k != "lm_head.weight"
    }
    await engine.load_weights(sd, version=2)
    assert engine.version == 2
    res = await engine.generate([4, 5], SamplingConfig(max_new_tokens=2, ignore_eos=True))
    assert res.output_versions == [2, 2]


async def test_cancelled_request_frees_its_slot_at_once():
    eng = HFEngine(HFEngineConfig(model="builtin:micro", max_running_requests=1))
    try:
        hog = asyncio.create_task(
            eng.generate([5, 6], SamplingConfig(max_new_tokens=500, ignore_eos=True))
        )
        await wait_for_tokens(eng, 3)
        hog.cancel()
        # With one slot, this finishes only if the cancelled request gave its slot back.
        res = await eng.generate([5, 6], SamplingConfig(max_new_tokens=2, ignore_eos=True))
        assert len(res.output_ids) == 2
        assert eng.status().generated_tokens < 500
        assert eng.status().running == 0
    finally:
        await eng.close()


@pytest.mark.parametrize(
    ("ids", "cfg", "field"),
    [
        ([], SamplingConfig(), "input_ids"),
        ([5, 384], SamplingConfig(), "input_ids[1]"),
        ([5], SamplingConfig(max_new_tokens=0), "sampling.max_new_tokens"),
        ([5], SamplingConfig(max_new_tokens=600), "sampling.max_new_tokens"),
        ([5], SamplingConfig(top_p=0.0), "sampling.top_p"),
        ([5], SamplingConfig(temperature=-1.0), "sampling.temperature"),
    ],
)
async def test_bad_requests_name_the_field(engine, ids, cfg, field):
    with pytest.raises(FieldError) as info:
        await engine.generate(ids, cfg)
    assert info.value.field == field
    assert (await engine.generate([5], SamplingConfig(max_new_tokens=1))).output_ids
