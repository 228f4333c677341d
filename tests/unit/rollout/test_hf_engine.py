"""The ``hf`` engine: logprob recompute, continuous batching, pause/resume, weights, cancel."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
import torch
import torch.nn.functional as F
from areal_servers.rollout.engine import FinishReason, SamplingConfig, generate_resumable
from areal_servers.rollout.hf_engine import HFEngine

from areal_grpc.config import ModelConfig, RolloutConfig
from areal_grpc.errors import FieldError, PreconditionError
from areal_grpc.model import load_model


def fp32(**rollout) -> RolloutConfig:
    """The rollout section in float32: these tests compare with fp32 forwards at 1e-4 (bf16
    serving: tests/unit/rollout/test_precision.py)."""
    return RolloutConfig(dtype="float32", **rollout)


@pytest.fixture
def engine():
    # The engine is not bound to an event loop: each test's loop talks to its thread.
    eng = HFEngine(ModelConfig(source="builtin:micro", seed=0), fp32())
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
        eng = HFEngine(ModelConfig(source="builtin:micro", seed=seed), fp32())
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


async def test_a_seeded_request_repeats_on_one_engine_whatever_else_it_sampled(engine):
    """A request's seed fixes its own sampling stream: the same seed on the same engine gives
    the same tokens even after other (unseeded) requests drew from the engine's stream;
    sample i of a seeded n gets seed + i."""
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=7)
    first = (await engine.generate([5, 6, 7], cfg)).output_ids
    await engine.generate([1, 2], SamplingConfig(max_new_tokens=5, ignore_eos=True))
    again = (await engine.generate([5, 6, 7], cfg)).output_ids
    other = (await engine.generate([5, 6, 7], cfg.with_updates(seed=8))).output_ids
    assert first == again and first != other
    group = await engine.generate_n([5, 6, 7], cfg.with_updates(n_samples=2))
    assert [g.output_ids for g in group] == [first, other]


async def test_top_logprobs_rank_the_alternatives_of_each_token(engine):
    """top_logprobs=k: per generated token, the k most likely tokens of the sampling
    distribution, most likely first; greedy, the sampled token is the first of them."""
    greedy = await engine.generate(
        [5, 6, 7], SamplingConfig(temperature=0, max_new_tokens=6, top_logprobs=3)
    )
    assert len(greedy.output_top) == len(greedy.output_ids) == 6
    for tok, lp, (ids, lps) in zip(
        greedy.output_ids, greedy.output_logprobs, greedy.output_top, strict=True
    ):
        assert len(ids) == 3 and lps == sorted(lps, reverse=True)
        assert ids[0] == tok and lps[0] == pytest.approx(lp)
    sampled = await engine.generate([5, 6, 7], SamplingConfig(max_new_tokens=6, top_logprobs=2))
    assert all(
        lp <= lps[0] + 1e-6
        for lp, (_, lps) in zip(sampled.output_logprobs, sampled.output_top, strict=True)
    )
    plain = await engine.generate([5, 6, 7], SamplingConfig(max_new_tokens=2))
    assert plain.output_top == []
    with pytest.raises(FieldError, match="top_logprobs"):
        SamplingConfig(top_logprobs=21).validate()


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


async def test_pause_without_waiting_interrupts_before_a_weight_swap_takes_effect(engine):
    """pause(wait=False) returns with the running count while a step may still be decoding; a
    swap right after it still ends those requests on the old weights first: every token after
    the version split matches the new model recomputed over the whole prefix (a step on the
    new weights over the old KV cache would not)."""
    cfg = SamplingConfig(max_new_tokens=120, ignore_eos=True)
    prompts = [[21, 22, 23 + i] for i in range(5)]
    for round_ in range(2):  # the step in progress at the pause differs from round to round
        new_model = load_model("builtin:micro", seed=3 + round_)
        tasks = [asyncio.create_task(generate_resumable(engine, p, cfg)) for p in prompts]
        await wait_for_tokens(engine, (round_ * 120 + 8) * len(prompts))
        assert await engine.pause(wait=False) == len(prompts)
        assert engine.status().paused
        await engine.load_weights(new_model.state_dict(), version=round_ + 1)
        await engine.resume()
        results = await asyncio.gather(*tasks)
        for prompt, res in zip(prompts, results, strict=True):
            v = res.output_versions
            assert len(res.output_ids) == 120 and v == sorted(v)
            assert v[0] == round_ and v[-1] == round_ + 1
            split = v.index(round_ + 1)
            new_ref = recompute_logprobs(
                new_model, prompt + res.output_ids[:split], res.output_ids[split:], 1.0
            )
            assert torch.allclose(new_ref, torch.tensor(res.output_logprobs[split:]), atol=1e-4)


class _WatchedLock:
    """A reentrant lock that counts the threads waiting for it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._count = threading.Lock()  # two threads may enter at once: no lost update
        self.waiting = 0

    def __enter__(self) -> None:
        with self._count:
            self.waiting += 1
        self._lock.acquire()
        with self._count:
            self.waiting -= 1

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


