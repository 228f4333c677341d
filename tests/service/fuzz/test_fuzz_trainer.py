"""Fuzzing TrainerService (one plain process, builtin:micro) with malformed messages.

TrainStep gets valid steps broken in one or two ways (message order, lengths that disagree,
NaN/inf values, bad ids, huge repeated fields, wrong policy versions, truncated streams);
SaveCheckpoint / LoadCheckpoint / ExportModel get hostile paths; PublishWeights gets bad
addresses and parameters. A refusal must be a documented status that leaves version, step and
weights untouched; a valid step afterwards must still train.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from areal_servers.trainer.service import TrainerService, TrainerServiceConfig
from arealgrpc.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from google.protobuf import duration_pb2
from hypothesis import given
from hypothesis import strategies as st

from areal_grpc.config import ModelConfig, OptimizerSettings, TrainerConfig
from areal_grpc.durations import duration
from areal_grpc.paths import is_marked
from areal_grpc.server import BackgroundServer, service
from tests.support.fuzz import DOCUMENTED, Tally, fuzz

MODEL = "builtin:micro"
VOCAB = 384
MAX_TOKENS = 64
TIMEOUT = 60.0
I32 = st.integers(-(2**31), 2**31 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)


def weights_of(svc: TrainerService) -> dict[str, torch.Tensor]:
    assert svc.engine is not None
    return {k: v.detach().clone() for k, v in svc.engine.model.state_dict().items()}


@dataclass
class Trainer:
    server: BackgroundServer
    svc: TrainerService
    channel: grpc.Channel
    stub: trainer_pb2_grpc.TrainerServiceStub
    root: Path
    version: int = 0
    step: int = 0
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    steps_run: int = 0

    def status(self) -> trainer_pb2.GetTrainerStatusResponse:
        return self.stub.GetTrainerStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=TIMEOUT)

    def remember(self) -> None:
        s = self.status()
        self.version, self.step = s.policy_version, s.global_step
        self.weights = weights_of(self.svc)

    def check_intact(self) -> None:
        # A step refused because its stream broke is finished by the rank's worker after the
        # call has ended: wait (bounded) for the worker to be idle.
        give_up = time.monotonic() + TIMEOUT
        while (s := self.status()).busy:
            assert time.monotonic() < give_up, "the rank stayed busy"
            time.sleep(0.01)
        assert (s.policy_version, s.global_step) == (self.version, self.step)
        now = weights_of(self.svc)
        assert all(torch.equal(now[k], self.weights[k]) for k in now)

    def train(
        self, messages: list[trainer_pb2.TrainStepRequest]
    ) -> list[trainer_pb2.TrainStepResponse]:
        return list(self.stub.TrainStep(iter(messages), timeout=TIMEOUT))

    def check_valid_step(self) -> None:
        """A valid step still trains: one version up, finite stats, finite changed weights."""
        out = self.train(step_messages(valid_groups(2), self.version, self.steps_run))
        stats = out[-1].stats
        assert out[-1].HasField("stats") and stats.policy_version == self.version + 1
        assert math.isfinite(stats.loss) and math.isfinite(stats.grad_norm)
        now = weights_of(self.svc)
        assert all(torch.isfinite(v).all() for v in now.values())
        assert any(not torch.equal(now[k], self.weights[k]) for k in now)
        self.steps_run += 1
        self.remember()


def trajectory(
    n: int = 8, prompt: int = 3, reward: float = 1.0, version: int = 0, answer: int = 0
) -> common_pb2.Trajectory:
    """``answer`` shifts the completion's tokens (samples of one prompt that differ)."""
    return common_pb2.Trajectory(
        token_ids=[(5 + 13 * i + (answer if i >= prompt else 0)) % VOCAB for i in range(n)],
        logprobs=[0.0] * prompt + [-5.9] * (n - prompt),
        versions=[-1] * prompt + [version] * (n - prompt),
        loss_mask=[False] * prompt + [True] * (n - prompt),
        reward=reward,
        prompt_length=prompt,
    )


