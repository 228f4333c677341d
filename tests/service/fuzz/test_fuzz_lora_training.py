"""Fuzzing LoraTrainingService (builtin:tiny, two tenants) with malformed messages.

The fuzzer calls as tenant "alice"; tenant "bob" owns a trained run, a state checkpoint, a
sampler and finished operations, and their names are among the names alice sends (with the
same names in alice's own namespace, near misses and random text). Every RPC gets malformed
requests: bad names, enum values, numbers, datums, Adam and sampling settings, durations.
An answer must be a documented status, and so must an awaited operation's error (never
INTERNAL or UNKNOWN); whatever alice is answered with must be alice's own; afterwards bob's
runs, checkpoints (index and files), adapter weights and operations must be as they were,
bob's sampler must still sample what it sampled, and the service must still train.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from areal_servers.lora_training.engine import LoraEngine
from areal_servers.lora_training.service import INDEX_FILE, LoraTrainingServicer, Tenants
from arealgrpc.v1 import common_pb2
from arealgrpc.v1 import lora_training_pb2 as pb
from arealgrpc.v1 import lora_training_pb2_grpc as pb_grpc
from google.protobuf import duration_pb2
from google.protobuf.message import Message
from hypothesis import given
from hypothesis import strategies as st

from areal_grpc.config import TINKER_AUTOSAVE_ID, TinkerConfig
from areal_grpc.durations import duration
from areal_grpc.server import BackgroundServer, service
from tests.support.fuzz import DOCUMENTED, Tally, fuzz

torch.set_num_threads(1)

MODEL = "builtin:tiny"
KEYS = {"alice": "tml-alice-0123456789abcdef", "bob": "tml-bob-0123456789abcdefgh"}
FUZZER, VICTIM = "alice", "bob"
# Alice's own run has the id of one of bob's: a name alone must never reach across tenants.
SHARED_RUN = "shared"
BOB_RUNS = ("victim", SHARED_RUN)
SEQ = [5, 6, 7, 8, 9, 10, 11, 12]
TIMEOUT = 60.0
I32 = st.integers(-(2**31), 2**31 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
# The contract's answer to an id alice already has.
CREATE_ALLOWED = DOCUMENTED | {grpc.StatusCode.ALREADY_EXISTS}
# The smallest positive 32-bit float (a subnormal).
TINIEST_FLOAT32 = 2.0**-149
# An operation's error code (an int) as a StatusCode.
CODES = {code.value[0]: code for code in grpc.StatusCode}


def auth(tenant: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {KEYS[tenant]}")]


def sft_datum(seq: list[int] = SEQ) -> pb.Datum:
    n = len(seq) - 1
    return pb.Datum(input_tokens=seq[:-1], target_tokens=seq[1:], weights=[1.0] * n)


GREEDY = common_pb2.SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
ADAM = pb.AdamParams(learning_rate=3e-3, beta1=0.9, beta2=0.95, eps=1e-12)


# No repr: hypothesis would print bob's weights with every failing example.
@dataclass(repr=False)
class Service:
    servicer: LoraTrainingServicer
    server: BackgroundServer
    channel: grpc.Channel
    stub: pb_grpc.LoraTrainingServiceStub
    root: Path
    # Bob's names (runs, checkpoints, operations) and what they read as before fuzzing.
    bob_names: list[str] = field(default_factory=list)
    bob_state: dict[str, Any] = field(default_factory=dict)
    bob_sampler: str = ""
    bob_sample: list[int] = field(default_factory=list)

    def wait(self, tenant: str, op: pb.Operation) -> pb.Operation:
        while not op.done:
            op = self.stub.WaitOperation(
                pb.WaitOperationRequest(name=op.name, timeout=duration(30)),
                metadata=auth(tenant),
                timeout=TIMEOUT,
            ).operation
        return op

    def ok(self, tenant: str, op: pb.Operation) -> pb.Operation:
        op = self.wait(tenant, op)
        assert op.WhichOneof("result") != "error", op.error
        return op

    def create(self, tenant: str, run_id: str) -> str:
        reply = self.stub.CreateTrainingRun(
            pb.CreateTrainingRunRequest(
                base_model=MODEL,
                lora=pb.LoraSpec(rank=4, train_attn=True, train_mlp=True, seed=1),
                training_run_id=run_id,
            ),
            metadata=auth(tenant),
            timeout=TIMEOUT,
        )
        return self.ok(tenant, reply.operation).training_run.name

    def step(self, tenant: str, run: str) -> float:
        """One cross-entropy step on ``run``; its loss."""
        fb = self.stub.ForwardBackward(
            pb.ForwardBackwardRequest(
                training_run=run, data=[sft_datum()], loss_function=pb.LOSS_FUNCTION_CROSS_ENTROPY
            ),
            metadata=auth(tenant),
            timeout=TIMEOUT,
        )
        opt = self.stub.OptimStep(
            pb.OptimStepRequest(training_run=run, adam=ADAM),
            metadata=auth(tenant),
            timeout=TIMEOUT,
        )
        loss = self.ok(tenant, fb.operation).forward_backward.metrics["loss:sum"]
        self.ok(tenant, opt.operation)
        return loss

    def save(self, tenant: str, run: str, ckpt_id: str, kind: int) -> pb.Operation:
        reply = self.stub.SaveWeights(
            pb.SaveWeightsRequest(training_run=run, checkpoint_id=ckpt_id, kind=kind),  # type: ignore[arg-type]
            metadata=auth(tenant),
            timeout=TIMEOUT,
        )
        return self.ok(tenant, reply.operation)

    def sample(self, tenant: str, checkpoint: str) -> list[int]:
        reply = self.stub.Sample(
            pb.SampleRequest(checkpoint=checkpoint, prompt_tokens=SEQ[:3], sampling=GREEDY),
            metadata=auth(tenant),
            timeout=TIMEOUT,
        )
        return list(self.ok(tenant, reply.operation).sample.completions[0].output_ids)

    # -- bob's state ---------------------------------------------------------------------

    def read_bob(self) -> dict[str, Any]:
        """Everything of bob's, read back as bob over the RPCs and from the files and weights."""
        stub, md = self.stub, auth(VICTIM)
        state: dict[str, Any] = {
            "runs": stub.ListTrainingRuns(
                pb.ListTrainingRunsRequest(), metadata=md, timeout=TIMEOUT
            ).SerializeToString(deterministic=True)
        }
        for name in self.bob_names:
            if "/checkpoints/" in name:
                reply: Message = stub.GetCheckpoint(
                    pb.GetCheckpointRequest(name=name), metadata=md, timeout=TIMEOUT
                )
            elif name.startswith("operations/"):
                reply = stub.GetOperation(
                    pb.GetOperationRequest(name=name), metadata=md, timeout=TIMEOUT
                )
            else:
                reply = stub.GetTrainingRun(
                    pb.GetTrainingRunRequest(name=name), metadata=md, timeout=TIMEOUT
                )
            state[name] = reply.SerializeToString(deterministic=True)
        index = json.loads((self.root / INDEX_FILE).read_text())
        state["index"] = sorted(
            json.dumps(e, sort_keys=True) for e in index if e["tenant"] == VICTIM
        )
        for run_id in BOB_RUNS:
            run = self.servicer.runs[(VICTIM, run_id)]
            files = sorted(p for p in run.directory.rglob("*") if p.is_file())
            state[f"files of {run_id}"] = {
                str(p.relative_to(run.directory)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in files
            }
            params = self.servicer.engine.parameters(f"{VICTIM}/{run_id}")
            state[f"weights of {run_id}"] = {k: v.detach().clone() for k, v in params.items()}
        return state

    def check_bob_intact(self) -> None:
        now = self.read_bob()
        assert now.keys() == self.bob_state.keys()
        for key, before in self.bob_state.items():
            if key.startswith("weights of "):
                assert now[key].keys() == before.keys(), key
                assert all(torch.equal(now[key][k], v) for k, v in before.items()), key
            else:
                assert now[key] == before, key

    # -- alice's state -------------------------------------------------------------------

    def alice_runs(self) -> set[str]:
        return {r for (t, r) in self.servicer.runs if t == FUZZER}

    def restore_alice(self) -> None:
        """Alice keeps her shared-id run and nothing more, so her quota never fills."""
        for run_id in self.alice_runs() - {SHARED_RUN}:
            self.stub.DeleteTrainingRun(
                pb.DeleteTrainingRunRequest(name=f"training_runs/{run_id}"),
                metadata=auth(FUZZER),
                timeout=TIMEOUT,
            )
        if SHARED_RUN not in self.alice_runs():
            self.create(FUZZER, SHARED_RUN)

    def check_alice_only(self, response: Message) -> None:
        """Whatever alice was answered with is alice's: runs, checkpoints and operations."""
        runs: list[pb.TrainingRun] = []
        checkpoints: list[pb.Checkpoint] = []
        ops: list[pb.Operation] = []
        if isinstance(response, pb.ListTrainingRunsResponse):
            runs.extend(response.training_runs)
        for name in ("training_run", "checkpoint", "operation"):
            if name in response.DESCRIPTOR.fields_by_name and response.HasField(name):
                {"training_run": runs, "checkpoint": checkpoints, "operation": ops}[name].append(
                    getattr(response, name)
                )
        for op in ops:
            assert self.servicer.ops[op.name].tenant == FUZZER, op.name
            if op.HasField("training_run"):
                runs.append(op.training_run)
            if op.HasField("checkpoint"):
                checkpoints.append(op.checkpoint)
        bobs = {
            r.proto.SerializeToString(deterministic=True)
            for (t, _), r in self.servicer.runs.items()
            if t == VICTIM
        }
        for run in runs:
            # Alice's run of a shared id differs from bob's in its steps and times at least.
            assert run.SerializeToString(deterministic=True) not in bobs, run.name
            checkpoints.extend(run.checkpoints)
        for ckpt in checkpoints:
            assert (FUZZER, ckpt.name) in self.servicer.saved, ckpt.name


def start(root: Path) -> Service:
    cfg = TinkerConfig(max_runs_per_tenant=3, samplers_per_run=2, max_queued_per_tenant=8)
    servicer = LoraTrainingServicer(LoraEngine(MODEL), cfg, Tenants(KEYS), root, [MODEL])
    server = BackgroundServer(
        [service(servicer, pb_grpc.add_LoraTrainingServiceServicer_to_server, pb)]
    )
    running = server.start()
    server.call(servicer.start())
    channel = grpc.insecure_channel(running.address)
    return Service(servicer, server, channel, pb_grpc.LoraTrainingServiceStub(channel), root)


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    s = start(tmp_path_factory.mktemp("fuzz_lora") / "root")
    try:
        victim = s.create(VICTIM, "victim")
        shared = s.create(VICTIM, SHARED_RUN)
        for _ in range(3):
            s.step(VICTIM, victim)
        state = s.save(VICTIM, victim, "state-1", pb.CHECKPOINT_KIND_STATE)
        sampler = s.save(VICTIM, victim, "sampler-1", pb.CHECKPOINT_KIND_SAMPLER)
        s.save(VICTIM, shared, "state-1", pb.CHECKPOINT_KIND_STATE)
        s.bob_sampler = sampler.checkpoint.name
        s.bob_sample = s.sample(VICTIM, s.bob_sampler)
        s.bob_names = [
            victim,
            shared,
            state.checkpoint.name,
            sampler.checkpoint.name,
            f"{shared}/checkpoints/state-1",
            state.name,
            sampler.name,
        ]
        s.bob_state = s.read_bob()
        s.create(FUZZER, SHARED_RUN)
        yield s
    finally:
        s.channel.close()
        s.server.call(s.servicer.stop())
        s.server.stop()


# -------------------------------------------------------------------------------- names


def near_misses(name: str) -> list[str]:
    """``name`` as a careless or hostile caller might spell it."""
    return [
        name,
        name + "/",
        "/" + name,
        name.upper(),
        f"{VICTIM}/{name}",  # the engine's key of bob's sampler
        name.replace("training_runs/", "training_runs/../"),
        name.removeprefix("training_runs/"),
        name + "\x00",
    ]


def names(svc: Service) -> st.SearchStrategy[str]:
    """Bob's names, alice's, near misses of both, and random text."""
    known = [*svc.bob_names, f"training_runs/{SHARED_RUN}", "training_runs/", "operations/", ""]
    hostile = [m for n in known for m in near_misses(n)]
    return st.one_of(
        st.sampled_from(svc.bob_names),
        st.sampled_from(hostile),
        st.text(max_size=40),
    )


# Ids a caller may choose: bob's (alice gets her own of the same id), and plain ones.
GOOD_IDS = [*BOB_RUNS, "state-1", "sampler-1", "", "a.b", "x" * 128]
BAD_IDS = [".", "..", "../x", "a/b", "-x", "x" * 129, "a\x00b", TINKER_AUTOSAVE_ID]


def ids() -> st.SearchStrategy[str]:
    """Run and checkpoint ids: bob's, plain ones, refused ones, text."""
    return st.one_of(st.sampled_from(GOOD_IDS), st.sampled_from(BAD_IDS), st.text(max_size=30))


def pick(data: st.DataObject, values: list[str], fallback: str) -> str:
    """One of ``values`` (which change as the service does), ``fallback`` when there are
    none; drawn the same way whatever they are, so that hypothesis can replay an example."""
    index = data.draw(st.integers(0, 15))
    return values[index % len(values)] if values else fallback


def alice_run(svc: Service, data: st.DataObject) -> str:
    """The run a call names: mostly alice's own (the call then reaches the engine), else a
    name of bob's or a malformed one."""
    if data.draw(st.integers(0, 2)) < 2:
        return f"training_runs/{SHARED_RUN}"
    return data.draw(names(svc))


def broken(data: st.DataObject, fields: list[str]) -> set[str]:
    """Which of ``fields`` a request gets wrong (often none: a valid call)."""
    return data.draw(st.sets(st.sampled_from(fields), max_size=2))


def sequence_number(svc: Service, run_name: str, data: st.DataObject) -> int:
    """A number for a call on ``run_name``: never one that leaves a gap in alice's run (a
    gap is waited for, SEQUENCE_WAIT_S, before it is refused)."""
    kind = data.draw(st.sampled_from(["none", "next", "used", "negative", "any"]))
    raw = data.draw(I64)
    run = svc.servicer.runs.get((FUZZER, run_name.removeprefix("training_runs/")))
    if run is None:
        return raw
    if kind == "next":
        return run.enqueued + 1
    if kind == "used" and run.enqueued:
        return 1 + raw % run.enqueued
    if kind == "negative":
        return -1 - raw % 2**63
    return 0


def break_values(values: Any, data: st.DataObject, vocab: int, context: int, tokens: bool) -> None:
    """Breaks a repeated field in place: its length, or one value."""
    how = data.draw(st.sampled_from(["value", "shorter", "longer", "empty", "too_long"]))
    if how == "shorter" and values:
        del values[-1]
    elif how == "longer":
        values.append(values[-1] if values else 0)
    elif how == "empty":
        del values[:]
    elif how == "too_long":
        values.extend([5] * context)
    elif values:
        i = data.draw(st.integers(0, len(values) - 1))
        if tokens:
            values[i] = data.draw(st.integers(-(2**31), -1) | st.integers(vocab, 2**31 - 1))
        else:
            values[i] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -1e30]))


