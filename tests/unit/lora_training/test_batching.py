"""LoraEngine's batches of calls that change nothing (sampling, forward-only passes): each
call, batched with other runs' calls under other adapters, gets what it gets alone (the same
tokens for the same seed, log-probs within float rounding); a bad call fails alone; a batch
that fails falls back to one call at a time."""

from __future__ import annotations

import math

import pytest
import torch
from areal_servers.lora_training.engine import (
    AdamParams,
    AdapterSpec,
    Datum,
    ForwardJob,
    LoraEngine,
    SampleJob,
    UnknownIdError,
)

from areal_grpc.errors import FieldError

torch.set_num_threads(1)

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*tie_word_embeddings:UserWarning"),
]

MODEL = "builtin:micro"
TOL = 1e-5


def sft(seq: list[int]) -> Datum:
    return Datum(seq[:-1], seq[1:], weights=[1.0] * (len(seq) - 1))


def rl(seq: list[int]) -> Datum:
    n = len(seq) - 1
    return Datum(seq[:-1], seq[1:], logprobs=[-2.0] * n, advantages=[0.5] * n)


@pytest.fixture(scope="module")
def engine() -> LoraEngine:
    """Three runs trained apart (so their adapters differ), each with a sampler snapshot."""
    engine = LoraEngine(MODEL)
    for offset, run in enumerate("abc"):
        engine.create(run, AdapterSpec(rank=4, seed=offset + 1))
        seq = [10 + offset + 3 * i for i in range(20)]
        for _ in range(3):
            engine.forward_backward(run, [sft(seq)], "cross_entropy", {})
            engine.optim_step(run, AdamParams(learning_rate=2e-2))
        engine.snapshot(run, f"s{run}")
    return engine


def assert_same_samples(batched: object, alone: object) -> None:
    assert not isinstance(batched, Exception), batched
    assert not isinstance(alone, Exception), alone
    (seqs_b, prompt_b), (seqs_a, prompt_a) = batched, alone  # type: ignore[misc]
    assert [s.tokens for s in seqs_b] == [s.tokens for s in seqs_a]
    assert [s.stop_reason for s in seqs_b] == [s.stop_reason for s in seqs_a]
    for b, a in zip(seqs_b, seqs_a, strict=True):
        assert b.logprobs == pytest.approx(a.logprobs, abs=TOL)
    if prompt_a is None:
        assert prompt_b is None
    else:
        assert math.isnan(prompt_b[0]) and prompt_b[1:] == pytest.approx(prompt_a[1:], abs=TOL)


SAMPLE_JOBS = [
    # seeded sampling; unequal prompt lengths (left padding), other temperatures, top-p/k
    SampleJob("sa", [5, 6, 7, 8, 9], 3, 12, temperature=1.0, seed=7),
    SampleJob("sb", [11, 12], 2, 20, temperature=0.7, top_p=0.9, seed=3, prompt_logprobs=True),
    SampleJob(None, [9, 8, 7, 6, 5, 4, 3, 2], 1, 8, temperature=0.0),  # greedy, base model
    SampleJob("sc", [100, 101, 102], 2, 16, temperature=1.3, top_k=20, seed=11),
    SampleJob("sa", [1, 2, 3], 1, 5, seed=5, stop_token_ids=[7, 9, 11, 13]),
    SampleJob("sb", [40] * 9, 2, 0, seed=1),  # no new tokens
]


def test_a_batch_of_samples_equals_each_alone(engine: LoraEngine):
    batched = engine.sample_batch(SAMPLE_JOBS)
    for job, result in zip(SAMPLE_JOBS, batched, strict=True):
        assert_same_samples(result, engine.sample_batch([job])[0])
        alone = engine.sample(
            job.sampler_id,
            job.prompt,
            num_samples=job.num_samples,
            max_tokens=job.max_tokens,
            temperature=job.temperature,
            top_p=job.top_p,
            top_k=job.top_k,
            seed=job.seed,
            stop_token_ids=job.stop_token_ids,
            prompt_logprobs=job.prompt_logprobs,
        )
        assert_same_samples(result, alone)