def valid_groups(count: int, version: int = 0) -> list[common_pb2.TrajectoryGroup]:
    return [
        common_pb2.TrajectoryGroup(
            task_id=f"t{g}",
            group_id=f"g{g}",
            # Two different answers: the same one rewarded 1 and 0 would cancel exactly.
            trajectories=[
                trajectory(8, reward=1.0, version=version),
                trajectory(8, reward=0.0, version=version, answer=1),
            ],
        )
        for g in range(count)
    ]


def step_messages(
    groups: list[common_pb2.TrajectoryGroup], version: int, global_step: int
) -> list[trainer_pb2.TrainStepRequest]:
    begin = trainer_pb2.StepBegin(
        global_step=global_step, policy_version=version, group_count=len(groups)
    )
    return [
        trainer_pb2.TrainStepRequest(begin=begin),
        *(trainer_pb2.TrainStepRequest(group=g) for g in groups),
        trainer_pb2.TrainStepRequest(end=trainer_pb2.StepEnd()),
    ]


def start_trainer(root: Path) -> Trainer:
    cfg = TrainerServiceConfig(
        trainer=TrainerConfig(
            fsdp=False,
            device="cpu",
            max_tokens_per_mb=MAX_TOKENS,
            optimizer=OptimizerSettings(lr=1e-3),
        ),
        model=ModelConfig(source=MODEL),
        distributed=False,
        path_roots=(str(root),),
    )
    svc = TrainerService(cfg)
    svc.wait_ready(TIMEOUT)
    server = BackgroundServer(
        [service(svc, trainer_pb2_grpc.add_TrainerServiceServicer_to_server, trainer_pb2)]
    )
    running = server.start()
    channel = grpc.insecure_channel(running.address)
    t = Trainer(server, svc, channel, trainer_pb2_grpc.TrainerServiceStub(channel), root)
    t.remember()
    return t


def stop_trainer(t: Trainer) -> None:
    t.channel.close()
    t.server.stop()
    t.svc.close()


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainer]:
    base = tmp_path_factory.mktemp("fuzz_trainer")
    root = base / "root"
    root.mkdir()
    (base / "outside").mkdir()
    t = start_trainer(root)
    (root / "no_meta").mkdir()
    (root / "garbage_meta").mkdir()
    (root / "garbage_meta" / "trainer_meta.json").write_text("{not json")
    yield t
    stop_trainer(t)


# -------------------------------------------------------------------------------- TrainStep

STEP_MUTATIONS = [
    "no_begin",
    "no_end",
    "begin_twice",
    "group_before_begin",
    "end_before_begin",
    "empty_request",
    "truncate",
    "group_count",
    "stale_version",
    "future_version",
    "no_groups",
    "empty_group",
    "lengths_disagree",
    "nan_reward",
    "inf_reward",
    "nan_logprob",
    "inf_logprob",
    "positive_logprob",
    "negative_id",
    "out_of_vocab_id",
    "empty_tokens",
    "prompt_length",
    "mask_on_prompt",
    "version_below_minus_one",
    "trained_token_without_version",
    "huge_repeated",
    "group_id_mismatch",
]
# What each mutation must be answered with.
PRECONDITION = {"stale_version", "future_version"}


def _traj(
    msgs: list[trainer_pb2.TrainStepRequest], slot: int, data: st.DataObject
) -> common_pb2.Trajectory | None:
    """Trajectory ``slot`` of some group: each mutation gets a trajectory of its own."""
    groups = [
        m.group
        for m in msgs
        if m.WhichOneof("kind") == "group" and len(m.group.trajectories) > slot
    ]
    if not groups:
        return None
    return data.draw(st.sampled_from(groups)).trajectories[slot]