def datum(data: st.DataObject, vocab: int) -> pb.Datum:
    """A valid datum with every per-token field (each loss reads the ones it needs)."""
    n = data.draw(st.integers(1, 10))
    token = st.integers(0, vocab - 1)
    return pb.Datum(
        input_tokens=data.draw(st.lists(token, min_size=n, max_size=n)),
        target_tokens=data.draw(st.lists(token, min_size=n, max_size=n)),
        weights=data.draw(st.lists(st.floats(0, 1, width=32), min_size=n, max_size=n)),
        logprobs=data.draw(st.lists(st.floats(-20, 0, width=32), min_size=n, max_size=n)),
        advantages=data.draw(st.lists(st.floats(-2, 2, width=32), min_size=n, max_size=n)),
    )


DATUM_FIELDS = ["input_tokens", "target_tokens", "weights", "logprobs", "advantages"]
DURATIONS = st.builds(
    duration_pb2.Duration,
    seconds=st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-1, 1)),
    nanos=st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(0, 999_999_999)),
)


# -------------------------------------------------------------------------------- the check


def call(
    svc: Service,
    tally: Tally,
    rpc: str,
    request: Message,
    allowed: Iterable[grpc.StatusCode] = DOCUMENTED,
) -> None:
    """One call of ``rpc`` with ``request`` as alice, then the fuzzer's checks: a documented
    answer, an awaited operation that did not fault, alice's answers alice's own, bob's state
    as it was, still serving."""
    method = getattr(svc.stub, rpc)
    code, response = tally.call(
        f"LoraTraining.{rpc}",
        lambda: method(request, metadata=auth(FUZZER), timeout=TIMEOUT),
        allowed,
    )
    if code == grpc.StatusCode.OK:
        svc.check_alice_only(response)
        if "operation" in response.DESCRIPTOR.fields_by_name:
            op = svc.wait(FUZZER, response.operation)
            failed = CODES.get(op.error.code) if op.HasField("error") else grpc.StatusCode.OK
            tally.note(f"LoraTraining.{rpc}(operation)", getattr(failed, "name", str(failed)))
            assert failed in DOCUMENTED | {grpc.StatusCode.OK}, (rpc, op.error)
            # Sample has no sequence number (whose retry answers another call's operation):
            # its request is checked whole before it is queued.
            if rpc == "Sample":
                assert failed != grpc.StatusCode.INVALID_ARGUMENT, op.error
            svc.check_alice_only(pb.GetOperationResponse(operation=op))
    svc.restore_alice()
    svc.check_bob_intact()
    svc.stub.ListBaseModels(pb.ListBaseModelsRequest(), metadata=auth(FUZZER), timeout=TIMEOUT)


