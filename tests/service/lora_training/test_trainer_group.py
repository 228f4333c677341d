"""The Tinker service's trainer group (tinker.trainer_ranks > 1): real worker processes in a
gloo group with this process as rank 0. It trains every loss as one process does, carries a
saved state to every rank, and replaces a worker that is killed or stalls, then reruns the
call as if the worker had never failed."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from areal_servers.lora_training.engine import AdamParams, AdapterSpec, Datum, LoraEngine
from areal_servers.lora_training.replicas import GroupEngine

torch.set_num_threads(1)

MODEL = "builtin:tiny"
SPEC = AdapterSpec(rank=4, seed=1)
ADAM = AdamParams(learning_rate=1e-2)
# Both sides compute in float64: the group takes its sums in another order (each rank's share,
# then the all-reduce), which moves a result by about (terms) * 2**-52 of the values summed.
# Log-probs, metrics and gradients carry that alone: RTOL (and ATOL for values near 0).
# The weights after Adam carry more: Adam divides each gradient by its own size (eps 1e-12),
# so a gradient summed to about 0 turns an absolute rounding d into lr * d / eps in its weight:
# d <= ~1e-16 here (summands <= ~1, 2**-52 each), 1e-2 * 1e-16 / 1e-12 = 1e-6 = WEIGHT_ATOL.
# In float32 that bound is 1e-2 * 1e-7 / 1e-12, a whole Adam step: no tolerance would separate
# a group that trains as one process does from one that does not.
DTYPE = torch.float64
RTOL = 1e-9
ATOL = 1e-12
WEIGHT_ATOL = 1e-6


def rl_data(lengths: tuple[int, ...] = (7, 3, 9, 4, 5)) -> list[Datum]:
    """Datums of several lengths with every per-token field (so any loss takes them)."""
    data = []
    for i, n in enumerate(lengths):
        data.append(
            Datum(
                input_tokens=[(5 + i + t) % 60 for t in range(n)],
                target_tokens=[(6 + i + t) % 60 for t in range(n)],
                weights=[1.0] * n,
                logprobs=[-2.0 - 0.1 * t for t in range(n)],
                advantages=[(-1.0) ** (i + t) * 0.5 for t in range(n)],
            )
        )
    return data


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GroupEngine]:
    """Three ranks, so that a call of two datums leaves one rank with none."""
    engine = GroupEngine(
        MODEL, world=3, timeout_s=60, log_dir=tmp_path_factory.mktemp("group-logs"), dtype=DTYPE
    )
    try:
        yield engine
    finally:
        engine.close()
    assert not torch.distributed.is_initialized()


@pytest.fixture(scope="module")
def alone() -> LoraEngine:
    return LoraEngine(MODEL, dtype=DTYPE)


def assert_same_run(group: GroupEngine, alone: LoraEngine, run_id: str) -> None:
    """The group's rank 0 holds what one process holds: weights and pending gradients."""
    mine, theirs = group.parameters(run_id), alone.parameters(run_id)
    assert mine.keys() == theirs.keys()
    for key, param in mine.items():
        assert param.dtype == DTYPE, key
        torch.testing.assert_close(param, theirs[key], rtol=RTOL, atol=WEIGHT_ATOL, msg=key)
        if theirs[key].grad is None:
            assert param.grad is None, key
        else:
            torch.testing.assert_close(param.grad, theirs[key].grad, rtol=RTOL, atol=ATOL, msg=key)


def both(group: GroupEngine, alone: LoraEngine, method: str, *args, **kwargs):
    return getattr(group, method)(*args, **kwargs), getattr(alone, method)(*args, **kwargs)