def mutate_step(
    msgs: list[trainer_pb2.TrainStepRequest],
    op: str,
    version: int,
    slot: int,
    data: st.DataObject,
) -> list[trainer_pb2.TrainStepRequest]:
    """A valid step's messages broken by ``op`` (the messages are copies, edited in place)."""
    kinds = [m.WhichOneof("kind") for m in msgs]
    begin_at = kinds.index("begin") if "begin" in kinds else None
    if op == "no_begin" and begin_at is not None:
        del msgs[begin_at]
    elif op == "no_end" and "end" in kinds:
        del msgs[kinds.index("end")]
    elif op == "begin_twice" and begin_at is not None:
        msgs.insert(data.draw(st.integers(begin_at + 1, len(msgs))), msgs[begin_at])
    elif op == "group_before_begin":
        msgs.insert(0, trainer_pb2.TrainStepRequest(group=valid_groups(1, version)[0]))
    elif op == "end_before_begin":
        msgs.insert(0, trainer_pb2.TrainStepRequest(end=trainer_pb2.StepEnd()))
    elif op == "empty_request":
        msgs.insert(
            data.draw(st.integers(0, max(0, len(msgs) - 1))), trainer_pb2.TrainStepRequest()
        )
    elif op == "truncate":
        msgs = msgs[: data.draw(st.integers(0, max(0, len(msgs) - 1)))]
    elif op == "group_count" and begin_at is not None:
        b = msgs[begin_at].begin
        b.group_count = data.draw(I32.filter(lambda n: n != b.group_count))
    elif op == "stale_version" and begin_at is not None:
        msgs[begin_at].begin.policy_version = data.draw(
            st.integers(-(2**63), version - 1) | st.just(version - 1)
        )
    elif op == "future_version" and begin_at is not None:
        msgs[begin_at].begin.policy_version = data.draw(
            st.integers(version + 1, 2**63 - 1) | st.just(version + 1)
        )
    elif op == "no_groups" and begin_at is not None:
        msgs = [m for m in msgs if m.WhichOneof("kind") != "group"]
        msgs[begin_at].begin.group_count = 0
    elif op == "empty_group" and "group" in kinds:
        del msgs[kinds.index("group")].group.trajectories[:]
    elif (t := _traj(msgs, slot, data)) is None:
        msgs = msgs[:-1]  # nothing left to break in a trajectory: drop StepEnd instead
    else:
        n = len(t.token_ids)
        if op == "lengths_disagree":
            name = data.draw(st.sampled_from(["logprobs", "versions", "loss_mask"]))
            rep = getattr(t, name)
            if data.draw(st.booleans()):
                rep.append(rep[-1])
            else:
                del rep[-1]
        elif op in ("nan_reward", "inf_reward"):
            t.reward = (
                math.nan
                if op == "nan_reward"
                else data.draw(st.sampled_from([math.inf, -math.inf]))
            )
        elif op in ("nan_logprob", "inf_logprob", "positive_logprob"):
            value = {
                "nan_logprob": math.nan,
                "inf_logprob": data.draw(st.sampled_from([math.inf, -math.inf])),
                "positive_logprob": data.draw(st.floats(2.0**-6, 2.0**127, width=32)),
            }[op]
            t.logprobs[data.draw(st.integers(0, n - 1))] = value
        elif op == "negative_id":
            t.token_ids[data.draw(st.integers(0, n - 1))] = data.draw(st.integers(-(2**31), -1))
        elif op == "out_of_vocab_id":
            t.token_ids[data.draw(st.integers(0, n - 1))] = data.draw(st.integers(VOCAB, 2**31 - 1))
        elif op == "empty_tokens":
            for name in ("token_ids", "logprobs", "versions", "loss_mask"):
                del getattr(t, name)[:]
            t.prompt_length = 0
        elif op == "prompt_length":
            t.prompt_length = data.draw(
                st.one_of(st.integers(-(2**31), -1), st.integers(n + 1, 2**31 - 1))
            )
        elif op == "mask_on_prompt":
            t.loss_mask[data.draw(st.integers(0, t.prompt_length - 1))] = True
        elif op == "version_below_minus_one":
            t.versions[data.draw(st.integers(0, n - 1))] = data.draw(st.integers(-(2**31), -2))
        elif op == "trained_token_without_version":
            t.versions[data.draw(st.integers(t.prompt_length, n - 1))] = -1
        elif op == "huge_repeated":
            # Far over max_tokens_per_mb, far under the 64 MiB message limit.
            extra = data.draw(st.integers(MAX_TOKENS, 500_000))
            t.token_ids.extend([7] * extra)
            t.logprobs.extend([-1.0] * extra)
            t.versions.extend([version] * extra)
            t.loss_mask.extend([True] * extra)
        elif op == "group_id_mismatch":
            t.group_id = data.draw(st.text(min_size=1, max_size=8).filter(lambda s: s[:1] != "g"))
    return msgs