# -------------------------------------------------------------------------------- runs


@fuzz(40)
@given(rpc=st.sampled_from(["create", "get", "list", "delete"]), data=st.data())
def test_run_calls(svc: Service, tally: Tally, rpc: str, data: st.DataObject) -> None:
    if rpc == "create":
        bad = broken(data, ["base_model", "rank", "no_target", "id"])
        lora = pb.LoraSpec(
            rank=data.draw(st.sampled_from([1, 4, 16])),
            train_attn=True,
            train_mlp=data.draw(st.booleans()),
            train_unembed=data.draw(st.booleans()),
            seed=data.draw(st.none() | I64),
        )
        if "rank" in bad:
            lora.rank = data.draw(st.integers(-(2**31), 0) | st.integers(257, 2**31 - 1))
        if "no_target" in bad:
            lora.train_attn = lora.train_mlp = lora.train_unembed = False
        request = pb.CreateTrainingRunRequest(
            base_model=data.draw(names(svc)) if "base_model" in bad else MODEL,
            lora=lora,
            training_run_id=data.draw(ids() if "id" in bad else st.sampled_from(GOOD_IDS)),
        )
        call(svc, tally, "CreateTrainingRun", request, CREATE_ALLOWED)
    elif rpc == "list":
        call(svc, tally, "ListTrainingRuns", pb.ListTrainingRunsRequest())
    elif rpc == "get":
        get = pb.GetTrainingRunRequest(name=alice_run(svc, data))
        call(svc, tally, "GetTrainingRun", get)
    else:
        delete = pb.DeleteTrainingRunRequest(name=alice_run(svc, data))
        call(svc, tally, "DeleteTrainingRun", delete)


