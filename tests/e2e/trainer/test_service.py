"""TrainerService end to end: two real ``areal-trainer`` rank processes (FSDP2 over gloo on
loopback) driven concurrently over gRPC, compared with a plain in-process engine.

The tests share one pair of ranks and run in file order (each step moves the policy version
on): equality with a plain step and a loadable export, then bad input, then checkpoint
recovery onto a fresh pair of ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
import transformers
from areal_servers.trainer.engine import TrainerEngine
from arealgrpc.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc, weight_sync_pb2
from safetensors.torch import load_file

from areal_grpc.batch import batch_to_trajectories, groups_to_batch
from areal_grpc.config import ModelConfig, OptimizerSettings, PPOSettings, TrainerConfig
from areal_grpc.errors import field_violations
from areal_grpc.model import load_tokenizer
from areal_grpc.ports import free_port
from areal_grpc.server import sync_channel

MODEL = "builtin:micro"
LR = 1e-5
MAX_TOKENS = 30
RPC_TIMEOUT = 120.0


@dataclass
class Rank:
    process: subprocess.Popen[str]
    address: str
    stub: trainer_pb2_grpc.TrainerServiceStub
    channel: grpc.Channel


def start_ranks(log_dir: Path, root: Path, world: int = 2) -> list[Rank]:
    """Starts ``world`` areal-trainer processes (paths confined to ``root``); waits for each."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    ranks = []
    for r in range(world):
        cmd = [
            sys.executable,
            "-m",
            "areal_servers.trainer",
            "--port=0",
            f"--rank={r}",
            f"--world-size={world}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "--log-level=WARNING",
            f"model.source={MODEL}",
            "trainer.torch_threads=1",
            f"trainer.optimizer.lr={LR}",
            "trainer.optimizer.warmup_steps=2",
            f"trainer.max_tokens_per_mb={MAX_TOKENS}",
            "trainer.collective_timeout_s=120",
            # fp32 compute, as the plain engine it is compared with.
            "trainer.mixed_precision=off",
            f"output.dir={root}",
        ]
        log = open(log_dir / f"rank{r}.log", "w")  # noqa: SIM115 (lives with the process)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("LISTENING "), f"rank {r} did not start: {line!r}"
        address = line.split()[1]
        channel = sync_channel(address)
        ranks.append(Rank(proc, address, trainer_pb2_grpc.TrainerServiceStub(channel), channel))
    return ranks


def stop_ranks(ranks: list[Rank], kill: bool = False) -> None:
    for rank in ranks:
        rank.channel.close()
        if rank.process.poll() is None:
            rank.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
    for rank in ranks:
        rank.process.wait(timeout=30)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Iterator[list[Rank]]:
    pair = start_ranks(tmp_path_factory.mktemp("ranks"), tmp_path_factory.getbasetemp())
    yield pair
    stop_ranks(pair)


def to_groups(batch) -> list[common_pb2.TrajectoryGroup]:
    trajs = batch_to_trajectories(batch)
    groups: dict[int, common_pb2.TrajectoryGroup] = {}
    for traj, g in zip(trajs, batch["group_index"].tolist(), strict=True):
        traj.group_id = f"g{g}"
        groups.setdefault(g, common_pb2.TrajectoryGroup(group_id=f"g{g}")).trajectories.append(traj)
    return [groups[g] for g in sorted(groups)]


def step_messages(step: int, version: int, groups) -> list[trainer_pb2.TrainStepRequest]:
    begin = trainer_pb2.StepBegin(global_step=step, policy_version=version, group_count=len(groups))
    return [
        trainer_pb2.TrainStepRequest(begin=begin),
        *(trainer_pb2.TrainStepRequest(group=g) for g in groups),
        trainer_pb2.TrainStepRequest(end=trainer_pb2.StepEnd()),
    ]


def call_step(rank: Rank, messages):
    """(progress list, stats) or the RpcError the rank answered."""
    try:
        progress, stats = [], None
        for resp in rank.stub.TrainStep(iter(messages), timeout=RPC_TIMEOUT):
            if resp.HasField("stats"):
                stats = resp.stats
            else:
                progress.append(resp.progress)
        return progress, stats
    except grpc.RpcError as err:
        return err


def run_step(ranks: list[Rank], per_rank_messages):
    """Drives TrainStep on every rank at once, as the coordinator does."""
    with ThreadPoolExecutor(len(ranks)) as pool:
        futures = [
            pool.submit(call_step, r, m) for r, m in zip(ranks, per_rank_messages, strict=True)
        ]
        return [f.result(timeout=RPC_TIMEOUT + 10) for f in futures]


def status(rank: Rank) -> trainer_pb2.GetTrainerStatusResponse:
    return rank.stub.GetTrainerStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=RPC_TIMEOUT)