@fuzz(40)
@given(
    ops=st.lists(st.sampled_from(STEP_MUTATIONS), min_size=1, max_size=2, unique=True),
    n_groups=st.integers(1, 3),
    data=st.data(),
)
def test_train_step_malformed(trainer: Trainer, tally: Tally, ops, n_groups, data) -> None:
    msgs = step_messages(
        valid_groups(n_groups, trainer.version), trainer.version, trainer.steps_run
    )
    for slot, op in enumerate(ops):
        msgs = mutate_step(msgs, op, trainer.version, slot, data)
    code, err = tally.call(
        "Trainer.TrainStep",
        lambda: trainer.train(msgs),
        allowed=(grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION),
    )
    assert code != grpc.StatusCode.OK, ops
    if set(ops) <= PRECONDITION:
        assert code == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    trainer.check_intact()
    if tally.sent["Trainer.TrainStep"] % 10 == 0:
        trainer.check_valid_step()


@st.composite
def edge_trajectory(draw: st.DrawFn, version: int) -> common_pb2.Trajectory:
    """A valid trajectory with extreme values: huge rewards, very unlikely tokens, no trained
    token at all, prompt-less samples, versions from the future."""
    n = draw(st.integers(1, 12))
    prompt = draw(st.integers(0, n))
    trained = [draw(st.booleans()) for _ in range(n - prompt)]
    return common_pb2.Trajectory(
        token_ids=draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)),
        # Down to -80 here; -100 and below have their own regression test (exp overflow).
        logprobs=[0.0] * prompt
        + draw(st.lists(st.floats(-80.0, 0.0, width=32), min_size=n - prompt, max_size=n - prompt)),
        versions=[-1] * prompt + [draw(st.sampled_from([version, 0, 2**31 - 1])) for _ in trained],
        loss_mask=[False] * prompt + trained,
        reward=draw(st.floats(-(2.0**127), 2.0**127, width=32)),
        prompt_length=prompt,
    )


@fuzz(12)
@given(data=st.data(), n_groups=st.integers(1, 2), size=st.integers(1, 3))
def test_train_step_extreme_but_valid(trainer: Trainer, tally: Tally, data, n_groups, size) -> None:
    """Valid steps with extreme values train, report finite stats and keep weights finite."""
    groups = [
        common_pb2.TrajectoryGroup(
            group_id=f"g{g}",
            trajectories=[data.draw(edge_trajectory(trainer.version)) for _ in range(size)],
        )
        for g in range(n_groups)
    ]
    msgs = step_messages(groups, trainer.version, trainer.steps_run)
    _, out = tally.call("Trainer.TrainStep(extreme valid)", lambda: trainer.train(msgs), allowed=())
    stats = out[-1].stats
    assert stats.policy_version == trainer.version + 1
    for name in ("loss", "grad_norm", "entropy", "importance_weight_mean", "reward_mean"):
        assert math.isfinite(getattr(stats, name)), (name, stats)
    assert all(torch.isfinite(v).all() for v in weights_of(trainer.svc).values())
    trainer.steps_run += 1
    trainer.remember()