async def test_a_swap_that_overtakes_the_decode_loop_still_interrupts_first(engine):
    """The race pause(wait=False) opens: the decode loop has passed its pause check and waits
    for the model, a swap takes the model first. The swap must end the batch's requests on
    the old weights, or the loop's step would run the new weights over the old KV cache."""
    lock = _WatchedLock()
    engine._model_lock = lock  # the decode loop takes it afresh each step
    cfg = SamplingConfig(max_new_tokens=60, ignore_eos=True)
    prompts = [[31, 32, 33 + i] for i in range(4)]
    new_model = load_model("builtin:micro", seed=9)
    tasks = [asyncio.create_task(generate_resumable(engine, p, cfg)) for p in prompts]
    await wait_for_tokens(engine, 8 * len(prompts))
    held, swap = threading.Event(), threading.Event()

    def overtake() -> None:
        with lock:  # the loop ends its step, passes its pause check, then waits here
            held.set()
            swap.wait()
            engine._load_blocking(new_model.state_dict(), 1)

    worker = asyncio.create_task(asyncio.to_thread(overtake))
    await asyncio.to_thread(held.wait)
    while lock.waiting == 0:
        await asyncio.sleep(0.001)
    assert await engine.pause(wait=False) == len(prompts)
    swap.set()
    await worker
    await engine.resume()
    for prompt, res in zip(prompts, await asyncio.gather(*tasks), strict=True):
        v = res.output_versions
        assert len(res.output_ids) == 60 and v == sorted(v) and v[0] == 0 and v[-1] == 1
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
    eng = HFEngine(ModelConfig(source="builtin:micro"), fp32(max_running_requests=1))
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


# --------------------------------------------------------------------- decode-loop races


def _hook_prefill(eng, before):
    """Runs ``before(admitted)`` in the decode thread when requests leave the queue for their
    prefill, i.e. after admission and before their first token is sampled."""
    orig = eng._scheduler.prefill

    def prefill(admitted, version):
        before(admitted)
        return orig(admitted, version)

    eng._scheduler.prefill = prefill


async def test_request_cancelled_during_its_prefill_does_not_break_the_decode_loop():
    """Regression: a request cancelled after admission but before its first token was sampled
    kept ``pending_token == -1`` and still joined the batch; the decode step of the same round
    fed -1 to the embedding (IndexError: index out of range in self) and killed the loop."""
    eng = HFEngine(ModelConfig(source="builtin:micro"), fp32(max_running_requests=8))
    loop = asyncio.get_running_loop()
    try:
        hog = asyncio.create_task(
            eng.generate([5, 6], SamplingConfig(max_new_tokens=60, ignore_eos=True))
        )
        await wait_for_tokens(eng, 3)
        victim: asyncio.Task | None = None

        def cancel_victim(admitted):
            for req in admitted:
                if len(req.prompt) == 4:
                    # What the stream's ``finally`` does when its consumer goes away.
                    eng._scheduler.cancel(req)
                    loop.call_soon_threadsafe(victim.cancel)

        _hook_prefill(eng, cancel_victim)
        victim = asyncio.create_task(
            eng.generate([1, 2, 3, 4], SamplingConfig(max_new_tokens=5, ignore_eos=True))
        )
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(victim, 30)
        hog_res = await asyncio.wait_for(hog, 60)
        assert hog_res.finish_reason == FinishReason.LENGTH and len(hog_res.output_ids) == 60
        # The loop is alive: new requests are served.
        again = await asyncio.wait_for(
            eng.generate([7], SamplingConfig(max_new_tokens=3, ignore_eos=True)), 30
        )
        assert len(again.output_ids) == 3
    finally:
        await eng.close()