def export(ranks: list[Rank], path: Path) -> dict[str, torch.Tensor]:
    """Exports through every rank (collective) and reads the weights rank 0 wrote."""
    with ThreadPoolExecutor(len(ranks)) as pool:
        req = trainer_pb2.ExportModelRequest(path=str(path))
        futures = [pool.submit(r.stub.ExportModel, req, timeout=RPC_TIMEOUT) for r in ranks]
        for f in futures:
            assert f.result().path == str(path)
    return load_file(path / "model.safetensors")


def collective(ranks: list[Rank], method: str, request):
    with ThreadPoolExecutor(len(ranks)) as pool:
        futures = [
            pool.submit(getattr(r.stub, method), request, timeout=RPC_TIMEOUT) for r in ranks
        ]
        return [f.result() for f in futures]


def plain_engine() -> TrainerEngine:
    return TrainerEngine(
        # The ranks' settings: their run config's defaults (weight decay 0) and overrides.
        TrainerConfig(
            fsdp=False,
            device="cpu",
            mixed_precision="off",
            ppo=PPOSettings(),
            max_tokens_per_mb=MAX_TOKENS,
            optimizer=OptimizerSettings(lr=LR, warmup_steps=2, weight_decay=0.0),
        ),
        ModelConfig(source=MODEL),
    )