@pytest.mark.parametrize("delta", [-1, 1, -(2**40), 2**40])
def test_train_step_wrong_policy_version(trainer: Trainer, tally: Tally, delta: int) -> None:
    """A step announced for another policy version is FAILED_PRECONDITION and trains nothing."""
    msgs = step_messages(
        valid_groups(2, trainer.version), trainer.version + delta, trainer.steps_run
    )
    code, _ = tally.call(
        "Trainer.TrainStep(wrong version)",
        lambda: trainer.train(msgs),
        allowed=(grpc.StatusCode.FAILED_PRECONDITION,),
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    trainer.check_intact()


@fuzz(8)
@given(
    sent=st.integers(0, 4),
    how=st.sampled_from(["iterator_raises", "client_cancel", "deadline"]),
)
def test_train_step_broken_streams(trainer: Trainer, tally: Tally, sent, how) -> None:
    """A TrainStep stream that breaks before StepEnd trains nothing; the rank stays usable."""
    msgs = step_messages(valid_groups(3, trainer.version), trainer.version, trainer.steps_run)[
        :sent
    ]
    holder: list[grpc.Future] = []

    class Broken(Exception):
        pass

    def requests() -> Iterator[trainer_pb2.TrainStepRequest]:
        yield from msgs
        if how == "iterator_raises":
            raise Broken("client iterator broke")
        if how == "client_cancel":
            while not holder:
                time.sleep(0.01)
            holder[0].cancel()
            return
        time.sleep(3.0)  # past the deadline

    def run() -> list[trainer_pb2.TrainStepResponse]:
        call = trainer.stub.TrainStep(requests(), timeout=1.0 if how == "deadline" else TIMEOUT)
        holder.append(call)
        return list(call)

    # UNKNOWN is the client library's report of its own raising iterator.
    code, _ = tally.call(
        f"Trainer.TrainStep({how})",
        run,
        allowed={
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.UNKNOWN,
        },
    )
    assert code != grpc.StatusCode.OK
    # The next valid step queues behind the refused one on the rank's worker: it must train
    # exactly one version up from the remembered state (the broken step trained nothing).
    trainer.check_valid_step()
    trainer.check_intact()


# ---------------------------------------------------------------- checkpoints and export

OUTSIDE = ["/", "/etc", "/tmp", "/dev/null", "../outside", "../../x", "./../x"]
# Relative paths are relative to the server's root, never to its working directory.
RELATIVE = ["ckpt", "./ckpt", "runs/x", "~", "runs/../ckpt"]


@st.composite
def hostile_paths(draw: st.DrawFn, root: Path) -> tuple[str, bool]:
    """(path, inside the root): traversal, outside, NUL, missing, plain names under the root."""
    kind = draw(st.sampled_from(["outside", "relative", "traversal", "nul", "empty", "inside"]))
    if kind == "outside":
        return draw(st.sampled_from(OUTSIDE)), False
    if kind == "relative":
        return draw(st.sampled_from(RELATIVE)), True
    if kind == "traversal":
        depth = draw(st.integers(1, 4))
        return str(root) + "/.." * depth + "/" + draw(st.sampled_from(["outside", "x", ""])), False
    if kind == "nul":
        return str(root / "a\x00b"), False
    if kind == "empty":
        return "", False
    name = draw(
        st.sampled_from(
            ["no_meta", "garbage_meta", "missing", "ck", "ck/inner", "a b", "ünï", ".."]
        )
        | st.text(
            st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)),
            min_size=1,
            max_size=30,
        )
    )
    # The root itself is refused: it has its own regression test below.
    path = root / name
    if path.resolve() == root.resolve():
        path = root / "ck"
    return str(path), path.resolve().is_relative_to(root.resolve())


@fuzz(40)
@given(rpc=st.sampled_from(["save", "load", "export"]), data=st.data(), global_step=I64)
def test_checkpoint_and_export_paths(
    trainer: Trainer, tally: Tally, rpc, data, global_step
) -> None:
    path, inside = data.draw(hostile_paths(trainer.root))
    target = (trainer.root / path).resolve() if inside else None
    # Only a missing or empty directory, or one the project wrote, may be (re)written.
    foreign = (
        target is not None
        and target.exists()
        and not is_marked(target)
        and (not target.is_dir() or any(target.iterdir()))
    )
    if rpc == "save":
        fn = lambda: trainer.stub.SaveCheckpoint(  # noqa: E731
            trainer_pb2.SaveCheckpointRequest(path=path, global_step=global_step), timeout=TIMEOUT
        )
    elif rpc == "load":
        fn = lambda: trainer.stub.LoadCheckpoint(  # noqa: E731
            trainer_pb2.LoadCheckpointRequest(path=path), timeout=TIMEOUT
        )
    else:
        fn = lambda: trainer.stub.ExportModel(  # noqa: E731
            trainer_pb2.ExportModelRequest(path=path), timeout=TIMEOUT
        )
    code, resp = tally.call(f"Trainer.{rpc.capitalize()}", fn)
    if not inside:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, code)
    elif rpc in ("save", "export") and foreign:
        assert code == grpc.StatusCode.FAILED_PRECONDITION, (path, code)
    elif rpc in ("save", "export"):
        assert code == grpc.StatusCode.OK, (path, code)
        assert resp.policy_version == trainer.version and Path(resp.path).is_dir()
    if rpc == "load" and code == grpc.StatusCode.OK:
        # A checkpoint saved earlier in this run: its weights and version are served now.
        trainer.remember()
    trainer.check_intact()