async def _stress(eng, caplog, *, n_clients: int, seconds: float, seed: int) -> None:
    """Concurrent generate/stream calls (random budgets, stop tokens, sampling params), random
    cancels, pause/load_weights/resume cycles every few ms, then close() with work in flight."""
    import logging
    import random

    caplog.set_level(logging.ERROR, logger="areal_servers.rollout.hf_engine")
    rng = random.Random(seed)
    weights = [
        {k: v.clone() for k, v in load_model("builtin:micro", seed=s).state_dict().items()}
        for s in (1, 2)
    ]
    stop = asyncio.Event()
    seen = {"finished": 0, "cancelled": 0, "tokens": 0}

    def check(ids):
        assert all(0 <= t < eng.vocab_size for t in ids), ids
        seen["tokens"] += len(ids)

    async def client(i: int) -> None:
        r = random.Random(seed * 1000 + i)
        while not stop.is_set():
            prompt = [r.randrange(eng.vocab_size) for _ in range(r.randint(1, 6))]
            cfg = SamplingConfig(
                temperature=r.choice([0.0, 0.7, 1.0, 1.5]),
                top_p=r.choice([1.0, 0.9, 0.3]),
                top_k=r.choice([0, 1, 5]),
                max_new_tokens=r.randint(1, 24),
                stop_token_ids=tuple(r.randrange(eng.vocab_size) for _ in range(r.randint(0, 20))),
                ignore_eos=r.random() < 0.5,
            )
            mode = r.random()
            try:
                if mode < 0.3:
                    task = asyncio.create_task(eng.generate(prompt, cfg))
                    # Mostly soon after submission: while queued, admitted or prefilling.
                    await asyncio.sleep(r.choice([0.0, 0.0005, 0.001, 0.002, 0.01]) * r.random())
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        res = await task
                        check(res.output_ids)
                    seen["cancelled"] += 1
                elif mode < 0.6:
                    stream = eng.stream(prompt, cfg)
                    async for ev in stream:
                        check(ev.token_ids)
                        if r.random() < 0.2:
                            break  # leaves mid-stream
                    await stream.aclose()
                    seen["finished"] += 1
                elif mode < 0.8:
                    res = await generate_resumable(eng, prompt, cfg)
                    check(res.output_ids)
                    assert res.finish_reason in (
                        FinishReason.STOP,
                        FinishReason.LENGTH,
                        FinishReason.CANCELLED,
                    )
                    seen["finished"] += 1
                else:
                    res = await eng.generate(prompt, cfg)
                    check(res.output_ids)
                    seen["finished"] += 1
            except RuntimeError as exc:
                assert "closed" in str(exc), exc
                return

    async def trainer() -> None:
        version = 0
        while not stop.is_set():
            await asyncio.sleep(rng.random() * 0.005)
            await eng.pause()
            version += 1
            await eng.load_weights(weights[version % 2], version)
            await asyncio.sleep(rng.random() * 0.003)
            await eng.resume()

    clients = [asyncio.create_task(client(i)) for i in range(n_clients)]
    train = asyncio.create_task(trainer())
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.wait_for(train, 30)
    await asyncio.sleep(0.05)
    # close() with requests in flight: every caller returns (CANCELLED), nobody hangs.
    await asyncio.wait_for(eng.close(), 30)
    done, pending = await asyncio.wait(clients, timeout=30)
    assert not pending
    for t in done:
        t.result()
    failures = [r for r in caplog.records if "decode loop failed" in r.getMessage()]
    assert not failures, failures[0].exc_text
    assert seen["tokens"] > 0 and seen["finished"] > 0 and seen["cancelled"] > 0, seen


def _slow_prefill(eng, seconds: float = 0.003):
    """Makes every prefill forward (no cache yet) slower, widening the window in which a
    request has left the queue but has no token yet."""
    import time

    def hook(module, args, kwargs):
        if kwargs.get("past_key_values") is None:
            time.sleep(seconds)

    return eng.model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("slow_prefill", [False, True])
@pytest.mark.parametrize("max_running", [2, 64])
async def test_stress_cancel_pause_weights_close(caplog, max_running, slow_prefill):
    eng = HFEngine(
        ModelConfig(source="builtin:micro"), RolloutConfig(max_running_requests=max_running)
    )
    handle = _slow_prefill(eng) if slow_prefill else None
    try:
        await _stress(eng, caplog, n_clients=24, seconds=5.0, seed=max_running)
    finally:
        if handle is not None:
            handle.remove()
        await eng.close()