def max_diff(exported: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> float:
    # The export drops the tied lm_head (it is the embedding matrix).
    return max(float((exported[k] - full[k]).abs().max()) for k in exported)


def test_two_ranks_over_grpc_equal_one_plain_step_and_export_generates(ranks, make_batch, tmp_path):
    assert [status(r).policy_version for r in ranks] == [0, 0]
    groups = to_groups(make_batch(seed=10))
    # Uneven shards: 3 groups on rank 0, 1 on rank 1.
    results = run_step(ranks, [step_messages(0, 0, groups[:3]), step_messages(0, 0, groups[3:])])
    for res in results:
        assert not isinstance(res, grpc.RpcError), res
        progress, stats = res
        assert stats.policy_version == 1 and stats.global_step == 0
        assert stats.sequences == 8
        assert progress[-1].phase == trainer_pb2.STEP_PHASE_UPDATE
        assert progress[-1].microbatches_done == progress[-1].microbatches_total
    # Both ranks ran the same number of micro-batches and report the same global stats.
    assert results[0][1].trained_tokens == results[1][1].trained_tokens
    assert results[0][1].loss == results[1][1].loss
    assert {s.microbatches_total for r in results for s in r[0]} == {
        results[0][0][-1].microbatches_total
    }
    st = [status(r) for r in ranks]
    assert [(s.rank, s.world_size, s.policy_version, s.backend) for s in st] == [
        (0, 2, 1, weight_sync_pb2.COLLECTIVE_BACKEND_GLOO),
        (1, 2, 1, weight_sync_pb2.COLLECTIVE_BACKEND_GLOO),
    ]

    plain = plain_engine()
    want = plain.train_step(groups_to_batch(groups))
    assert results[0][1].trained_tokens == want.trained_tokens
    assert results[0][1].loss == pytest.approx(want.loss, abs=1e-6)

    path = tmp_path / "export"
    weights = export(ranks, path)
    diff = max_diff(weights, plain.full_state_dict())
    print(f"2-rank gRPC step vs plain step: max abs diff {diff:.3e}")
    assert diff <= 1e-5

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    tokenizer = load_tokenizer(str(path))
    prompt = tokenizer("2+2=", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 4
    assert isinstance(tokenizer.decode(out[0]), str)


def bad_length(groups):
    g = [common_pb2.TrajectoryGroup() for _ in groups]
    for dst, src in zip(g, groups, strict=True):
        dst.CopyFrom(src)
    del g[0].trajectories[1].logprobs[-1]
    return g, "groups[0].trajectories[1].logprobs"


def bad_reward(groups):
    g = [common_pb2.TrajectoryGroup() for _ in groups]
    for dst, src in zip(g, groups, strict=True):
        dst.CopyFrom(src)
    g[1].trajectories[0].reward = float("nan")
    return g, "groups[1].trajectories[0].reward"


def bad_token(groups):
    g = [common_pb2.TrajectoryGroup() for _ in groups]
    for dst, src in zip(g, groups, strict=True):
        dst.CopyFrom(src)
    g[0].trajectories[0].token_ids[3] = 384
    return g, "groups[0].trajectories[0].token_ids[3]"


@pytest.mark.parametrize("bad_rank", [0, 1])
@pytest.mark.parametrize("corrupt", [bad_length, bad_reward, bad_token])
def test_bad_trajectories_are_invalid_argument_and_nothing_trains(
    ranks, make_batch, bad_rank, corrupt
):
    version = status(ranks[0]).policy_version
    groups = to_groups(make_batch(seed=11))
    shards = [groups[:2], groups[2:]]
    shards[bad_rank], field = corrupt(shards[bad_rank])
    results = run_step(ranks, [step_messages(version, version, s) for s in shards])
    bad, good = results[bad_rank], results[1 - bad_rank]
    assert isinstance(bad, grpc.RpcError) and bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(bad)[0][0] == field
    assert isinstance(good, grpc.RpcError) and good.code() == grpc.StatusCode.ABORTED
    assert [status(r).policy_version for r in ranks] == [version, version]


def test_protocol_errors_and_empty_steps_are_rejected_then_a_good_step_works(ranks, make_batch):
    version = status(ranks[0]).policy_version
    groups = to_groups(make_batch(seed=12))
    good = step_messages(version, version, groups[:2])
    end_first = [trainer_pb2.TrainStepRequest(end=trainer_pb2.StepEnd()), *good]
    res = run_step(ranks, [end_first, good])
    assert res[0].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(res[0])[0][0] == "end"
    assert res[1].code() == grpc.StatusCode.ABORTED

    # No data on any rank: every rank says so.
    empty = step_messages(version, version, [])
    res = run_step(ranks, [empty, empty])
    for r in res:
        assert r.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(r)[0][0] == "groups"

    # A stale policy version is a version conflict, not bad input.
    stale = step_messages(version, version - 1, groups[:2])
    res = run_step(ranks, [stale, step_messages(version, version, groups[2:])])
    assert res[0].code() == grpc.StatusCode.FAILED_PRECONDITION
    assert res[1].code() == grpc.StatusCode.ABORTED

    assert [status(r).policy_version for r in ranks] == [version, version]
    # The ranks are still up and in step: all data on rank 1, rank 0 joins empty-handed.
    res = run_step(
        ranks, [step_messages(version, version, []), step_messages(version, version, groups)]
    )
    for r in res:
        assert not isinstance(r, grpc.RpcError), r
        assert r[1].policy_version == version + 1 and r[1].sequences == 8


def test_a_cancelled_stream_on_one_rank_releases_the_others(ranks, make_batch):
    version = status(ranks[0]).policy_version
    groups = to_groups(make_batch(seed=14))
    gate = threading.Event()

    def stalled():
        yield step_messages(version, version, groups[:2])[0]
        gate.wait(RPC_TIMEOUT)

    call = ranks[0].stub.TrainStep(stalled(), timeout=RPC_TIMEOUT)
    call.initial_metadata()  # rank 0 has taken the step on
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(call_step, ranks[1], step_messages(version, version, groups[2:]))
        call.cancel()
        gate.set()
        res = other.result(timeout=RPC_TIMEOUT + 10)
    assert isinstance(res, grpc.RpcError) and res.code() == grpc.StatusCode.ABORTED
    assert [status(r).policy_version for r in ranks] == [version, version]
    res = run_step(ranks, [step_messages(version, version, g) for g in (groups[:2], groups[2:])])
    assert all(r[1].policy_version == version + 1 for r in res)


def test_checkpoint_then_kill_then_resume_equals_uninterrupted_run(
    ranks, make_batch, tmp_path, tmp_path_factory
):
    version = status(ranks[0]).policy_version
    ckpt = tmp_path / "ckpt"
    saved = collective(
        ranks, "SaveCheckpoint", trainer_pb2.SaveCheckpointRequest(path=str(ckpt), global_step=7)
    )
    assert {s.policy_version for s in saved} == {version}
    assert ckpt.is_dir() and not (tmp_path / ".ckpt.tmp").exists()
    groups = to_groups(make_batch(seed=13))
    shards = [groups[1:], groups[:1]]
    step = [step_messages(7, version, s) for s in shards]
    uninterrupted_stats = [r[1] for r in run_step(ranks, step)]
    uninterrupted = export(ranks, tmp_path / "uninterrupted")

    stop_ranks(ranks, kill=True)
    fresh = start_ranks(tmp_path, tmp_path_factory.getbasetemp())
    try:
        missing = trainer_pb2.LoadCheckpointRequest(path=str(tmp_path / "missing"))
        with pytest.raises(grpc.RpcError) as err:
            collective(fresh, "LoadCheckpoint", missing)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        loaded = collective(
            fresh, "LoadCheckpoint", trainer_pb2.LoadCheckpointRequest(path=str(ckpt))
        )
        assert [(x.global_step, x.policy_version) for x in loaded] == [(7, version)] * 2
        resumed_stats = [r[1] for r in run_step(fresh, step)]
        resumed = export(fresh, tmp_path / "resumed")
    finally:
        stop_ranks(fresh)
    assert resumed.keys() == uninterrupted.keys()
    for key in resumed:
        assert torch.equal(resumed[key], uninterrupted[key]), key
    for a, b in zip(resumed_stats, uninterrupted_stats, strict=True):
        assert (a.loss, a.learning_rate, a.policy_version) == (
            b.loss,
            b.learning_rate,
            b.policy_version,
        )