def test_the_rows_of_a_batch_use_their_own_adapters(engine: LoraEngine):
    """The snapshots differ, so a row under the wrong adapter would not match alone."""
    jobs = [SampleJob(s, [20, 21, 22, 23], 1, 10, temperature=0.0) for s in ("sa", "sb", "sc")]
    jobs.append(SampleJob(None, [20, 21, 22, 23], 1, 10, temperature=0.0))
    batched = engine.sample_batch(jobs)
    logprobs = [tuple(r[0][0].logprobs) for r in batched]  # type: ignore[index]
    assert len(set(logprobs)) == 4
    for job, result in zip(jobs, batched, strict=True):
        assert_same_samples(result, engine.sample_batch([job])[0])


def test_a_bad_sampling_call_fails_alone(engine: LoraEngine):
    jobs = [
        SAMPLE_JOBS[0],
        SampleJob("gone", [5, 6], 1, 4, seed=1),
        SampleJob("sb", [5, 10**6], 1, 4, seed=1),
        SAMPLE_JOBS[3],
    ]
    batched = engine.sample_batch(jobs)
    assert isinstance(batched[1], UnknownIdError)
    assert isinstance(batched[2], FieldError) and batched[2].field == "prompt"
    assert_same_samples(batched[0], engine.sample_batch([SAMPLE_JOBS[0]])[0])
    assert_same_samples(batched[3], engine.sample_batch([SAMPLE_JOBS[3]])[0])


def test_a_failed_batch_runs_each_call_alone(engine: LoraEngine, monkeypatch: pytest.MonkeyPatch):
    generate = engine._generate

    def fails_when_mixed(model, plans, names):  # type: ignore[no-untyped-def]
        if len(plans) > 1:
            raise RuntimeError("out of memory")
        return generate(model, plans, names)

    monkeypatch.setattr(engine, "_generate", fails_when_mixed)
    jobs = SAMPLE_JOBS[:2]
    batched = engine.sample_batch(jobs)
    monkeypatch.undo()
    for job, result in zip(jobs, batched, strict=True):
        assert_same_samples(result, engine.sample_batch([job])[0])


FORWARD_JOBS = [
    ForwardJob("a", [sft(list(range(5, 30))), sft([3, 4, 5])], "cross_entropy"),
    ForwardJob("b", [rl(list(range(50, 60)))], "ppo", {"clip_high_threshold": 1.3}),
    ForwardJob("c", [rl([7, 8, 9, 10])], "dro", {"beta": 0.1}),
    ForwardJob("a", [sft([9, 9, 9, 9, 9, 9])], "cross_entropy"),
]


def test_a_batch_of_forward_passes_equals_each_alone(engine: LoraEngine):
    before = {r: {k: p.detach().clone() for k, p in engine.parameters(r).items()} for r in "abc"}
    batched = engine.forward_batch([*FORWARD_JOBS, ForwardJob("b", [sft([1, 2])], "ppo")])
    assert isinstance(batched[-1], FieldError) and batched[-1].field == "data[0].logprobs"
    for job, result in zip(FORWARD_JOBS, batched[:-1], strict=True):
        assert not isinstance(result, Exception), result
        alone = engine.forward_backward(
            job.run_id, job.data, job.loss_fn, job.config, forward_only=True
        )
        for b, a in zip(result[0], alone[0], strict=True):
            assert b == pytest.approx(a, abs=TOL)
        assert result[1]["tokens:sum"] == alone[1]["tokens:sum"]
        assert result[1]["loss:sum"] == pytest.approx(alone[1]["loss:sum"], rel=TOL, abs=TOL)
    # Nothing was trained: no gradients, the same weights.
    for run, params in before.items():
        for key, param in engine.parameters(run).items():
            assert param.grad is None and torch.equal(param, params[key])
    # The same datum under each run's adapter gives other log-probs.
    same = engine.forward_batch(
        [ForwardJob(r, [sft([5, 6, 7, 8])], "cross_entropy") for r in "abc"]
    )
    assert len({tuple(out[0][0]) for out in same}) == 3  # type: ignore[index]