# -------------------------------------------------------------------------------- training


@fuzz(40)
@given(rpc=st.sampled_from(["forward_backward", "optim_step"]), data=st.data())
def test_training_calls(svc: Service, tally: Tally, rpc: str, data: st.DataObject) -> None:
    run = alice_run(svc, data)
    seq = sequence_number(svc, run, data)
    if rpc == "forward_backward":
        engine = svc.servicer.engine
        bad = broken(data, ["loss_function", "loss_config", "datum", "no_data"])
        loss = data.draw(st.integers(1, 5))
        config = pb.LossConfig()
        if loss in (pb.LOSS_FUNCTION_PPO, pb.LOSS_FUNCTION_CISPO) and data.draw(st.booleans()):
            config.clip_low_threshold = data.draw(st.floats(0.5, 1.0))
            config.clip_high_threshold = data.draw(st.floats(1.0, 2.0))
        if "loss_config" in bad:
            key = data.draw(st.sampled_from(["clip_low_threshold", "clip_high_threshold", "beta"]))
            setattr(config, key, data.draw(FLOATS))
        if "loss_function" in bad:
            loss = data.draw(st.just(0) | st.integers(6, 2**31 - 1) | st.integers(-(2**31), -1))
        batch = [datum(data, engine.vocab_size) for _ in range(data.draw(st.integers(1, 3)))]
        if "datum" in bad:
            name = data.draw(st.sampled_from(DATUM_FIELDS))
            values = getattr(data.draw(st.sampled_from(batch)), name)
            break_values(
                values, data, engine.vocab_size, engine.max_context_length, "tokens" in name
            )
        if "no_data" in bad:
            batch = []
        request = pb.ForwardBackwardRequest(
            training_run=run,
            data=batch,
            loss_function=loss,  # type: ignore[arg-type]
            loss_config=config,
            forward_only=data.draw(st.booleans()),
            sequence_number=seq,
        )
        call(svc, tally, "ForwardBackward", request)
    else:
        adam = pb.AdamParams(
            learning_rate=data.draw(st.floats(0, 1e-2)),
            beta1=data.draw(st.floats(0, 0.99)),
            beta2=data.draw(st.floats(0, 0.999)),
            eps=data.draw(st.floats(0, 1e-6)),
            weight_decay=data.draw(st.floats(0, 0.1)),
            grad_clip_norm=data.draw(st.floats(0, 10)),
        )
        fields = ["learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"]
        for key in broken(data, fields):
            setattr(
                adam, key, data.draw(st.sampled_from([-1.0, 1.0, math.nan, -math.inf]) | FLOATS)
            )
        step = pb.OptimStepRequest(training_run=run, adam=adam, sequence_number=seq)
        call(svc, tally, "OptimStep", step)