async def test_a_cancelled_pause_does_not_kill_the_decode_loop():
    """Regression: pause() whose caller is cancelled before the decode thread handles it left
    a cancelled future among the pause waiters; set_result on it raised InvalidStateError in
    the decode thread and ended the loop."""
    eng = HFEngine(ModelConfig(source="builtin:micro"), fp32())
    try:
        hog = asyncio.create_task(
            eng.generate([5, 6], SamplingConfig(max_new_tokens=400, ignore_eos=True))
        )
        await wait_for_tokens(eng, 3)
        # Hold the decode thread between two steps while the pause is requested and dropped.
        await asyncio.to_thread(eng._model_lock.acquire)
        try:
            pause = asyncio.create_task(eng.pause())
            await asyncio.sleep(0.01)
            pause.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pause
        finally:
            eng._model_lock.release()
        res = await asyncio.wait_for(hog, 30)
        assert res.finish_reason == FinishReason.INTERRUPTED
        await eng.resume()
        again = await asyncio.wait_for(
            eng.generate([7], SamplingConfig(max_new_tokens=3, ignore_eos=True)), 30
        )
        assert len(again.output_ids) == 3
    finally:
        await asyncio.wait_for(eng.close(), 30)


async def test_a_decode_loop_failure_is_the_engines_death_for_every_caller(caplog):
    """Whatever kills the decode loop, the engine has died: requests in flight and every later
    call (a generate, a weight load) raise EngineDied with the one reason, the death listeners
    hear it once, pause() and close() return, and the failure is logged with its traceback."""
    import logging

    from areal_servers.rollout.engine import EngineDied

    caplog.set_level(logging.ERROR, logger="areal_servers.rollout.hf_engine")
    eng = HFEngine(ModelConfig(source="builtin:micro"), fp32())
    heard: list[str] = []
    eng.on_death(heard.append)
    try:
        sd = {k: v.clone() for k, v in eng.model.state_dict().items()}
        running = asyncio.create_task(
            eng.generate([5, 6], SamplingConfig(max_new_tokens=400, ignore_eos=True))
        )
        await wait_for_tokens(eng, 3)

        def boom(module, args, kwargs):
            raise RuntimeError("simulated kernel failure")

        eng.model.register_forward_pre_hook(boom, with_kwargs=True)
        with pytest.raises(EngineDied, match="the hf engine died: its decode loop failed") as first:
            await asyncio.wait_for(running, 30)
        assert "simulated kernel failure" in str(first.value)
        with pytest.raises(EngineDied) as later:
            await eng.generate([5], SamplingConfig(max_new_tokens=2))
        with pytest.raises(EngineDied) as load:
            await eng.load_weights(sd, version=1)
        assert str(later.value) == str(load.value) == str(first.value)
        assert heard == [first.value.reason]
        assert eng.version == 0
        assert await asyncio.wait_for(eng.pause(), 10) == 0
        failures = [r for r in caplog.records if "decode loop failed" in r.getMessage()]
        assert failures and failures[0].exc_info is not None
        assert "simulated kernel failure" in failures[0].exc_text
    finally:
        await asyncio.wait_for(eng.close(), 30)


async def test_sampling_stays_in_the_vocabulary_with_non_finite_or_oversized_logits(engine):
    """NaN / inf logits (weights blown up by an update) and an lm_head with more rows than the
    embedding never yield an id the embedding cannot look up; the loop keeps serving."""
    sd = {k: v.clone() for k, v in engine.model.state_dict().items()}
    sd["model.norm.weight"] = torch.full_like(sd["model.norm.weight"], float("nan"))
    await engine.load_weights(sd, version=1)
    cfgs = [
        SamplingConfig(temperature=1.0, max_new_tokens=4, ignore_eos=True),
        SamplingConfig(temperature=0.7, top_p=0.5, top_k=3, max_new_tokens=4, ignore_eos=True),
        SamplingConfig(temperature=0.0, max_new_tokens=4, ignore_eos=True),
    ]
    for res in await asyncio.gather(*(engine.generate([3, 4], c) for c in cfgs)):
        assert len(res.output_ids) == 4
        assert all(0 <= t < engine.vocab_size for t in res.output_ids)
    sd["model.norm.weight"] = torch.full_like(sd["model.norm.weight"], 1e30)
    await engine.load_weights(sd, version=2)
    for res in await asyncio.gather(*(engine.generate([3, 4], c) for c in cfgs)):
        assert all(0 <= t < engine.vocab_size for t in res.output_ids)
    # The sampler only ever sees the ids the embedding has, whatever width the logits have.
    wide = torch.zeros(2, engine.vocab_size + 50)
    wide[:, engine.vocab_size :] = 100.0  # all the mass on rows past the embedding
    from areal_servers.rollout.scheduler import Request

    reqs = [
        Request(
            rid=-1 - i,
            prompt=[1],
            params=cfgs[i],
            loop=asyncio.get_running_loop(),
            queue=asyncio.Queue(),
            stop_ids=frozenset(),
        )
        for i in (0, 2)
    ]
    engine._scheduler.sample_and_emit(reqs, wide, version=2)
    for r in reqs:
        assert 0 <= r.pending_token < engine.vocab_size