def assert_same_output(a, b) -> None:
    (lp_a, metrics_a), (lp_b, metrics_b) = a, b
    assert [len(x) for x in lp_a] == [len(x) for x in lp_b]
    for x, y in zip(lp_a, lp_b, strict=True):
        assert x == pytest.approx(y, rel=RTOL, abs=ATOL)
    assert metrics_a == pytest.approx(metrics_b, rel=RTOL, abs=ATOL)


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"])
def test_the_group_trains_each_loss_as_one_process_does(
    group: GroupEngine, alone: LoraEngine, loss_fn: str
):
    run = f"loss-{loss_fn}"
    both(group, alone, "create", run, SPEC)
    first = both(group, alone, "forward_backward", run, rl_data(), loss_fn, {})
    assert_same_output(*first)
    # Gradients accumulate over calls; two datums leave the third rank without a share.
    assert_same_output(*both(group, alone, "forward_backward", run, rl_data((11, 2)), loss_fn, {}))
    assert_same_run(group, alone, run)
    metrics = both(group, alone, "optim_step", run, ADAM)
    assert metrics[0] == pytest.approx(metrics[1], rel=RTOL)
    assert metrics[0]["grad_norm:mean"] > 0
    assert_same_run(group, alone, run)
    after = both(group, alone, "forward_backward", run, rl_data(), loss_fn, {})
    assert_same_output(*after)
    assert after[0][1]["loss:sum"] != pytest.approx(first[0][1]["loss:sum"], rel=1e-3)
    both(group, alone, "delete", run)


def test_a_loaded_state_reaches_every_rank_and_training_resumes_exactly(
    group: GroupEngine, alone: LoraEngine, tmp_path: Path
):
    """load_state on rank 0 alone would leave the workers on the old adapter: their share
    of the next gradient would then differ from one process's."""
    both(group, alone, "create", "saved", SPEC)
    for _ in range(2):
        both(group, alone, "forward_backward", "saved", rl_data(), "ppo", {})
        both(group, alone, "optim_step", "saved", ADAM)
    group.save_state("saved", tmp_path, optimizer=True)
    both(group, alone, "create", "loaded", AdapterSpec(rank=4, seed=7))
    both(group, alone, "load_state", "loaded", tmp_path, optimizer=True)
    for _ in range(2):
        assert_same_output(*both(group, alone, "forward_backward", "loaded", rl_data(), "ppo", {}))
        both(group, alone, "optim_step", "loaded", ADAM)
    assert_same_run(group, alone, "loaded")
    assert group.steps("loaded") == alone.steps("loaded") == 4


def test_a_worker_killed_between_calls_is_replaced_before_the_next(
    group: GroupEngine, alone: LoraEngine
):
    both(group, alone, "create", "between", SPEC)
    both(group, alone, "forward_backward", "between", rl_data(), "cross_entropy", {})
    both(group, alone, "optim_step", "between", ADAM)
    # Pending gradients must survive the restart too.
    both(group, alone, "forward_backward", "between", rl_data(), "cross_entropy", {})
    victim = group.workers[0].process
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    out = both(group, alone, "forward_backward", "between", rl_data(), "cross_entropy", {})
    assert_same_output(*out)
    assert victim.pid not in [w.process.pid for w in group.workers]
    assert all(w.alive() for w in group.workers)
    both(group, alone, "optim_step", "between", ADAM)
    assert_same_run(group, alone, "between")


def test_a_worker_killed_during_a_call_fails_no_call_and_loses_nothing(
    group: GroupEngine, alone: LoraEngine
):
    """The kill lands while the call is under way (its collectives fail): the group undoes
    the call's share, restarts its workers and reruns it."""
    both(group, alone, "create", "during", SPEC)
    big = rl_data((60,) * 40)
    victim = group.workers[1].process
    killer = threading.Timer(0.05, os.kill, (victim.pid, signal.SIGKILL))
    killer.start()
    out = both(group, alone, "forward_backward", "during", big, "cross_entropy", {})
    killer.join()
    assert victim.wait(timeout=10) == -signal.SIGKILL
    assert_same_output(*out)
    assert victim.pid not in [w.process.pid for w in group.workers]
    both(group, alone, "optim_step", "during", ADAM)
    assert_same_run(group, alone, "during")