# -------------------------------------------------------------------------------- checkpoints


def alice_checkpoints(svc: Service) -> list[str]:
    return [name for (t, name) in svc.servicer.saved if t == FUZZER]


@fuzz(40)
@given(rpc=st.sampled_from(["save", "load", "get"]), data=st.data())
def test_checkpoint_calls(svc: Service, tally: Tally, rpc: str, data: st.DataObject) -> None:
    # Bob's checkpoints, alice's own (of the same ids, once saved) and malformed names.
    checkpoint = data.draw(st.sampled_from(svc.bob_names) | names(svc))
    if data.draw(st.integers(0, 2)) < 2:
        checkpoint = pick(data, alice_checkpoints(svc), checkpoint)
    if rpc == "get":
        get = pb.GetCheckpointRequest(name=checkpoint)
        call(svc, tally, "GetCheckpoint", get)
        return
    run = alice_run(svc, data)
    seq = sequence_number(svc, run, data)
    if rpc == "save":
        bad = broken(data, ["kind", "id"])
        save = pb.SaveWeightsRequest(
            training_run=run,
            checkpoint_id=data.draw(ids() if "id" in bad else st.sampled_from(GOOD_IDS)),
            kind=data.draw(  # type: ignore[arg-type]
                st.sampled_from([0, 3]) | I32 if "kind" in bad else st.sampled_from([1, 2])
            ),
            sequence_number=seq,
        )
        call(svc, tally, "SaveWeights", save)
    else:
        load = pb.LoadWeightsRequest(
            training_run=run,
            checkpoint=checkpoint,
            with_optimizer=data.draw(st.booleans()),
            sequence_number=seq,
        )
        call(svc, tally, "LoadWeights", load)