# ---------------------------------------------------------------------------- PublishWeights

# All refused by validation: random "host:port" strings would make the trainer resolve
# random host names.
# Any Duration message: valid ones (including zero: the rank's default, and the largest a
# Duration may hold) and invalid ones (negative, nanos out of range or of the other sign).
DURATIONS = st.builds(
    duration_pb2.Duration,
    seconds=st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(0, 3)),
    nanos=st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(0, 999_999_999)),
)
ADDRESSES = st.one_of(
    st.sampled_from(["", ":", ":80", "host", "127.0.0.1", "[::1]", "::1"]),
    st.text(max_size=20).filter(lambda a: ":" not in a),
)


@fuzz(40)
@given(
    addresses=st.lists(ADDRESSES, min_size=1, max_size=3),
    methods=st.lists(st.one_of(st.integers(0, 4), I32), max_size=4),
    bucket=st.one_of(st.integers(-(2**63), -1), I64),
    timeout=DURATIONS,
)
def test_publish_weights_bad_requests(
    trainer: Trainer, tally: Tally, addresses, methods, bucket, timeout
) -> None:
    req = trainer_pb2.PublishWeightsRequest(
        rollout_addresses=addresses, methods=methods, bucket_bytes=bucket, timeout=timeout
    )
    code, resp = tally.call(
        "Trainer.PublishWeights", lambda: trainer.stub.PublishWeights(req, timeout=TIMEOUT)
    )
    if code == grpc.StatusCode.OK:
        # Well-formed but unreachable targets are reported per target, never as success.
        assert len(resp.results) == len(addresses)
        assert all(r.status.code != grpc.StatusCode.OK.value[0] for r in resp.results)
        assert resp.policy_version == trainer.version
    trainer.check_intact()


@fuzz(20)
@given(
    port=st.integers(1, 65535),
    methods=st.lists(st.sampled_from([1, 2, 3]), unique=True, max_size=3),
    timeout=st.one_of(st.sampled_from([0.5, 2.0]).map(duration), DURATIONS),
)
def test_publish_weights_unreachable_targets(
    trainer: Trainer, tally: Tally, port, methods, timeout
) -> None:
    """Valid requests to addresses with nothing listening: per-target failures, no hang."""
    req = trainer_pb2.PublishWeightsRequest(
        rollout_addresses=[f"127.0.0.1:{port}", f"no-such-host.invalid:{port}"],
        methods=methods,
        timeout=timeout,
    )
    code, resp = tally.call(
        "Trainer.PublishWeights", lambda: trainer.stub.PublishWeights(req, timeout=TIMEOUT)
    )
    if code == grpc.StatusCode.OK:
        assert [r.address for r in resp.results] == list(req.rollout_addresses)
        assert resp.policy_version == trainer.version
    trainer.check_intact()


def test_valid_step_after_fuzzing(trainer: Trainer, tally: Tally) -> None:
    tally.note("Trainer.TrainStep(valid)", "OK")
    trainer.check_valid_step()
    trainer.check_intact()


# ------------------------------------------------- regressions found by this fuzzing


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[Trainer]:
    root = tmp_path / "root"
    root.mkdir()
    t = start_trainer(root)
    yield t
    stop_trainer(t)


