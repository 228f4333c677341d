"""Fuzzing RolloutService with malformed messages on a real loopback server (builtin:micro).

Every malformed Generate, GenerateStream or RunEpisodes input must be answered with success
or a documented status code; RunEpisodes must answer every task with exactly one result and
keep the stream going; afterwards the server must still generate the same greedy tokens from
the same, untouched weights.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from areal_servers.rollout.hf_engine import HFEngine
from areal_servers.rollout.service import RolloutServiceConfig, RolloutServicer, item_to_struct
from arealgrpc.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from google.protobuf import struct_pb2
from hypothesis import given
from hypothesis import strategies as st

from areal_grpc.config import ModelConfig
from areal_grpc.model import load_tokenizer
from areal_grpc.server import BackgroundServer, service
from areal_grpc.trajectory import validate_group
from tests.support.fuzz import DOCUMENTED, Tally, fuzz

MODEL = "builtin:micro"
VOCAB = 384
CONTEXT = 512
MAX_SAMPLES = 8
DEFAULT_NEW = 4
TIMEOUT = 60.0
PROBE = [5, 17, 42, 99, 7]
I32 = st.integers(-(2**31), 2**31 - 1)


def weights_digest(engine: HFEngine) -> float:
    with torch.no_grad():
        return float(sum(p.double().abs().sum() for p in engine.model.state_dict().values()))


@dataclass
class Rollout:
    server: BackgroundServer
    engine: HFEngine
    channel: grpc.Channel
    stub: rollout_pb2_grpc.RolloutServiceStub
    probe: list[int]
    digest: float

    def greedy(self) -> list[int]:
        resp = self.stub.Generate(
            rollout_pb2.GenerateRequest(
                input_ids=PROBE,
                sampling=common_pb2.SamplingParams(
                    temperature=0.0, max_new_tokens=3, ignore_eos=True
                ),
            ),
            timeout=TIMEOUT,
        )
        return list(resp.completions[0].output_ids)

    def check_healthy(self) -> None:
        """A valid request still succeeds and the state is intact."""
        st_ = self.stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=TIMEOUT)
        assert st_.policy_version == 0
        assert not st_.paused
        assert (st_.running_requests, st_.queued_requests, st_.running_episodes) == (0, 0, 0)
        assert st_.vocab_size == VOCAB and st_.model == MODEL
        assert st_.engine == rollout_pb2.ROLLOUT_ENGINE_HF
        assert self.greedy() == self.probe
        task = rollout_pb2.RunEpisodesRequest(
            task=rollout_pb2.EpisodeTask(
                task_id="valid",
                data=item_to_struct({"input_ids": PROBE}),
                workflow_params=item_to_struct({"reward_fn": "exact_match"}),
                group_size=2,
                sampling=common_pb2.SamplingParams(max_new_tokens=2, ignore_eos=True),
            )
        )
        results = list(self.stub.RunEpisodes(iter([task]), timeout=TIMEOUT))
        assert [r.outcome for r in results] == [rollout_pb2.EPISODE_OUTCOME_ACCEPTED], results
        assert weights_digest(self.engine) == self.digest


def start_rollout() -> tuple[Rollout, RolloutServicer]:
    engine = HFEngine(ModelConfig(source=MODEL, seed=0))
    servicer = RolloutServicer(
        engine,
        load_tokenizer(MODEL),
        RolloutServiceConfig(default_max_new_tokens=DEFAULT_NEW, max_samples=MAX_SAMPLES),
    )
    server = BackgroundServer(
        [service(servicer, rollout_pb2_grpc.add_RolloutServiceServicer_to_server, rollout_pb2)]
    )
    running = server.start()
    channel = grpc.insecure_channel(running.address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    r = Rollout(server, engine, channel, stub, [], weights_digest(engine))
    r.probe = r.greedy()
    return r, servicer


def stop_rollout(r: Rollout) -> None:
    r.channel.close()
    r.server.call(r.engine.close())
    r.server.stop()


@pytest.fixture(scope="module")
def rollout() -> Iterator[Rollout]:
    r, _ = start_rollout()
    r.check_healthy()
    yield r
    stop_rollout(r)


# ------------------------------------------------------------------------------ strategies

temperatures = st.floats(width=32)
any_float32 = st.floats(width=32)


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "n_samples")
VALID = {
    # 0 is greedy; positive temperatures must be >= MIN_TEMPERATURE (1e-3).
    "temperature": st.none()
    | st.just(0.0)
    | st.floats(2.0**-9, 10.0, width=32)
    | st.floats(2.0**-9, 2.0**127, width=32),
    "top_p": st.none() | st.floats(0.0, 1.0, width=32, exclude_min=True),
    "top_k": st.integers(0, VOCAB + 10) | st.just(2**31 - 1),
    # Small valid budgets keep valid examples cheap.
    "max_new_tokens": st.integers(0, 3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4),
    "n_samples": st.integers(0, 3),
    "input_ids": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
    | st.lists(st.integers(0, VOCAB - 1), min_size=CONTEXT - 8, max_size=CONTEXT - 4),
}


def huge(value: int) -> st.SearchStrategy[list[int]]:
    # Huge repeated fields, cheap to build: far over the context, well under 64 MiB.
    return st.integers(CONTEXT, 1_000_000).map(lambda n: [value] * n)


INVALID = {
    "temperature": st.floats(width=32, max_value=-(2.0**-100))
    | st.just(math.nan)
    | st.just(math.inf)
    | st.floats(2.0**-149, 2.0**-11, width=32),
    "top_p": any_float32.filter(lambda p: not 0.0 < p <= 1.0),
    "top_k": st.integers(-(2**31), -1),
    "max_new_tokens": st.integers(-(2**31), -1) | st.integers(CONTEXT, 2**31 - 1),
    "stop_token_ids": st.lists(st.integers(-(2**31), -1), min_size=1, max_size=4),
    "n_samples": st.integers(-(2**31), -1) | st.integers(MAX_SAMPLES + 1, 2**31 - 1),
    "input_ids": st.one_of(
        st.just([]),
        st.lists(I32, min_size=1, max_size=8).filter(
            lambda ids: any(not 0 <= t < VOCAB for t in ids)
        ),
        st.lists(st.integers(0, VOCAB - 1), min_size=CONTEXT, max_size=CONTEXT + 2),
        huge(5),
        st.integers(-(2**31), -1).flatmap(huge),
    ),
}
ALL_FIELDS = (*SAMPLING_FIELDS, "input_ids")


@st.composite
def generate_inputs(draw: st.DrawFn) -> tuple[list[int], common_pb2.SamplingParams, set[str]]:
    """(input_ids, sampling, the fields made invalid): up to three bad fields at once."""
    bad = draw(st.sets(st.sampled_from(ALL_FIELDS), max_size=3))
    value = {f: draw(INVALID[f] if f in bad else VALID[f]) for f in ALL_FIELDS}
    msg = common_pb2.SamplingParams(
        top_k=value["top_k"],
        max_new_tokens=value["max_new_tokens"],
        stop_token_ids=value["stop_token_ids"],
        n_samples=value["n_samples"],
        ignore_eos=draw(st.booleans()),
    )
    for f in ("temperature", "top_p"):
        if value[f] is not None:
            setattr(msg, f, value[f])
    ids = value["input_ids"]
    # A long valid prompt plus a valid budget can still overrun the context: that is bad too.
    if len(ids) + (msg.max_new_tokens or DEFAULT_NEW) > CONTEXT:
        bad.add("context")
    return ids, msg, bad


@st.composite
def sampling_params(draw: st.DrawFn) -> common_pb2.SamplingParams:
    return draw(generate_inputs())[1]


def effective(msg: common_pb2.SamplingParams) -> tuple[int, int]:
    """(n_samples, max_new_tokens) a valid request gets."""
    return msg.n_samples or 1, msg.max_new_tokens or DEFAULT_NEW


def check_tokens(ids, logprobs, versions, max_new: int) -> None:
    assert len(ids) == len(logprobs) == len(versions) <= max_new
    assert all(0 <= t < VOCAB for t in ids)
    assert all(math.isfinite(lp) and lp <= 1e-4 for lp in logprobs), logprobs
    assert all(v == 0 for v in versions)


# ------------------------------------------------------------------------------ Generate


@fuzz(40)
@given(case=generate_inputs())
def test_generate_malformed(rollout: Rollout, tally: Tally, case) -> None:
    ids, sampling, bad = case
    req = rollout_pb2.GenerateRequest(input_ids=ids, sampling=sampling, request_id="fuzz")
    code, resp = tally.call("Rollout.Generate", lambda: rollout.stub.Generate(req, timeout=TIMEOUT))
    # Exactly the requests with a bad field are refused.
    assert (code == grpc.StatusCode.OK) == (not bad), (bad, code)
    if code == grpc.StatusCode.OK:
        n, max_new = effective(sampling)
        assert len(resp.completions) == n
        for c in resp.completions:
            check_tokens(c.output_ids, c.output_logprobs, c.output_versions, max_new)
            assert c.finish_reason in (
                common_pb2.FINISH_REASON_STOP,
                common_pb2.FINISH_REASON_LENGTH,
            )
        assert resp.policy_version == 0
    else:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, resp.details()
    rollout.check_healthy()


@fuzz(30)
@given(case=generate_inputs())
def test_generate_stream_malformed(rollout: Rollout, tally: Tally, case) -> None:
    ids, sampling, bad = case
    req = rollout_pb2.GenerateStreamRequest(input_ids=ids, sampling=sampling)
    code, out = tally.call(
        "Rollout.GenerateStream", lambda: list(rollout.stub.GenerateStream(req, timeout=TIMEOUT))
    )
    # Exactly the requests with a bad field are refused (a stream is one sample).
    assert (code == grpc.StatusCode.OK) == (not bad and sampling.n_samples <= 1), (bad, code)
    if code == grpc.StatusCode.OK:
        n, max_new = effective(sampling)
        assert n == 1
        ids_out = [t for m in out for t in m.output_ids]
        lps = [x for m in out for x in m.output_logprobs]
        vs = [v for m in out for v in m.output_versions]
        check_tokens(ids_out, lps, vs, max_new)
        assert out and out[-1].finish_reason in (
            common_pb2.FINISH_REASON_STOP,
            common_pb2.FINISH_REASON_LENGTH,
        )
        assert all(m.finish_reason == 0 for m in out[:-1])
    else:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, out.details()
    rollout.check_healthy()


# ----------------------------------------------------------------------------- RunEpisodes

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**40), 2**40),
    st.text(max_size=12),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
data_items = st.dictionaries(
    st.one_of(
        st.sampled_from(["prompt", "answer", "input_ids", "messages", "task", "question"]),
        st.text(max_size=6),
    ),
    st.one_of(
        json_value,
        st.lists(
            st.one_of(st.integers(0, VOCAB - 1), st.integers(-(2**40), 2**40), st.floats()),
            max_size=6,
        ),
        st.text(max_size=30),
    ),
    max_size=5,
)
# No random import paths: a random "module:name" could import something with side effects.
workflows = st.sampled_from(
    [
        "",
        "rlvr",
        "multi_turn",
        "RLVR",
        "no_such_workflow",
        "no.such.module:Thing",
        "areal_grpc.tasks:NO_SUCH_NAME",
        "math:pi",
        "math:sqrt",
        ":",
        "a:b:c",
        " rlvr",
    ]
) | st.text(max_size=10).filter(lambda s: ":" not in s)
param_values = st.one_of(
    st.sampled_from(
        ["all", "nonuniform", "exact_match", "first_char", "task", "no_such_name", "math:sqrt", ""]
    ),
    json_value,
)
workflow_params = st.dictionaries(
    st.sampled_from(
        ["accept", "reward_fn", "prompt_key", "max_turns", "turn_discount", "feedback", "x"]
    ),
    param_values,
    max_size=4,
)
task_ids = st.sampled_from(["a", "b", "c", ""]) | st.text(max_size=8)


def struct(value: dict) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(value)
    return s


@st.composite
def episode_requests(draw: st.DrawFn) -> rollout_pb2.RunEpisodesRequest:
    kind = draw(st.sampled_from(["task", "task", "task", "cancel", "empty"]))
    if kind == "empty":
        return rollout_pb2.RunEpisodesRequest()
    if kind == "cancel":
        return rollout_pb2.RunEpisodesRequest(
            cancel=rollout_pb2.CancelEpisode(task_id=draw(task_ids))
        )
    return rollout_pb2.RunEpisodesRequest(
        task=rollout_pb2.EpisodeTask(
            task_id=draw(task_ids),
            data=struct(
                draw(
                    # A usable prompt half the time, so malformed fields elsewhere get reached.
                    st.one_of(
                        data_items,
                        st.fixed_dictionaries(
                            {"prompt": st.text(min_size=1, max_size=20)},
                            optional={"answer": st.text(max_size=3)},
                        ),
                    )
                )
            ),
            workflow=draw(st.sampled_from(["", "rlvr", "multi_turn"]) | workflows),
            workflow_params=struct(draw(st.just({}) | workflow_params)),
            group_size=draw(
                st.one_of(st.integers(-2, 3), st.integers(MAX_SAMPLES, MAX_SAMPLES + 1), I32)
            ),
            sampling=draw(sampling_params()),
            eval=draw(st.booleans()),
            trace_context=common_pb2.TraceContext(traceparent=draw(st.text(max_size=60))),
        )
    )


OUTCOMES = (
    rollout_pb2.EPISODE_OUTCOME_ACCEPTED,
    rollout_pb2.EPISODE_OUTCOME_REJECTED,
    rollout_pb2.EPISODE_OUTCOME_FAILED,
    rollout_pb2.EPISODE_OUTCOME_CANCELLED,
)


@fuzz(40)
@given(messages=st.lists(episode_requests(), min_size=1, max_size=5))
def test_run_episodes_malformed(rollout: Rollout, tally: Tally, messages) -> None:
    code, results = tally.call(
        "Rollout.RunEpisodes",
        lambda: list(rollout.stub.RunEpisodes(iter(messages), timeout=TIMEOUT)),
        allowed=(),  # one bad task must never end the stream
    )
    assert code == grpc.StatusCode.OK
    # Exactly one result per task message and per empty message, nothing for cancellations.
    expected = Counter(m.task.task_id for m in messages if m.WhichOneof("kind") != "cancel")
    assert Counter(r.task_id for r in results) == expected
    for r in results:
        assert r.outcome in OUTCOMES, r
        tally.answers["Rollout.RunEpisodes(results)"][
            rollout_pb2.EpisodeOutcome.Name(r.outcome)
        ] += 1
        if r.outcome == rollout_pb2.EPISODE_OUTCOME_ACCEPTED:
            validate_group(r.group, "group", VOCAB)
            assert r.group.task_id == r.task_id
        else:
            assert r.reason and not r.group.trajectories
    rollout.check_healthy()


def test_run_episodes_accepted_groups_match_their_task(rollout: Rollout, tally: Tally) -> None:
    """A valid task between malformed ones on one stream still gets its full group."""
    good = rollout_pb2.RunEpisodesRequest(
        task=rollout_pb2.EpisodeTask(
            task_id="good",
            data=item_to_struct({"input_ids": PROBE}),
            workflow_params=item_to_struct({"reward_fn": "exact_match"}),
            group_size=3,
            sampling=common_pb2.SamplingParams(max_new_tokens=2, ignore_eos=True),
        )
    )
    bad = [
        rollout_pb2.RunEpisodesRequest(),
        rollout_pb2.RunEpisodesRequest(task=rollout_pb2.EpisodeTask(task_id="neg", group_size=-1)),
        rollout_pb2.RunEpisodesRequest(
            task=rollout_pb2.EpisodeTask(
                task_id="nan",
                data=item_to_struct({"input_ids": PROBE}),
                sampling=common_pb2.SamplingParams(temperature=math.nan),
            )
        ),
    ]
    for _ in bad:
        tally.note("Rollout.RunEpisodes", "mixed-stream")
    results = {
        r.task_id: r
        for r in rollout.stub.RunEpisodes(iter([bad[0], good, *bad[1:]]), timeout=TIMEOUT)
    }
    assert set(results) == {"", "good", "neg", "nan"}
    assert results["good"].outcome == rollout_pb2.EPISODE_OUTCOME_ACCEPTED
    assert len(results["good"].group.trajectories) == 3
    for tid in ("", "neg", "nan"):
        assert results[tid].outcome == rollout_pb2.EPISODE_OUTCOME_FAILED
        assert results[tid].reason.startswith("INVALID_ARGUMENT"), results[tid].reason
    rollout.check_healthy()


# ------------------------------------------------------------ truncated and broken streams


def wait_idle(r: Rollout) -> None:
    """Waits (bounded) until no episode or request is left running on the server."""
    give_up = time.monotonic() + TIMEOUT
    while True:
        s = r.stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=TIMEOUT)
        if (s.running_requests, s.queued_requests, s.running_episodes) == (0, 0, 0):
            return
        assert time.monotonic() < give_up, f"server never went idle: {s}"
        time.sleep(0.01)


def long_task(task_id: str) -> rollout_pb2.RunEpisodesRequest:
    return rollout_pb2.RunEpisodesRequest(
        task=rollout_pb2.EpisodeTask(
            task_id=task_id,
            data=item_to_struct({"input_ids": PROBE}),
            workflow_params=item_to_struct({"reward_fn": "exact_match"}),
            group_size=4,
            sampling=common_pb2.SamplingParams(max_new_tokens=400, ignore_eos=True),
        )
    )


class Boom(Exception):
    pass


def wait_decoding(r: Rollout, requests: int) -> None:
    """Waits (bounded) until ``requests`` generations are past prefill and decoding."""
    give_up = time.monotonic() + TIMEOUT
    while True:
        s = r.stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=TIMEOUT)
        if s.running_requests >= requests:
            return
        assert time.monotonic() < give_up, f"requests never started decoding: {s}"
        time.sleep(0.005)


@fuzz(8)
@given(
    sent=st.integers(0, 3),
    how=st.sampled_from(["iterator_raises", "client_cancel", "deadline"]),
    early=st.booleans(),
)
def test_run_episodes_truncated_stream(rollout: Rollout, tally: Tally, sent, how, early) -> None:
    """A stream that breaks mid-way frees its episodes; the server keeps serving.

    The break comes at once (``early``, possibly during a prefill) or once every generation
    is decoding.
    """
    holder: list[grpc.Future] = []

    def requests() -> Iterator[rollout_pb2.RunEpisodesRequest]:
        for i in range(sent):
            yield long_task(f"t{i}")
        if not early:
            wait_decoding(rollout, 4 * sent)
        if how == "iterator_raises":
            raise Boom("client iterator broke")
        if how == "client_cancel":
            while not holder:
                time.sleep(0.001)
            holder[0].cancel()
            return
        time.sleep(5.0)  # until the deadline

    allowed = {
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNKNOWN,
    }

    def run() -> list[rollout_pb2.RunEpisodesResponse]:
        call = rollout.stub.RunEpisodes(requests(), timeout=3.0 if how == "deadline" else TIMEOUT)
        holder.append(call)
        return list(call)

    # UNKNOWN here is the client library's own report of a request iterator that raised, not
    # the server's answer (the server only sees the stream cancelled).
    code, _ = tally.call(f"Rollout.RunEpisodes({how})", run, allowed=allowed)
    if how != "iterator_raises":
        assert code != grpc.StatusCode.UNKNOWN
    wait_idle(rollout)
    rollout.check_healthy()


@fuzz(15)
@given(
    ops=st.lists(st.sampled_from(["pause", "resume", "status", "generate", "stream"]), max_size=8)
)
def test_pause_resume_random_order(rollout: Rollout, tally: Tally, ops) -> None:
    """Pause/Resume in any order: status follows, every request ends, nothing is stuck."""
    pending = []
    paused = False
    req = rollout_pb2.GenerateRequest(
        input_ids=PROBE, sampling=common_pb2.SamplingParams(max_new_tokens=50, ignore_eos=True)
    )
    sreq = rollout_pb2.GenerateStreamRequest(input_ids=PROBE, sampling=req.sampling)
    for op in ops:
        if op == "pause":
            tally.call(
                "Rollout.PauseGeneration",
                lambda: rollout.stub.PauseGeneration(
                    rollout_pb2.PauseGenerationRequest(), timeout=TIMEOUT
                ),
            )
            paused = True
        elif op == "resume":
            tally.call(
                "Rollout.ResumeGeneration",
                lambda: rollout.stub.ResumeGeneration(
                    rollout_pb2.ResumeGenerationRequest(), timeout=TIMEOUT
                ),
            )
            paused = False
        elif op == "status":
            _, s = tally.call(
                "Rollout.GetRolloutStatus",
                lambda: rollout.stub.GetRolloutStatus(
                    rollout_pb2.GetRolloutStatusRequest(), timeout=TIMEOUT
                ),
            )
            assert s.paused == paused and s.policy_version == 0
        elif op == "generate":
            pending.append(("g", rollout.stub.Generate.future(req, timeout=TIMEOUT)))
        else:
            pending.append(("s", rollout.stub.GenerateStream(sreq, timeout=TIMEOUT)))
    rollout.stub.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(), timeout=TIMEOUT)
    ends = (
        common_pb2.FINISH_REASON_LENGTH,
        common_pb2.FINISH_REASON_INTERRUPTED,
        common_pb2.FINISH_REASON_STOP,
    )
    for kind, call in pending:
        if kind == "g":
            c = call.result().completions[0]
            check_tokens(c.output_ids, c.output_logprobs, c.output_versions, 50)
            assert c.finish_reason in ends
        else:
            msgs = list(call)
            assert msgs[-1].finish_reason in ends
    wait_idle(rollout)
    rollout.check_healthy()


# ----------------------------------------------------------------------- corrupt wire bytes

UNARY = ["Generate", "PauseGeneration", "ResumeGeneration", "GetRolloutStatus"]
corrupt_bytes = st.sampled_from(
    [b"\xff", b"\x0a\x05ab", b"\x08", b"\x0a\xff\xff\xff\xff\x0f"]
) | st.binary(min_size=1, max_size=64)


def send_raw(r: Rollout, method: str, payload: bytes) -> object:
    path = f"/arealgrpc.v1.RolloutService/{method}"
    if method == "RunEpisodes":
        return list(r.channel.stream_stream(path)(iter([payload]), timeout=TIMEOUT))
    if method == "GenerateStream":
        return list(r.channel.unary_stream(path)(payload, timeout=TIMEOUT))
    return r.channel.unary_unary(path)(payload, timeout=TIMEOUT)


@fuzz(20)
@given(method=st.sampled_from([*UNARY, "GenerateStream", "RunEpisodes"]), payload=corrupt_bytes)
def test_corrupt_bytes_do_not_hurt_the_server(
    rollout: Rollout, tally: Tally, method, payload
) -> None:
    """Undecodable bytes end only their own call with a documented code; the server goes on."""
    tally.call(f"Rollout.{method}(raw bytes)", lambda: send_raw(rollout, method, payload))
    rollout.check_healthy()


def test_corrupt_bytes_are_invalid_argument(rollout: Rollout) -> None:
    """Bytes that are not the request message get INVALID_ARGUMENT naming its type."""
    cases = {
        "Generate": "arealgrpc.v1.GenerateRequest",
        "GenerateStream": "arealgrpc.v1.GenerateStreamRequest",
        "RunEpisodes": "arealgrpc.v1.RunEpisodesRequest",
    }
    for method, type_name in cases.items():
        with pytest.raises(grpc.RpcError) as info:
            send_raw(rollout, method, b"\xff")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        assert f"not a valid {type_name}" in info.value.details(), info.value.details()
    rollout.check_healthy()


# ------------------------------------------- regressions: crashes this fuzzing found (fixed)


def test_tiny_temperature_does_not_kill_the_engine() -> None:
    """temperature=1e-40 overflowed logits / T and killed the decode thread (server dead)."""
    r, _ = start_rollout()
    try:
        req = rollout_pb2.GenerateRequest(
            input_ids=PROBE, sampling=common_pb2.SamplingParams(temperature=1e-40, max_new_tokens=2)
        )
        try:
            r.stub.Generate(req, timeout=3)
        except grpc.RpcError as err:
            assert err.code() in DOCUMENTED, err
        r.check_healthy()
    finally:
        stop_rollout(r)


def test_cancel_during_prefill_does_not_kill_the_engine() -> None:
    """A request cancelled during its prefill was decoded with token id -1 (server dead)."""
    r, _ = start_rollout()
    try:
        prompt = [(7 * i) % VOCAB for i in range(400)]
        req = rollout_pb2.GenerateStreamRequest(
            input_ids=prompt, sampling=common_pb2.SamplingParams(max_new_tokens=50)
        )
        for i in range(300):
            call = r.stub.GenerateStream(req, timeout=TIMEOUT)
            time.sleep((i % 8) * 0.0005)
            call.cancel()
            if i % 10 == 9:
                r.greedy()  # INTERNAL once the engine has died
        wait_idle(r)
        r.check_healthy()
    finally:
        stop_rollout(r)


def test_tiny_temperature_gives_finite_logprobs(rollout: Rollout) -> None:
    req = rollout_pb2.GenerateRequest(
        input_ids=[5, 6, 7],
        sampling=common_pb2.SamplingParams(temperature=1e-40, max_new_tokens=3),
    )
    try:
        resp = rollout.stub.Generate(req, timeout=TIMEOUT)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        return
    c = resp.completions[0]
    check_tokens(c.output_ids, c.output_logprobs, c.output_versions, 3)