# -------------------------------------------------------------------------------- sampling

SAMPLING_FIELDS = [
    "temperature",
    "max_new_tokens",
    "n_samples",
    "top_p",
    "top_k",
    "stop_token_ids",
    "prompt",
    "model",
]


@fuzz(60)
@given(data=st.data())
def test_sample(svc: Service, tally: Tally, data: st.DataObject) -> None:
    engine = svc.servicer.engine
    vocab, context = engine.vocab_size, engine.max_context_length
    bad = broken(data, SAMPLING_FIELDS)
    params = common_pb2.SamplingParams(
        max_new_tokens=data.draw(st.sampled_from([3, 1, 2, 4])),
        n_samples=data.draw(st.integers(0, 3)),
        top_k=data.draw(st.integers(0, 5)),
        stop_token_ids=data.draw(st.lists(st.integers(0, vocab - 1), max_size=2)),
        ignore_eos=data.draw(st.booleans()),
        top_logprobs=data.draw(st.integers(0, 20)),
    )
    if data.draw(st.booleans()):
        params.temperature = data.draw(st.sampled_from([0.0, 0.001, 0.7, 1.0, 2.0]))
    if data.draw(st.booleans()):
        params.top_p = data.draw(st.sampled_from([0.1, 0.9, 1.0]))
    if data.draw(st.booleans()):
        params.seed = data.draw(st.integers(0, 2**64 - 1))
    if "max_new_tokens" in bad:
        params.max_new_tokens = data.draw(
            st.integers(-(2**31), 0) | st.integers(context, 2**31 - 1)
        )
    if "n_samples" in bad:
        params.n_samples = data.draw(st.integers(65, 2**31 - 1) | st.integers(-(2**31), -1))
    if "temperature" in bad:
        # Below the documented 0.001 (but not 0), huge, negative, NaN.
        params.temperature = data.draw(
            st.sampled_from([TINIEST_FLOAT32, 1e-30, 1e-4, 1e30, math.inf, math.nan])
            | st.floats(width=32)
        )
    if "top_p" in bad:
        params.top_p = data.draw(st.sampled_from([0.0, 1e-30, 1.5]) | st.floats(width=32))
    if "top_k" in bad:
        params.top_k = data.draw(I32)
    if "stop_token_ids" in bad:
        params.stop_token_ids.append(data.draw(I32))
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
    if "prompt" in bad:
        prompt = data.draw(st.lists(I32, max_size=4))
    request = pb.SampleRequest(
        prompt_tokens=prompt,
        sampling=params,
        stop=data.draw(st.lists(st.text(max_size=4), max_size=2)),
        prompt_logprobs=data.draw(st.booleans()),
    )
    mine = list(svc.servicer.runs[(FUZZER, SHARED_RUN)].samplers)
    if "model" in bad:
        if data.draw(st.booleans()):
            request.base_model = data.draw(names(svc))
        else:
            request.checkpoint = data.draw(names(svc))
    else:
        # Bob's sampler, above all: alice must not sample it.
        model = data.draw(st.sampled_from([MODEL, "mine", svc.bob_sampler]))
        if model == "mine":
            model = pick(data, mine, svc.bob_sampler)
        if model == MODEL:
            request.base_model = model
        else:
            request.checkpoint = model
    call(svc, tally, "Sample", request)