@pytest.mark.parametrize("rpc", ["save", "export"])
def test_path_equal_to_root_is_refused(fresh: Trainer, rpc: str) -> None:
    keep = fresh.root / "older_checkpoint"
    keep.mkdir()
    (keep / "marker").write_text("precious")
    try:
        if rpc == "save":
            fresh.stub.SaveCheckpoint(
                trainer_pb2.SaveCheckpointRequest(path=str(fresh.root)), timeout=TIMEOUT
            )
        else:
            fresh.stub.ExportModel(
                trainer_pb2.ExportModelRequest(path=str(fresh.root)), timeout=TIMEOUT
            )
    except grpc.RpcError as err:
        assert err.code() in DOCUMENTED
    assert (keep / "marker").read_text() == "precious"
    assert sorted(p.name for p in fresh.root.parent.iterdir()) == ["root"]


@pytest.mark.parametrize("name", ["a_file/ck", "x" * 300])
def test_uncreatable_checkpoint_path_is_invalid_argument(fresh: Trainer, name: str) -> None:
    (fresh.root / "a_file").write_text("a file, not a directory")
    with pytest.raises(grpc.RpcError) as info:
        fresh.stub.SaveCheckpoint(
            trainer_pb2.SaveCheckpointRequest(path=str(fresh.root / name)), timeout=TIMEOUT
        )
    assert info.value.code() in DOCUMENTED, info.value.details()
    fresh.check_intact()


def test_load_with_bad_meta_leaves_state_intact(fresh: Trainer) -> None:
    ck = fresh.root / "ck"
    fresh.stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(path=str(ck)), timeout=TIMEOUT)
    fresh.check_valid_step()  # the served weights now differ from the checkpoint's
    meta = json.loads((ck / "trainer_meta.json").read_text())
    del meta["scheduler"]
    (ck / "trainer_meta.json").write_text(json.dumps(meta))
    try:
        fresh.stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(path=str(ck)), timeout=TIMEOUT)
    except grpc.RpcError as err:
        assert err.code() in DOCUMENTED, err.code()
    fresh.check_intact()


@pytest.mark.parametrize("damage", ["no_dcp_files", "truncated_dcp_files"])
def test_load_of_a_broken_checkpoint_answers(fresh: Trainer, damage: str) -> None:
    ck = fresh.root / "ck"
    fresh.stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(path=str(ck)), timeout=TIMEOUT)
    for f in ck.iterdir():
        if f.name != "trainer_meta.json":
            if damage == "no_dcp_files":
                f.unlink()
            else:
                f.write_bytes(f.read_bytes()[:64])
    with pytest.raises(grpc.RpcError) as info:
        fresh.stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(path=str(ck)), timeout=3)
    assert info.value.code() in DOCUMENTED, info.value.code()
    fresh.check_intact()


def test_very_unlikely_behaviour_tokens_do_not_poison_weights(fresh: Trainer) -> None:
    def traj(reward: float) -> common_pb2.Trajectory:
        return common_pb2.Trajectory(
            token_ids=[5, 6, 7, 8],
            logprobs=[0.0, 0.0, -100.0, -100.0],
            versions=[-1, -1, 0, 0],
            loss_mask=[False, False, True, True],
            reward=reward,
            prompt_length=2,
        )

    group = common_pb2.TrajectoryGroup(group_id="g", trajectories=[traj(0.0), traj(1.0)])
    try:
        out = fresh.train(step_messages([group], 0, 0))
        assert math.isfinite(out[-1].stats.grad_norm), out[-1].stats
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert all(torch.isfinite(v).all() for v in weights_of(fresh.svc).values())


def test_undecodable_bytes_are_invalid_argument(trainer: Trainer) -> None:
    """Bytes that are not the request message get INVALID_ARGUMENT naming its type."""
    status = trainer.channel.unary_unary(
        "/arealgrpc.v1.TrainerService/GetTrainerStatus", request_serializer=lambda b: b
    )
    step = trainer.channel.stream_stream(
        "/arealgrpc.v1.TrainerService/TrainStep", request_serializer=lambda b: b
    )
    calls = {
        "arealgrpc.v1.GetTrainerStatusRequest": lambda: status(b"\xff", timeout=TIMEOUT),
        "arealgrpc.v1.TrainStepRequest": lambda: list(step(iter([b"\xff"]), timeout=TIMEOUT)),
    }
    for type_name, send in calls.items():
        with pytest.raises(grpc.RpcError) as info:
            send()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, type_name
        assert f"not a valid {type_name}" in info.value.details()
    trainer.check_intact()
