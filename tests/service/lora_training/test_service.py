"""LoraTrainingService on loopback, over a real engine (builtin:tiny): tenants kept apart,
quotas, call order, operations, bad input, checkpoints inside the root."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from areal_servers.lora_training.engine import LoraEngine
from areal_servers.lora_training.service import FairQueue, LoraTrainingServicer, Operation, Tenants
from arealgrpc.v1 import common_pb2
from arealgrpc.v1 import lora_training_pb2 as pb
from arealgrpc.v1 import lora_training_pb2_grpc as pb_grpc

from areal_grpc.config import TINKER_AUTOSAVE_ID, TinkerConfig
from areal_grpc.durations import duration
from areal_grpc.errors import field_violations, retry_delay_s
from areal_grpc.sampling import MIN_TEMPERATURE
from areal_grpc.server import BackgroundServer, service

torch.set_num_threads(1)

KEYS = {"alice": "tml-alice-0123456789abcdef", "bob": "tml-bob-0123456789abcdefgh"}
MODEL = "builtin:tiny"
SEQ = [5, 6, 7, 8, 9, 10, 11, 12]


@dataclass
class Served:
    servicer: LoraTrainingServicer
    channel: grpc.Channel
    root: Path
    server: BackgroundServer

    def block_worker(self) -> threading.Event:
        """Occupies the worker with a call of a third tenant until the event is set."""
        gate = threading.Event()
        op = Operation("carol", pb.Operation(name="operations/blocker"), gate.wait, lambda _: None)

        async def put() -> None:
            self.servicer.queue.put(op)

        self.server.call(put())
        return gate

    def stub(self) -> pb_grpc.LoraTrainingServiceStub:
        return pb_grpc.LoraTrainingServiceStub(self.channel)


@pytest.fixture
def served(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Served]:
    overrides = getattr(request, "param", {})
    cfg = TinkerConfig(**{"max_runs_per_tenant": 3, "samplers_per_run": 2, **overrides})
    servicer = LoraTrainingServicer(
        LoraEngine(MODEL), cfg, Tenants(KEYS), tmp_path / "root", [MODEL]
    )
    bg = BackgroundServer(
        [service(servicer, pb_grpc.add_LoraTrainingServiceServicer_to_server, pb)]
    )
    running = bg.start()
    bg.call(servicer.start())
    channel = grpc.insecure_channel(running.address)
    try:
        yield Served(servicer, channel, tmp_path / "root", bg)
    finally:
        channel.close()
        bg.call(servicer.stop())
        bg.stop()


def auth(tenant: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {KEYS[tenant]}")]


def wait(s: Served, tenant: str, op: pb.Operation) -> pb.Operation:
    while not op.done:
        op = (
            s.stub()
            .WaitOperation(
                pb.WaitOperationRequest(name=op.name, timeout=duration(30)),
                metadata=auth(tenant),
            )
            .operation
        )
    return op


def ok(s: Served, tenant: str, op: pb.Operation) -> pb.Operation:
    op = wait(s, tenant, op)
    assert op.WhichOneof("result") != "error", op.error
    return op


def create(s: Served, tenant: str, run_id: str = "", rank: int = 4) -> str:
    reply = s.stub().CreateTrainingRun(
        pb.CreateTrainingRunRequest(
            base_model=MODEL,
            lora=pb.LoraSpec(rank=rank, train_attn=True, train_mlp=True, seed=1),
            training_run_id=run_id,
        ),
        metadata=auth(tenant),
    )
    return ok(s, tenant, reply.operation).training_run.name


def sft_datum(seq: list[int] = SEQ) -> pb.Datum:
    n = len(seq) - 1
    return pb.Datum(input_tokens=seq[:-1], target_tokens=seq[1:], weights=[1.0] * n)


def step(s: Served, tenant: str, run: str, seq: int = 0, data: list[pb.Datum] | None = None):
    fb = s.stub().ForwardBackward(
        pb.ForwardBackwardRequest(
            training_run=run,
            data=data or [sft_datum()],
            loss_function=pb.LOSS_FUNCTION_CROSS_ENTROPY,
            sequence_number=seq,
        ),
        metadata=auth(tenant),
    )
    opt = s.stub().OptimStep(
        pb.OptimStepRequest(
            training_run=run,
            adam=pb.AdamParams(learning_rate=3e-3, beta1=0.9, beta2=0.95, eps=1e-12),
            sequence_number=seq + 1 if seq else 0,
        ),
        metadata=auth(tenant),
    )
    loss = ok(s, tenant, fb.operation).forward_backward.metrics["loss:sum"]
    ok(s, tenant, opt.operation)
    return loss


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_two_tenants_train_at_once_and_each_sees_only_its_own(served: Served):
    a = create(served, "alice", "shared-name")
    b = create(served, "bob", "shared-name")  # the same id in another tenant is another run
    losses: dict[str, list[float]] = {"alice": [], "bob": []}

    async def both() -> None:
        async def train(tenant: str, run: str) -> None:
            for _ in range(4):
                losses[tenant].append(await asyncio.to_thread(step, served, tenant, run))

        await asyncio.gather(train("alice", a), train("bob", b))

    asyncio.run(both())
    assert losses["alice"][-1] < losses["alice"][0] and losses["bob"][-1] < losses["bob"][0]
    stub = served.stub()
    mine = stub.ListTrainingRuns(pb.ListTrainingRunsRequest(), metadata=auth("bob"))
    assert [r.name for r in mine.training_runs] == ["training_runs/shared-name"]
    assert mine.training_runs[0].steps == 4

    saved = stub.SaveWeights(
        pb.SaveWeightsRequest(training_run=a, kind=pb.CHECKPOINT_KIND_SAMPLER, checkpoint_id="s"),
        metadata=auth("alice"),
    )
    checkpoint = ok(served, "alice", saved.operation).checkpoint.name
    alone = create(served, "alice", "only-alice")
    # Bob cannot read, sample, load or await what is Alice's: it reads as missing.
    for call in (
        lambda: stub.GetTrainingRun(
            pb.GetTrainingRunRequest(name="training_runs/only-alice"), metadata=auth("bob")
        ),
        lambda: stub.Sample(
            pb.SampleRequest(
                checkpoint=checkpoint,
                prompt_tokens=SEQ[:3],
                sampling=common_pb2.SamplingParams(max_new_tokens=2),
            ),
            metadata=auth("bob"),
        ),
        lambda: stub.LoadWeights(
            pb.LoadWeightsRequest(training_run=b, checkpoint=checkpoint), metadata=auth("bob")
        ),
        lambda: stub.GetOperation(
            pb.GetOperationRequest(name=saved.operation.name), metadata=auth("bob")
        ),
    ):
        assert code_of(call) == grpc.StatusCode.NOT_FOUND
    assert alone == "training_runs/only-alice"


def test_keys_are_checked(served: Served):
    stub = served.stub()
    assert (
        code_of(lambda: stub.ListTrainingRuns(pb.ListTrainingRunsRequest()))
        == grpc.StatusCode.UNAUTHENTICATED
    )
    wrong = [("authorization", "Bearer tml-not-a-tenant-key-000000")]
    assert (
        code_of(lambda: stub.ListTrainingRuns(pb.ListTrainingRunsRequest(), metadata=wrong))
        == grpc.StatusCode.UNAUTHENTICATED
    )


def test_a_malformed_datum_names_the_field_and_changes_nothing(served: Served):
    a = create(served, "alice")
    b = create(served, "bob")
    before = {
        n: p.detach().clone()
        for n, p in served.servicer.engine.parameters("alice/" + a.split("/")[1]).items()
    }
    bad = sft_datum()
    del bad.weights[-1]
    with pytest.raises(grpc.RpcError) as err:
        served.stub().ForwardBackward(
            pb.ForwardBackwardRequest(
                training_run=a,
                data=[sft_datum(), bad],
                loss_function=pb.LOSS_FUNCTION_CROSS_ENTROPY,
            ),
            metadata=auth("alice"),
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in field_violations(err.value)] == ["data[1].weights"]
    out_of_vocab = sft_datum([5, 6, 10**7])
    with pytest.raises(grpc.RpcError) as err:
        served.stub().ForwardBackward(
            pb.ForwardBackwardRequest(
                training_run=a, data=[out_of_vocab], loss_function=pb.LOSS_FUNCTION_CROSS_ENTROPY
            ),
            metadata=auth("alice"),
        )
    assert [f for f, _ in field_violations(err.value)] == ["data[0].target_tokens"]
    # Bob's step goes on; Alice's adapter is as it was.
    step(served, "bob", b)
    after = served.servicer.engine.parameters("alice/" + a.split("/")[1])
    assert all(torch.equal(before[n], p) for n, p in after.items())
    run = served.stub().GetTrainingRun(pb.GetTrainingRunRequest(name=a), metadata=auth("alice"))
    assert run.training_run.steps == 0


@pytest.mark.parametrize(
    "served", [{"max_runs_per_tenant": 1, "retry_after_s": 2.5}], indirect=True
)
def test_a_full_run_quota_is_resource_exhausted_with_a_retry_delay(served: Served):
    create(served, "alice")
    with pytest.raises(grpc.RpcError) as err:
        create(served, "alice")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert retry_delay_s(err.value) == pytest.approx(2.5)
    assert "max_runs_per_tenant" in err.value.details()
    create(served, "bob")  # another tenant's quota is its own


@pytest.mark.parametrize("served", [{"max_queued_per_tenant": 2}], indirect=True)
def test_a_full_queue_is_resource_exhausted_and_other_tenants_still_queue(served: Served):
    a = create(served, "alice")
    b = create(served, "bob")
    gate = served.block_worker()
    stub = served.stub()
    ops, codes = [], []
    for _ in range(5):
        try:
            ops.append(
                stub.ForwardBackward(
                    pb.ForwardBackwardRequest(
                        training_run=a,
                        data=[sft_datum()],
                        loss_function=pb.LOSS_FUNCTION_CROSS_ENTROPY,
                        forward_only=True,
                    ),
                    metadata=auth("alice"),
                ).operation
            )
        except grpc.RpcError as exc:
            codes.append(exc.code())
    assert len(ops) == 2 and codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3
    # Bob queues behind the blocker but ahead of Alice's second call (turns alternate).
    bob = stub.ForwardBackward(
        pb.ForwardBackwardRequest(
            training_run=b, data=[sft_datum()], loss_function=pb.LOSS_FUNCTION_CROSS_ENTROPY
        ),
        metadata=auth("bob"),
    ).operation
    view = stub.GetOperation(pb.GetOperationRequest(name=ops[1].name), metadata=auth("alice"))
    assert not view.operation.done and view.operation.queue_position == 2
    gate.set()
    ok(served, "bob", bob)
    for op in ops:
        ok(served, "alice", op)


def test_calls_of_a_run_execute_in_sequence_order_and_a_repeat_is_the_same_call(served: Served):
    a = create(served, "alice")
    stub = served.stub()
    # The optimizer step (2) arrives before the gradients (1) it must follow.
    opt = stub.OptimStep.future(
        pb.OptimStepRequest(
            training_run=a, adam=pb.AdamParams(learning_rate=1e-2, eps=1e-8), sequence_number=2
        ),
        metadata=auth("alice"),
    )
    fb = stub.ForwardBackward(
        pb.ForwardBackwardRequest(
            training_run=a,
            data=[sft_datum()],
            loss_function=pb.LOSS_FUNCTION_CROSS_ENTROPY,
            sequence_number=1,
        ),
        metadata=auth("alice"),
    )
    optimized = ok(served, "alice", opt.result().operation)
    assert optimized.optim_step.metrics["grad_norm:mean"] > 0  # it saw the gradients
    again = stub.ForwardBackward(
        pb.ForwardBackwardRequest(
            training_run=a,
            data=[sft_datum()],
            loss_function=pb.LOSS_FUNCTION_CROSS_ENTROPY,
            sequence_number=1,
        ),
        metadata=auth("alice"),
    )
    assert again.operation.name == fb.operation.name


def test_a_refused_numbered_call_does_not_hold_up_the_next(served: Served):
    # The SDK numbers a call before it is answered: a refusal leaves no gap to wait for.
    a = create(served, "alice")
    bad = sft_datum()
    del bad.target_tokens[-1]
    with pytest.raises(grpc.RpcError) as err:
        step(served, "alice", a, seq=1, data=[bad])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert step(served, "alice", a, seq=2) > 0  # calls 2 and 3 run


def test_state_checkpoints_resume_bit_exactly(served: Served):
    a = create(served, "alice")
    for _ in range(2):
        step(served, "alice", a)
    stub = served.stub()
    saved = stub.SaveWeights(
        pb.SaveWeightsRequest(training_run=a, kind=pb.CHECKPOINT_KIND_STATE, checkpoint_id="k2"),
        metadata=auth("alice"),
    )
    checkpoint = ok(served, "alice", saved.operation).checkpoint
    assert checkpoint.step == 2 and checkpoint.size_bytes > 0
    first = [step(served, "alice", a) for _ in range(3)]
    resumed = create(served, "alice")
    loaded = stub.LoadWeights(
        pb.LoadWeightsRequest(
            training_run=resumed, checkpoint=checkpoint.name, with_optimizer=True
        ),
        metadata=auth("alice"),
    )
    assert ok(served, "alice", loaded.operation).training_run.steps == 2
    assert [step(served, "alice", resumed) for _ in range(3)] == first


def test_a_runs_state_is_autosaved_every_n_steps_and_resumes_exactly(served: Served):
    """tinker.autosave_steps (10 by default): after the 10th step the run's state is indexed
    as its autosave checkpoint, inside the root, and it resumes bit-exactly; a caller may not
    save under that id."""
    a = create(served, "alice")
    for _ in range(10):
        step(served, "alice", a)
    stub = served.stub()
    run = stub.GetTrainingRun(pb.GetTrainingRunRequest(name=a), metadata=auth("alice")).training_run
    [auto] = [c for c in run.checkpoints if c.name.endswith(f"/{TINKER_AUTOSAVE_ID}")]
    assert auto.step == 10 and auto.kind == pb.CHECKPOINT_KIND_STATE
    assert served.servicer.saved[("alice", auto.name)].directory.is_relative_to(served.root)
    first = [step(served, "alice", a) for _ in range(2)]
    resumed = create(served, "alice")
    loaded = stub.LoadWeights(
        pb.LoadWeightsRequest(training_run=resumed, checkpoint=auto.name, with_optimizer=True),
        metadata=auth("alice"),
    )
    assert ok(served, "alice", loaded.operation).training_run.steps == 10
    assert [step(served, "alice", resumed) for _ in range(2)] == first
    with pytest.raises(grpc.RpcError) as err:
        stub.SaveWeights(
            pb.SaveWeightsRequest(
                training_run=a, kind=pb.CHECKPOINT_KIND_STATE, checkpoint_id=TINKER_AUTOSAVE_ID
            ),
            metadata=auth("alice"),
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in field_violations(err.value)] == ["checkpoint_id"]


def test_a_restarted_service_still_loads_the_states_saved_before(served: Served, tmp_path: Path):
    a = create(served, "alice")
    step(served, "alice", a)
    saved = served.stub().SaveWeights(
        pb.SaveWeightsRequest(training_run=a, kind=pb.CHECKPOINT_KIND_STATE, checkpoint_id="k1"),
        metadata=auth("alice"),
    )
    name = ok(served, "alice", saved.operation).checkpoint.name
    # A second service over the same root: the run is gone, its saved state is not.
    again = LoraTrainingServicer(
        served.servicer.engine, TinkerConfig(), Tenants(KEYS), served.root, [MODEL]
    )
    found = again.saved[("alice", name)]
    assert found.proto.lora.rank == 4 and found.proto.base_model == MODEL
    assert found.proto.step == 1 and found.directory.is_relative_to(served.root)
    assert ("bob", name) not in again.saved
    # An index entry pointing outside the root is ignored.
    index = served.root / "checkpoints.json"
    entries = json.loads(index.read_text())
    entries[0]["directory"] = "../../outside"
    index.write_text(json.dumps(entries))
    assert (
        LoraTrainingServicer(
            served.servicer.engine, TinkerConfig(), Tenants(KEYS), served.root, [MODEL]
        ).saved
        == {}
    )


def test_samplers_are_snapshots_and_sample_returns_logprobs(served: Served):
    a = create(served, "alice")
    stub = served.stub()

    def sample(**model) -> list[list[int]]:
        reply = stub.Sample(
            pb.SampleRequest(
                prompt_tokens=SEQ[:3],
                sampling=common_pb2.SamplingParams(
                    max_new_tokens=5, temperature=0.0, n_samples=2, ignore_eos=True
                ),
                **model,
            ),
            metadata=auth("alice"),
        )
        result = ok(served, "alice", reply.operation).sample
        assert all(len(c.output_logprobs) == len(c.output_ids) == 5 for c in result.completions)
        return [list(c.output_ids) for c in result.completions]

    def save(name: str) -> str:
        reply = stub.SaveWeights(
            pb.SaveWeightsRequest(
                training_run=a, kind=pb.CHECKPOINT_KIND_SAMPLER, checkpoint_id=name
            ),
            metadata=auth("alice"),
        )
        return ok(served, "alice", reply.operation).checkpoint.name

    base = sample(base_model=MODEL)
    fresh = save("fresh")
    assert sample(checkpoint=fresh) == base  # an untrained adapter is the base model
    for _ in range(20):
        step(served, "alice", a)
    trained = save("trained")
    after = sample(checkpoint=trained)
    assert after[0] == SEQ[3:8]  # it learned the sequence
    assert sample(checkpoint=fresh) == base  # the earlier snapshot did not move
    save("third")  # samplers_per_run=2: "fresh" leaves memory
    assert (
        code_of(
            lambda: stub.Sample(
                pb.SampleRequest(
                    checkpoint=fresh,
                    prompt_tokens=SEQ[:3],
                    sampling=common_pb2.SamplingParams(max_new_tokens=2),
                ),
                metadata=auth("alice"),
            )
        )
        == grpc.StatusCode.NOT_FOUND
    )


def test_checkpoints_are_written_only_inside_the_root(served: Served):
    a = create(served, "alice")
    stub = served.stub()
    for bad in ("../escape", "/abs", "a/b", ".hidden"):
        with pytest.raises(grpc.RpcError) as err:
            stub.SaveWeights(
                pb.SaveWeightsRequest(
                    training_run=a, kind=pb.CHECKPOINT_KIND_STATE, checkpoint_id=bad
                ),
                metadata=auth("alice"),
            )
        assert [f for f, _ in field_violations(err.value)] == ["checkpoint_id"], bad
    ok(
        served,
        "alice",
        stub.SaveWeights(
            pb.SaveWeightsRequest(training_run=a, kind=pb.CHECKPOINT_KIND_STATE, checkpoint_id="c"),
            metadata=auth("alice"),
        ).operation,
    )
    written = [p for p in served.root.parent.rglob("*") if p.is_file()]
    assert written and all(p.is_relative_to(served.root) for p in written)


def test_the_queue_takes_tenants_in_turn():
    async def order() -> list[str]:
        queue = FairQueue()
        ops = [Operation("alice", pb.Operation(name=f"a{i}")) for i in range(4)]
        ops += [Operation("bob", pb.Operation(name="b0"))]
        for op in ops:
            queue.put(op)
        assert queue.position(ops[-1]) == 1  # behind alice's first only
        return [(await queue.get()).proto.name for _ in ops]

    assert asyncio.run(order()) == ["a0", "b0", "a1", "a2", "a3"]


def test_tenants_file_is_checked(tmp_path: Path):
    from areal_grpc.config import read_tenants
    from areal_grpc.errors import FieldError

    good = tmp_path / "tenants.json"
    good.write_text(json.dumps(KEYS))
    assert read_tenants(str(good)) == KEYS
    for body in ('{"a": "no-prefix-0123456789"}', "[]", '{"a": "tml-x"}', "{"):
        bad = tmp_path / "bad.json"
        bad.write_text(body)
        with pytest.raises(FieldError) as err:
            read_tenants(str(bad))
        assert err.value.field == "tinker.tenants_file"


def test_fair_queue_extends_a_batch_along_the_round_robin_order():
    queue = FairQueue()
    ops = {}
    for name in ("a1", "a2", "b1", "c1", "c2"):
        ops[name] = Operation(name[0], pb.Operation(name=name))
        queue.put(ops[name])
    first = asyncio.run(queue.get())
    assert first is ops["a1"]
    # The order from here is b1, c1, a2, c2: a batch takes a stretch of it, never skips.
    group = queue.extend([first], lambda group, op: op.proto.name != "a2")
    assert [op.proto.name for op in group] == ["a1", "b1", "c1"]
    rest = queue.extend([asyncio.run(queue.get())], lambda group, op: True)
    assert [op.proto.name for op in rest] == ["a2", "c2"]


def sample_request(tenant_model: dict[str, str], prompt: list[int], seed: int | None):
    sampling = common_pb2.SamplingParams(max_new_tokens=6, n_samples=2, ignore_eos=True)
    if seed is None:
        sampling.temperature = 0.0
    else:
        sampling.seed = seed
    return pb.SampleRequest(prompt_tokens=prompt, sampling=sampling, **tenant_model)


def test_tenants_queued_samples_and_forward_passes_share_a_batch_each_as_alone(
    served: Served, monkeypatch: pytest.MonkeyPatch
):
    stub = served.stub()
    runs = {"alice": create(served, "alice"), "bob": create(served, "bob")}
    samplers = {}
    for i, (tenant, run) in enumerate(runs.items()):
        for _ in range(2 + 2 * i):  # trained apart, so the adapters differ
            step(served, tenant, run, data=[sft_datum(SEQ[i:])])
        saved = stub.SaveWeights(
            pb.SaveWeightsRequest(training_run=run, kind=pb.CHECKPOINT_KIND_SAMPLER),
            metadata=auth(tenant),
        )
        samplers[tenant] = ok(served, tenant, saved.operation).checkpoint.name
    calls = [
        ("alice", "Sample", sample_request({"checkpoint": samplers["alice"]}, SEQ[:3], 7)),
        ("bob", "Sample", sample_request({"checkpoint": samplers["bob"]}, SEQ[:5], 7)),
        ("alice", "ForwardBackward", pb.ForwardBackwardRequest(
            training_run=runs["alice"], data=[sft_datum(SEQ[1:])],
            loss_function=pb.LOSS_FUNCTION_CROSS_ENTROPY, forward_only=True)),
        ("bob", "ForwardBackward", pb.ForwardBackwardRequest(
            training_run=runs["bob"], data=[sft_datum(), sft_datum(SEQ[:4])],
            loss_function=pb.LOSS_FUNCTION_CROSS_ENTROPY, forward_only=True)),
        ("alice", "Sample", sample_request({"base_model": MODEL}, SEQ[2:4], None)),
    ]  # fmt: skip

    def results(batching: bool) -> list[pb.Operation]:
        served.servicer.batching = batching
        gate = served.block_worker()  # every call queues before any runs
        ops = [
            (tenant, getattr(stub, method)(request, metadata=auth(tenant)).operation)
            for tenant, method, request in calls
        ]
        gate.set()
        return [ok(served, tenant, op) for tenant, op in ops]

    sizes: list[int] = []
    engine = served.servicer.engine
    for method in ("sample_batch", "forward_batch"):
        real = getattr(engine, method)

        def spy(jobs, real=real):  # type: ignore[no-untyped-def]
            sizes.append(len(jobs))
            return real(jobs)

        monkeypatch.setattr(engine, method, spy)
    alone = results(batching=False)
    assert sizes == []
    batched = results(batching=True)
    # The round-robin order is alice, bob, alice, bob, alice: two samples, two forward
    # passes, then a sample alone (a batch never reaches past a call of another kind).
    assert sizes == [2, 2]
    for one, many in zip(alone, batched, strict=True):
        if one.HasField("sample"):
            got = [list(c.output_ids) for c in many.sample.completions]
            assert got == [list(c.output_ids) for c in one.sample.completions]
            for a, b in zip(one.sample.completions, many.sample.completions, strict=True):
                assert list(b.output_logprobs) == pytest.approx(list(a.output_logprobs), abs=1e-5)
        else:
            for a, b in zip(
                one.forward_backward.outputs, many.forward_backward.outputs, strict=True
            ):
                assert list(b.logprobs) == pytest.approx(list(a.logprobs), abs=1e-5)
    assert batched[0].sample != batched[1].sample  # each with its own adapter


def test_a_call_that_fails_in_a_batch_fails_alone(served: Served):
    stub = served.stub()
    a, b = create(served, "alice"), create(served, "bob")
    step(served, "bob", b)

    def save(tenant: str, run: str) -> str:
        reply = stub.SaveWeights(
            pb.SaveWeightsRequest(training_run=run, kind=pb.CHECKPOINT_KIND_SAMPLER),
            metadata=auth(tenant),
        )
        return ok(served, tenant, reply.operation).checkpoint.name

    oldest, _ = save("alice", a), save("alice", a)
    bobs = save("bob", b)
    gate = served.block_worker()
    # Alice's third sampler evicts her oldest (samplers_per_run=2) before her sample of it
    # runs, in a batch with Bob's.
    evicting = stub.SaveWeights(
        pb.SaveWeightsRequest(training_run=a, kind=pb.CHECKPOINT_KIND_SAMPLER),
        metadata=auth("alice"),
    ).operation
    bob = stub.Sample(
        sample_request({"checkpoint": bobs}, SEQ[:3], 3), metadata=auth("bob")
    ).operation
    alice = stub.Sample(
        sample_request({"checkpoint": oldest}, SEQ[:3], 3), metadata=auth("alice")
    ).operation
    gate.set()
    ok(served, "alice", evicting)
    assert wait(served, "alice", alice).error.code == grpc.StatusCode.NOT_FOUND.value[0]
    done = ok(served, "bob", bob).sample
    assert [len(c.output_ids) for c in done.completions] == [6, 6]


def test_a_bad_loss_config_or_overlong_datum_names_the_field(served: Served):
    a = create(served, "alice")
    n = len(SEQ) - 1
    rl = pb.Datum(
        input_tokens=SEQ[:-1], target_tokens=SEQ[1:], logprobs=[-1.0] * n, advantages=[1.0] * n
    )
    long = served.servicer.engine.max_context_length + 1
    for request, field in (
        (
            pb.ForwardBackwardRequest(
                training_run=a,
                data=[rl],
                loss_function=pb.LOSS_FUNCTION_PPO,
                loss_config=pb.LossConfig(clip_low_threshold=1.5, clip_high_threshold=1.2),
            ),
            "loss_config.clip_low_threshold",
        ),
        (
            pb.ForwardBackwardRequest(
                training_run=a,
                data=[rl, sft_datum([5] * (long + 1))],
                loss_function=pb.LOSS_FUNCTION_CROSS_ENTROPY,
            ),
            "data[0].weights",
        ),
        (
            pb.ForwardBackwardRequest(
                training_run=a,
                data=[sft_datum([5] * (long + 1))],
                loss_function=pb.LOSS_FUNCTION_CROSS_ENTROPY,
            ),
            "data[0].input_tokens",
        ),
    ):
        with pytest.raises(grpc.RpcError) as err:
            served.stub().ForwardBackward(request, metadata=auth("alice"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in field_violations(err.value)] == [field]
    step(served, "alice", a)  # the run is as it was, and the service up


def test_a_temperature_between_greedy_and_the_minimum_is_refused_naming_the_field(served: Served):
    """Found by fuzzing: the smallest positive temperature was queued and its operation failed
    INTERNAL (logits / T overflowed); now the call is refused before anything is queued."""
    stub = served.stub()

    def sample(temperature: float) -> pb.Operation:
        sampling = common_pb2.SamplingParams(
            max_new_tokens=3, temperature=temperature, ignore_eos=True
        )
        request = pb.SampleRequest(base_model=MODEL, prompt_tokens=SEQ[:3], sampling=sampling)
        return stub.Sample(request, metadata=auth("alice")).operation

    for temperature in (2.0**-149, 1e-30, MIN_TEMPERATURE / 2, math.inf):
        with pytest.raises(grpc.RpcError) as err:
            sample(temperature)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, temperature
        assert [f for f, _ in field_violations(err.value)] == ["sampling.temperature"]
    done = ok(served, "alice", sample(MIN_TEMPERATURE)).sample
    assert [len(c.output_ids) for c in done.completions] == [3]


def test_an_adam_step_that_would_make_weights_non_finite_is_refused_and_changes_nothing(
    served: Served,
):
    """Found by fuzzing: eps 0 over a zero gradient (LoRA's B starts at 0) made the adapter
    NaN, and every later sample of it failed INTERNAL; a learning rate past the float range
    failed INTERNAL in the step itself."""
    a = create(served, "alice")
    key = "alice/" + a.split("/")[1]
    stub = served.stub()
    stub.ForwardBackward(
        pb.ForwardBackwardRequest(
            training_run=a, data=[sft_datum()], loss_function=pb.LOSS_FUNCTION_CROSS_ENTROPY
        ),
        metadata=auth("alice"),
    )
    before = {n: p.detach().clone() for n, p in served.servicer.engine.parameters(key).items()}
    for adam in (pb.AdamParams(learning_rate=1e-3), pb.AdamParams(learning_rate=1e38, eps=1e-8)):
        reply = stub.OptimStep(
            pb.OptimStepRequest(training_run=a, adam=adam), metadata=auth("alice")
        )
        error = wait(served, "alice", reply.operation).error
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], error
        assert "adam" in error.message and "non-finite" in error.message
    after = served.servicer.engine.parameters(key)
    assert all(torch.equal(before[n], p) for n, p in after.items())
    run = stub.GetTrainingRun(pb.GetTrainingRunRequest(name=a), metadata=auth("alice"))
    assert run.training_run.steps == 0
    # The gradients stayed: a sound step now takes them.
    optimized = ok(
        served,
        "alice",
        stub.OptimStep(
            pb.OptimStepRequest(training_run=a, adam=pb.AdamParams(learning_rate=1e-2, eps=1e-8)),
            metadata=auth("alice"),
        ).operation,
    )
    assert optimized.optim_step.metrics["grad_norm:mean"] > 0


def test_a_sampler_whose_logits_overflow_fails_failed_precondition(served: Served):
    """Found by fuzzing: finite but huge weights (learning rate 1e30) overflow the logits, and
    sampling failed INTERNAL inside torch.multinomial."""
    a = create(served, "alice")
    stub = served.stub()
    for _ in range(2):
        stub.ForwardBackward(
            pb.ForwardBackwardRequest(
                training_run=a, data=[sft_datum()], loss_function=pb.LOSS_FUNCTION_CROSS_ENTROPY
            ),
            metadata=auth("alice"),
        )
        ok(
            served,
            "alice",
            stub.OptimStep(
                pb.OptimStepRequest(
                    training_run=a, adam=pb.AdamParams(learning_rate=1e30, eps=1e-8)
                ),
                metadata=auth("alice"),
            ).operation,
        )
    saved = stub.SaveWeights(
        pb.SaveWeightsRequest(training_run=a, kind=pb.CHECKPOINT_KIND_SAMPLER),
        metadata=auth("alice"),
    )
    sampler = ok(served, "alice", saved.operation).checkpoint.name
    for temperature in (1.0, 0.0):
        reply = stub.Sample(
            pb.SampleRequest(
                checkpoint=sampler,
                prompt_tokens=SEQ[:3],
                sampling=common_pb2.SamplingParams(max_new_tokens=3, temperature=temperature),
            ),
            metadata=auth("alice"),
        )
        error = wait(served, "alice", reply.operation).error
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0], error
        assert "non-finite logits" in error.message


def test_an_empty_stop_string_is_refused_naming_the_field(served: Served):
    with pytest.raises(grpc.RpcError) as err:
        served.stub().Sample(
            pb.SampleRequest(
                base_model=MODEL,
                prompt_tokens=SEQ[:3],
                sampling=common_pb2.SamplingParams(max_new_tokens=2),
                stop=["ok", ""],
            ),
            metadata=auth("alice"),
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in field_violations(err.value)] == ["stop"]