_EXIT_WITH_WORK_IN_FLIGHT = """
import asyncio, threading, time
from areal_servers.rollout.engine import SamplingConfig
from areal_servers.rollout.hf_engine import HFEngine
from areal_grpc.config import ModelConfig, RolloutConfig

eng = HFEngine(ModelConfig(source="builtin:micro"), RolloutConfig(max_running_requests=32))

def client():
    async def main():
        cfg = SamplingConfig(max_new_tokens=400, ignore_eos=True)
        await asyncio.gather(*(eng.generate([5 + i, 6, 7], cfg) for i in range(32)))
    asyncio.run(main())

threading.Thread(target=client, daemon=True).start()
while eng.status().generated_tokens < 100:
    time.sleep(0.01)
print("exiting", flush=True)
"""


def test_the_process_exits_cleanly_with_requests_in_flight_and_no_close():
    """A server stopped by a signal exits without calling close(): the decode thread must be
    stopped before interpreter finalization (a daemon thread inside a torch op then dies by a
    forced unwind through C++ code: 'terminate called without an active exception')."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_WITH_WORK_IN_FLIGHT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "exiting" in proc.stdout
    assert "terminate called" not in proc.stderr


async def test_max_batch_tokens_bounds_the_running_rows_and_refuses_what_never_fits():
    """A KV budget of 2 rows (4-token prompts + 16 new tokens each = 20 slots, budget 40):
    never more than 2 rows decode at once, every request finishes, and one that alone
    exceeds the budget is a FieldError naming max_new_tokens and the limit."""
    eng = HFEngine(ModelConfig(source="builtin:micro", seed=0), fp32(max_batch_tokens=40))
    try:
        params = SamplingConfig(temperature=1.0, max_new_tokens=16, ignore_eos=True)
        with pytest.raises(FieldError) as info:
            await eng.generate([5, 6, 7, 8], params.with_updates(max_new_tokens=37))
        assert info.value.field == "sampling.max_new_tokens"
        assert "max_batch_tokens (40)" in str(info.value)
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, eng.status().running)
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(*(eng.generate([5, 6, 7, 8 + i], params) for i in range(6)))
        watcher.cancel()
        assert [len(r.output_ids) for r in results] == [16] * 6
        assert peak == 2
    finally:
        await eng.close()


def test_the_sampler_draws_each_token_with_its_probability_and_never_one_without_mass():
    """The engine's inverse-CDF draw: frequencies over 40,000 draws match the distribution
    (within 5 standard errors), tokens of probability 0 never come up, rows need not be
    normalised, and one seed gives one sequence."""
    from areal_servers.rollout.sampler import draw as _draw

    p = torch.tensor([0.1, 0.0, 0.45, 0.0, 0.3, 0.15, 0.0])
    n = 40_000
    probs = (p * 3.0).repeat(n, 1)  # unnormalised on purpose
    gen = torch.Generator().manual_seed(7)
    ids = _draw(probs, gen)
    counts = torch.bincount(ids, minlength=len(p)).double()
    assert counts[p == 0].sum() == 0
    freq = counts / n
    se = (p.double() * (1 - p.double()) / n).sqrt()
    assert torch.all((freq - p.double()).abs() <= 5 * se + 1e-12), freq
    # A single token with all the mass, last in the row: always that one.
    last = torch.zeros(1000, 50)
    last[:, -1] = 1.0
    assert torch.all(_draw(last, gen) == 49)
    again = _draw(probs[:100], torch.Generator().manual_seed(3))
    assert torch.equal(again, _draw(probs[:100], torch.Generator().manual_seed(3)))