# -------------------------------------------------------------------------------- operations


@fuzz(30)
@given(rpc=st.sampled_from(["get", "wait", "base_models"]), data=st.data())
def test_operation_calls(svc: Service, tally: Tally, rpc: str, data: st.DataObject) -> None:
    # Alice's own operations are all done: a valid wait returns at once.
    mine = [n for n, op in svc.servicer.ops.items() if op.tenant == FUZZER][-3:]
    name = data.draw(st.sampled_from(svc.bob_names) | names(svc))
    if data.draw(st.booleans()):
        name = pick(data, mine, name)
    if rpc == "get":
        get = pb.GetOperationRequest(name=name)
        call(svc, tally, "GetOperation", get)
    elif rpc == "wait":
        wait = pb.WaitOperationRequest(name=name)
        if data.draw(st.booleans()):
            wait.timeout.CopyFrom(data.draw(DURATIONS))
        call(svc, tally, "WaitOperation", wait)
    else:
        call(svc, tally, "ListBaseModels", pb.ListBaseModelsRequest())


# -------------------------------------------------------------------------------- keys


@pytest.mark.parametrize(
    "header",
    [
        [],
        [("authorization", "")],
        [("authorization", "Bearer")],
        [("authorization", f"Basic {KEYS[VICTIM]}")],
        [("authorization", f"Bearer {KEYS[VICTIM][:-1]}")],
        [("authorization", f"Bearer {KEYS[VICTIM]}x")],
        [("authorization", f"Bearer {KEYS[FUZZER]}{KEYS[VICTIM]}")],
        [("authorization", f"Bearer {VICTIM}")],
        [("x-api-key", KEYS[VICTIM])],
    ],
)
def test_a_call_without_a_tenants_key_is_unauthenticated(
    svc: Service, tally: Tally, header: list[tuple[str, str]]
) -> None:
    """Near misses of bob's key, or none, reach nothing of his: UNAUTHENTICATED."""
    calls = {
        "DeleteTrainingRun": lambda: svc.stub.DeleteTrainingRun(
            pb.DeleteTrainingRunRequest(name=svc.bob_names[0]), metadata=header, timeout=TIMEOUT
        ),
        "Sample": lambda: svc.stub.Sample(
            pb.SampleRequest(checkpoint=svc.bob_sampler, prompt_tokens=SEQ[:3], sampling=GREEDY),
            metadata=header,
            timeout=TIMEOUT,
        ),
        "ListTrainingRuns": lambda: svc.stub.ListTrainingRuns(
            pb.ListTrainingRunsRequest(), metadata=header, timeout=TIMEOUT
        ),
    }
    for rpc, fn in calls.items():
        code, _ = tally.call(
            f"LoraTraining.{rpc}(bad key)", fn, allowed=(grpc.StatusCode.UNAUTHENTICATED,)
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED
    svc.check_bob_intact()


# -------------------------------------------------------------------------------- afterwards


def test_undecodable_bytes_are_invalid_argument(svc: Service) -> None:
    """Bytes that are not the request message get INVALID_ARGUMENT naming its type."""
    for method, type_name in (
        ("ForwardBackward", "arealgrpc.v1.ForwardBackwardRequest"),
        ("GetCheckpoint", "arealgrpc.v1.GetCheckpointRequest"),
    ):
        send = svc.channel.unary_unary(
            f"/arealgrpc.v1.LoraTrainingService/{method}", request_serializer=lambda b: b
        )
        with pytest.raises(grpc.RpcError) as info:
            send(b"\xff", metadata=auth(FUZZER), timeout=TIMEOUT)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        assert f"not a valid {type_name}" in info.value.details()
    svc.check_bob_intact()


def test_still_serving_and_bob_untouched_after_fuzzing(svc: Service, tally: Tally) -> None:
    """After all of the above, a fresh run of alice's trains, bob's sampler samples what it
    sampled before, and everything of bob's reads as it did."""
    tally.note("LoraTraining.ForwardBackward+OptimStep(valid)", "OK")
    svc.restore_alice()
    run = svc.create(FUZZER, "after")
    losses = [svc.step(FUZZER, run) for _ in range(3)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert svc.sample(VICTIM, svc.bob_sampler) == svc.bob_sample
    svc.check_bob_intact()
    svc.restore_alice()
