"""Trainer step throughput: a 2-rank FSDP2 step through gRPC TrainStep vs the same step
in-process, and padding waste of the FFD token-budget packer vs fixed micro-batches.

1. ``train_step``: trained tokens/s (``StepStats.trained_tokens``, the loss-mask tokens of the
   global batch, over the step's wall time seen by the driver) of a GRPO step on
   ``--model`` (default builtin:tiny) with 2 ranks, FSDP2 over gloo on loopback:

   * measured: two real ``areal-trainer`` subprocesses; this script drives TrainStep on both
     at once (one thread per rank, StepBegin, the rank's TrajectoryGroups, StepEnd; progress
     and stats streamed back), as the coordinator does. Time: from the first request to the
     StepStats of both ranks.
   * baseline: two worker subprocesses of this script (``--worker``), the same 2-rank gloo
     group without gRPC. Each builds its ``TrainerEngine`` from the *same* trainer command
     line, parsed by ``areal-trainer``'s own parser and ``config_from_args`` (so model,
     optimizer, PPO and micro-batch settings are identical), and for each step runs
     ``groups_to_batch`` on the same TrajectoryGroup messages (with the vocabulary check the
     server does) and ``TrainerEngine.train_step`` (built and run on one worker thread, as
     the server does). The driver sends "step i" on the workers' stdin and waits for both to
     answer. Time: from the command to both answers.
     What the baseline leaves out is exactly the service: proto (de)serialization and
     transport of the shard, the TrainStep stream, progress messages, the service's
     agreement all_gather and its validation of StepBegin.

   Both sides get the same batches (seeded; prompt ~ lognormal(median 24, sigma 0.5),
   response ~ lognormal(median 96, sigma 0.8), at most 512 tokens), split over the ranks by
   ``areal_grpc.dispatch.dispatch_groups``. All four processes stay up for the whole run and
   the two sides alternate step by step (order flipped every step), so machine load hits both
   alike; ``--warmup`` steps of each side are not timed. Every process uses one torch thread.
   Both sides must report the same trained tokens per step (checked).
2. ``microbatch_padding``: padding waste (padded slots / all slots, ``padding_waste``) of
   ``plan_microbatches`` (FFD, ``--mb-budget`` tokens per micro-batch) vs fixed micro-batches:
   the same rows in arrival order cut into the same *number* of consecutive micro-batches of
   equal row count. Lengths: RL-style long tail (groups of 8 sharing a prompt
   ~ lognormal(median 150, sigma 0.5); responses ~ difficulty x lognormal(median 600,
   sigma 1.0), capped at 8192), averaged over ``--mb-trials`` shards of ``--mb-groups`` groups.

Reported figures are medians over the timed steps (tok/s) and means over the trials (waste).
3. ``train_step_bf16`` (``--compare-precision``, instead of 1 and 2): trained tokens/s of
   the same TrainStep on two 2-rank trainer groups, one computing in bf16
   (``trainer.mixed_precision=on``: FSDP2 casts the parameters to bf16 for the forward and
   backward, gradients are reduced and the optimizer steps in fp32) and one in fp32 (``off``),
   the steps alternating between them; ratio = bf16 / fp32. ``train_step_bf16_memory``: the
   peak RSS of each group's ranks.
4. ``train_step_tree_groups`` and ``train_step_tree_sessions`` (``--prefix-sharing``, instead
   of 1 and 2): trained tokens/s of the same TrainStep on two 2-rank trainer groups, one
   computing each prefix a group shares once (``trainer.prefix_sharing=on``) and one computing
   every row whole (``off``), steps alternating; ratio = shared / unshared. ``groups``: the
   arithmetic example's shape (``--groups`` groups of 16 completions of a 28-token prompt, 4-16
   tokens each); ``sessions``: the agent example's (``--groups`` sessions of 4 turns, one
   trajectory per turn holding the conversation so far). Each case prints the tokens per step
   unshared and the nodes computed shared.

Default run: about a minute on 2 CPU cores::

    .venv/bin/python bench/train_step.py [--steps 8] [--groups 8] [--group-size 4]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from arealgrpc.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from memory import peak_rss_gib
from results import result
from teardown import exit_on_sigterm

from areal_grpc.dispatch import dispatch_groups
from areal_grpc.durations import seconds
from areal_grpc.launch import Child, python_module_argv, start_child, stop_children
from areal_grpc.ports import free_port
from areal_grpc.prefixes import prefix_nodes
from areal_grpc.server import sync_channel

WORLD = 2
RPC_TIMEOUT_S = 300.0
STEP_PREFIX = "BENCH-STEP "
READY = "BENCH-READY"


# ----------------------------------------------------------------------------------- data


def step_groups(args: argparse.Namespace, step: int) -> list[common_pb2.TrajectoryGroup]:
    """The step's TrajectoryGroups: seeded, long-tailed lengths that fit the model context.

    Prompt ~ lognormal(median --prompt-median, sigma 0.5), response ~ lognormal(median
    --response-median, sigma 0.8), total capped at --max-seq-len. Behaviour log-probs are
    near the uniform policy's (about what the random-init model gives), rewards 0/1.
    """
    rng = random.Random(args.seed * 1_000_003 + step)
    uniform_logp = -math.log(384)
    groups = []
    for g in range(args.groups):
        prompt_len = min(
            args.max_seq_len // 4,
            max(4, round(rng.lognormvariate(math.log(args.prompt_median), 0.5))),
        )
        prompt = [rng.randrange(3, 384) for _ in range(prompt_len)]
        group = common_pb2.TrajectoryGroup(group_id=f"s{step}g{g}", task_id=f"s{step}g{g}")
        for _ in range(args.group_size):
            resp_len = round(rng.lognormvariate(math.log(args.response_median), 0.8))
            resp_len = min(args.max_seq_len - prompt_len, max(1, resp_len))
            n = prompt_len + resp_len
            group.trajectories.append(
                common_pb2.Trajectory(
                    token_ids=prompt + [rng.randrange(3, 384) for _ in range(resp_len)],
                    logprobs=[0.0] * prompt_len
                    + [min(0.0, uniform_logp + rng.gauss(0.0, 0.05)) for _ in range(resp_len)],
                    versions=[-1] * prompt_len + [step] * resp_len,
                    loss_mask=[False] * prompt_len + [True] * resp_len,
                    reward=float(rng.random() < 0.5),
                    prompt_length=prompt_len,
                    group_id=group.group_id,
                    task_id=group.task_id,
                )
            )
            assert len(group.trajectories[-1].token_ids) == n
        groups.append(group)
    return groups


def shards(groups: list[common_pb2.TrajectoryGroup]) -> list[list[common_pb2.TrajectoryGroup]]:
    """The groups of each rank (the coordinator's dispatch by token count)."""
    weights = [sum(len(t.token_ids) for t in g.trajectories) for g in groups]
    return [[groups[i] for i in rank] for rank in dispatch_groups(weights, WORLD)]


def trainer_flags(args: argparse.Namespace) -> list[str]:
    """The areal-trainer options both sides use (besides rank / port / master), run config
    overrides last."""
    return [
        "--device=cpu",
        "--log-level=WARNING",
        f"model.source={args.model}",
        "model.seed=0",
        "trainer.torch_threads=1",
        "trainer.backend=gloo",
        "trainer.optimizer.lr=1e-5",
        f"trainer.max_tokens_per_mb={args.max_tokens_per_mb}",
        "trainer.collective_timeout_s=300",
    ]


# --------------------------------------------------------------------------- baseline worker


def worker_main(args: argparse.Namespace) -> None:
    """One rank of the in-process baseline: TrainerEngine.train_step, no gRPC."""
    from areal_servers.trainer.__main__ import add_trainer_args
    from areal_servers.trainer.build import config_from_args
    from areal_servers.trainer.engine import TrainerEngine, init_distributed

    from areal_grpc.batch import groups_to_batch
    from areal_grpc.cli import base_parser

    torch.set_num_threads(1)
    parser = base_parser("bench-worker", "", 0)
    add_trainer_args(parser)
    targs = parser.parse_args(
        [
            f"--rank={args.rank}",
            f"--world-size={WORLD}",
            "--master-addr=127.0.0.1",
            f"--master-port={args.master_port}",
            *trainer_flags(args),
        ]
    )
    cfg = config_from_args(targs)
    # The engine is built and stepped on one worker thread, as in the server (TrainerService's
    # torch thread): stepped on the main thread it measured 5-7% slower here, a cost that has
    # nothing to do with gRPC.
    torch_thread = ThreadPoolExecutor(1, thread_name_prefix="bench-torch")

    def build() -> TrainerEngine:
        init_distributed(cfg.dist)
        return TrainerEngine(
            cfg.trainer,
            cfg.model,
            device=cfg.device,
            total_steps=cfg.total_steps,
            temperature=cfg.temperature,
        )

    engine = torch_thread.submit(build).result()
    total = args.warmup + args.steps
    mine = {s: shards(step_groups(args, s))[args.rank] for s in range(total)}
    print(READY, flush=True)
    for line in sys.stdin:
        step = int(line.split()[1])
        start = time.perf_counter()
        groups = mine[step]
        batch = (
            groups_to_batch(groups, pad_token_id=engine.pad_token_id, vocab_size=engine.vocab_size)
            if groups
            else None
        )
        result = torch_thread.submit(engine.train_step, batch).result()
        elapsed = time.perf_counter() - start
        print(
            f"{STEP_PREFIX}{step} {result.trained_tokens} {result.elapsed_seconds:.6f} "
            f"{elapsed:.6f}",
            flush=True,
        )


class Workers:
    """The two baseline rank processes, driven over stdin/stdout."""

    def __init__(self, args: argparse.Namespace, log_dir: Path, children: list[Child]) -> None:
        port = free_port()
        self.procs: list[subprocess.Popen[str]] = []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        for rank in range(WORLD):
            argv = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                f"--rank={rank}",
                f"--master-port={port}",
                *passthrough(args),
            ]
            log = (log_dir / f"worker{rank}.log").open("w")
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
                start_new_session=True,
            )
            self.procs.append(proc)
            children.append(Child(f"worker{rank}", proc, "", log_dir / f"worker{rank}.log"))
        for proc in self.procs:
            self._read_until(proc, READY)

    @staticmethod
    def _read_until(proc: subprocess.Popen[str], prefix: str) -> str:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(prefix):
                return line
        raise RuntimeError(f"baseline worker exited (code {proc.wait()})")

    def step(self, step: int) -> tuple[float, int, float]:
        """(wall seconds, trained tokens, max engine seconds) of one step on both ranks."""
        start = time.perf_counter()
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(f"step {step}\n")
            proc.stdin.flush()
        answers = [self._read_until(proc, STEP_PREFIX).split() for proc in self.procs]
        wall = time.perf_counter() - start
        tokens = {int(a[2]) for a in answers}
        if len(tokens) != 1:
            raise RuntimeError(f"ranks disagree on trained tokens: {tokens}")
        return wall, tokens.pop(), max(float(a[3]) for a in answers)


# ------------------------------------------------------------------------------ gRPC side


class GrpcRanks:
    """Two areal-trainer processes driven through TrainStep."""

    def __init__(
        self,
        args: argparse.Namespace,
        log_dir: Path,
        children: list[Child],
        *overrides: str,
        name: str = "trainer",
    ) -> None:
        port = free_port()
        env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.children: list[Child] = []
        self.channels = []
        self.stubs = []
        for rank in range(WORLD):
            argv = python_module_argv(
                "areal_servers.trainer",
                "--port=0",
                "--host=127.0.0.1",
                f"--rank={rank}",
                f"--world-size={WORLD}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                *trainer_flags(args),
                *overrides,
            )
            child = start_child(f"{name}{rank}", argv, log_dir=log_dir, env=env)
            children.append(child)
            self.children.append(child)
            channel = sync_channel(child.address)
            self.channels.append(channel)
            self.stubs.append(trainer_pb2_grpc.TrainerServiceStub(channel))
        self.pool = ThreadPoolExecutor(WORLD)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for channel in self.channels:
            channel.close()

    def _call(
        self, rank: int, messages: list[trainer_pb2.TrainStepRequest]
    ) -> trainer_pb2.StepStats:
        stats = None
        for resp in self.stubs[rank].TrainStep(iter(messages), timeout=RPC_TIMEOUT_S):
            if resp.HasField("stats"):
                stats = resp.stats
        if stats is None:
            raise RuntimeError(f"rank {rank} sent no StepStats")
        return stats

    def step(self, per_rank: list[list[trainer_pb2.TrainStepRequest]]) -> tuple[float, int, float]:
        """(wall seconds, trained tokens, max engine seconds) of one TrainStep on both ranks."""
        start = time.perf_counter()
        futures = [self.pool.submit(self._call, r, per_rank[r]) for r in range(WORLD)]
        stats = [f.result(timeout=RPC_TIMEOUT_S + 10) for f in futures]
        wall = time.perf_counter() - start
        tokens = {s.trained_tokens for s in stats}
        if len(tokens) != 1:
            raise RuntimeError(f"ranks disagree on trained tokens: {tokens}")
        return wall, tokens.pop(), max(seconds(s.elapsed) for s in stats)


def step_messages(
    step: int, groups: list[common_pb2.TrajectoryGroup]
) -> list[trainer_pb2.TrainStepRequest]:
    """StepBegin, the groups, StepEnd (the policy version equals the steps already taken)."""
    begin = trainer_pb2.StepBegin(global_step=step, policy_version=step, group_count=len(groups))
    return [
        trainer_pb2.TrainStepRequest(begin=begin),
        *(trainer_pb2.TrainStepRequest(group=g) for g in groups),
        trainer_pb2.TrainStepRequest(end=trainer_pb2.StepEnd()),
    ]


# ---------------------------------------------------------------------------- padding waste


def long_tail_lengths(rng: random.Random, n_groups: int, group_size: int = 8) -> list[int]:
    """Sequence lengths of ``n_groups`` groups in arrival order (see the module docstring)."""
    out = []
    for _ in range(n_groups):
        prompt = min(2048, max(16, round(rng.lognormvariate(math.log(150), 0.5))))
        difficulty = rng.lognormvariate(0.0, 0.5)
        for _ in range(group_size):
            response = min(8192, max(1, round(difficulty * rng.lognormvariate(math.log(600), 1.0))))
            out.append(prompt + response)
    return out


def fixed_plan(n_rows: int, n_mbs: int) -> list[list[int]]:
    """Rows in arrival order cut into ``n_mbs`` consecutive chunks of equal row count (+-1)."""
    bounds = [round(k * n_rows / n_mbs) for k in range(n_mbs + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(n_mbs)]


def padding_bench(args: argparse.Namespace) -> tuple[float, float]:
    """Mean waste (FFD, fixed) over the trials; prints details."""
    from areal_servers.trainer.microbatch import MicroBatchSpec, padding_waste, plan_microbatches

    rng = random.Random(args.seed)
    spec = MicroBatchSpec(max_tokens_per_mb=args.mb_budget)
    ffd, fixed, counts, over = [], [], [], 0
    fixed_mbs = 0
    for _ in range(args.mb_trials):
        lengths = long_tail_lengths(rng, args.mb_groups)
        plan = plan_microbatches(lengths, spec)
        n = len(plan)
        counts.append(n)
        baseline = fixed_plan(len(lengths), n)
        ffd.append(padding_waste(lengths, plan))
        fixed.append(padding_waste(lengths, baseline))
        fixed_mbs += n
        over += sum(sum(lengths[i] for i in rows) > args.mb_budget for rows in baseline)
    print(
        f"micro-batch padding: {args.mb_trials} shards of {args.mb_groups} groups x 8, budget "
        f"{args.mb_budget} tokens/mb, mean {statistics.fmean(counts):.2f} micro-batches/shard"
    )
    print(
        f"  FFD waste mean {statistics.fmean(ffd):.4f} (median {statistics.median(ffd):.4f}); "
        f"fixed waste mean {statistics.fmean(fixed):.4f} (median {statistics.median(fixed):.4f}); "
        f"fixed micro-batches over the token budget: {over}/{fixed_mbs}"
    )
    return statistics.fmean(ffd), statistics.fmean(fixed)


# ---------------------------------------------------------------------------------- driver


def passthrough(args: argparse.Namespace) -> list[str]:
    """The options a worker needs to build the same batches and engine."""
    return [
        f"--model={args.model}",
        f"--seed={args.seed}",
        f"--groups={args.groups}",
        f"--group-size={args.group_size}",
        f"--prompt-median={args.prompt_median}",
        f"--response-median={args.response_median}",
        f"--max-seq-len={args.max_seq_len}",
        f"--max-tokens-per-mb={args.max_tokens_per_mb}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
    ]


def summary(name: str, samples: list[tuple[float, int, float]]) -> float:
    """Prints per-step rates; returns their median (trained tokens/s)."""
    rates = [tokens / wall for wall, tokens, _ in samples]
    med = statistics.median(rates)
    overhead = statistics.median([wall - engine for wall, _, engine in samples])
    engine_s = statistics.median([engine for _, _, engine in samples])
    print(
        f"  {name:<22} median {med:8.0f} tok/s  min {min(rates):8.0f}  max {max(rates):8.0f}  "
        f"spread {(max(rates) - min(rates)) / med:5.1%}  median train_step {engine_s:.3f} s, "
        f"wall - train_step {overhead * 1e3:5.1f} ms  steps: {' '.join(f'{r:.0f}' for r in rates)}",
        flush=True,
    )
    return med


def compare_sides(
    args: argparse.Namespace,
    sides: dict[str, str],
    messages: list[list[list[trainer_pb2.TrainStepRequest]]],
) -> tuple[dict[str, float], dict[str, float]]:
    """The same TrainStep ``messages`` (per step, per rank) on one 2-rank trainer group per
    side (label -> a run config override), steps alternating between the sides: each side's
    median trained tokens/s and its ranks' peak RSS (GiB)."""
    total = args.warmup + args.steps
    children: list[Child] = []
    groups: dict[str, GrpcRanks] = {}
    labels = list(sides)
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        try:
            for label, override in sides.items():
                groups[label] = GrpcRanks(
                    args, Path(tmp), children, override, name=f"trainer-{label}-"
                )
            samples: dict[str, list[tuple[float, int, float]]] = {k: [] for k in sides}
            for s in range(total):
                for label in labels if s % 2 == 0 else labels[::-1]:
                    sample = groups[label].step(messages[s])
                    if s >= args.warmup:
                        samples[label].append(sample)
            peaks = {
                label: peak_rss_gib(c.process.pid for c in side.children)
                for label, side in groups.items()
            }
        finally:
            for side in groups.values():
                side.close()
            stop_children(children)
    rates = {label: summary(label, samples[label]) for label in samples}
    for label, peak in peaks.items():
        print(f"  {label}: peak RSS of its 2 ranks {peak:.2f} GiB", flush=True)
    return rates, peaks


def precision_main(args: argparse.Namespace) -> None:
    """``--compare-precision``: the same TrainStep on two trainer groups, fp32 compute and
    bf16 compute (trainer.mixed_precision off / on), steps alternating between them."""
    torch.set_num_threads(1)
    total = args.warmup + args.steps
    messages = [
        [step_messages(s, rank) for rank in shards(step_groups(args, s))] for s in range(total)
    ]
    print(
        f"train step precision: {args.model}, 2 ranks FSDP2 over gloo, {args.groups} groups x "
        f"{args.group_size} per step, {args.warmup} warm-up + {args.steps} timed steps per side",
        flush=True,
    )
    rates, peaks = compare_sides(
        args,
        {
            "fp32 compute": "trainer.mixed_precision=off",
            "bf16 compute": "trainer.mixed_precision=on",
        },
        messages,
    )
    result("train_step_bf16", rates["bf16 compute"], "tok/s", rates["fp32 compute"], "1.3")
    result("train_step_bf16_memory", peaks["bf16 compute"], "GiB", peaks["fp32 compute"], "none")


def trajectory(
    tokens: list[int], trained_from: int, trained_to: int, step: int, rng: random.Random, group: str
) -> common_pb2.Trajectory:
    """A trajectory trained on ``tokens[trained_from:trained_to]``, behaviour log-probs near
    the uniform policy's."""
    uniform_logp = -math.log(384)
    n = len(tokens)
    mask = [trained_from <= i < trained_to for i in range(n)]
    return common_pb2.Trajectory(
        token_ids=tokens,
        logprobs=[min(0.0, uniform_logp + rng.gauss(0.0, 0.05)) if m else 0.0 for m in mask],
        versions=[step if m else -1 for m in mask],
        loss_mask=mask,
        reward=float(rng.random() < 0.5),
        prompt_length=trained_from,
        group_id=group,
        task_id=group,
    )


def arith_groups(args: argparse.Namespace, step: int) -> list[common_pb2.TrajectoryGroup]:
    """The arithmetic example's shape: --groups groups of 16 completions of one 28-token
    prompt, each completion 4-16 tokens (lognormal, median 9)."""
    rng = random.Random(args.seed * 1_000_003 + step)
    groups = []
    for g in range(args.groups):
        prompt = [rng.randrange(3, 384) for _ in range(28)]
        group = common_pb2.TrajectoryGroup(group_id=f"s{step}g{g}", task_id=f"s{step}g{g}")
        for _ in range(16):
            n = min(16, max(4, round(rng.lognormvariate(math.log(9), 0.4))))
            tokens = prompt + [rng.randrange(3, 384) for _ in range(n)]
            group.trajectories.append(
                trajectory(tokens, 28, len(tokens), step, rng, group.group_id)
            )
        groups.append(group)
    return groups


def agent_sessions(args: argparse.Namespace, step: int) -> list[common_pb2.TrajectoryGroup]:
    """The agent example's shape: --groups sessions (one group each) of 4 turns, recorded
    as the gateway records them: one trajectory per turn, the conversation so far (a
    56-token system prompt and question, then per turn a 12-token tool result or user
    message and a 24-token reply), trained on that turn's reply."""
    rng = random.Random(args.seed * 1_000_003 + step)
    groups = []
    for g in range(args.groups):
        group = common_pb2.TrajectoryGroup(group_id=f"s{step}g{g}", task_id=f"s{step}g{g}")
        conversation = [rng.randrange(3, 384) for _ in range(56)]
        for _ in range(4):
            conversation += [rng.randrange(3, 384) for _ in range(12)]
            start = len(conversation)
            conversation += [rng.randrange(3, 384) for _ in range(24)]
            group.trajectories.append(
                trajectory(list(conversation), start, len(conversation), step, rng, group.group_id)
            )
        groups.append(group)
    return groups


def sharing_main(args: argparse.Namespace) -> None:
    """``--prefix-sharing``: the same TrainStep on two trainer groups, one computing each
    shared prefix once (trainer.prefix_sharing=on) and one computing every row whole (off),
    on GRPO groups and on agent sessions."""
    torch.set_num_threads(1)
    total = args.warmup + args.steps
    for case, make in (("groups", arith_groups), ("sessions", agent_sessions)):
        batches = [make(args, s) for s in range(total)]
        tokens = [sum(len(t.token_ids) for g in b for t in g.trajectories) for b in batches]
        nodes = [
            sum(prefix_nodes([list(t.token_ids) for t in g.trajectories]) for g in b)
            for b in batches
        ]
        print(
            f"prefix sharing, {case}: {args.model}, 2 ranks FSDP2 over gloo, {args.groups} "
            f"groups of {len(batches[0][0].trajectories)} per step; tokens per step "
            f"{statistics.median(tokens):.0f} unshared, {statistics.median(nodes):.0f} computed "
            f"shared ({statistics.median(n / t for n, t in zip(nodes, tokens, strict=True)):.3f}); "
            f"{args.warmup} warm-up + {args.steps} timed steps per side",
            flush=True,
        )
        messages = [[step_messages(s, rank) for rank in shards(batches[s])] for s in range(total)]
        rates, _ = compare_sides(
            args,
            {"unshared": "trainer.prefix_sharing=off", "shared": "trainer.prefix_sharing=on"},
            messages,
        )
        target = "1.6" if case == "groups" else "2"
        result(f"train_step_tree_{case}", rates["shared"], "tok/s", rates["unshared"], target)


def driver_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    total = args.warmup + args.steps
    batches = [shards(step_groups(args, s)) for s in range(total)]
    messages = [[step_messages(s, rank) for rank in batches[s]] for s in range(total)]
    seqs = [sum(len(g.trajectories) for g in groups) for groups in batches[0]]
    tokens0 = [
        sum(len(t.token_ids) for g in groups for t in g.trajectories) for groups in batches[0]
    ]
    print(
        f"train step: {args.model}, 2 ranks FSDP2 over gloo, {args.groups} groups x "
        f"{args.group_size} per step (step 0: sequences per rank {seqs}, tokens per rank "
        f"{tokens0}), max_tokens_per_mb {args.max_tokens_per_mb}, {args.warmup} warm-up + "
        f"{args.steps} timed steps per side",
        flush=True,
    )
    children: list[Child] = []
    grpc_ranks: GrpcRanks | None = None
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        log_dir = Path(tmp)
        try:
            grpc_ranks = GrpcRanks(args, log_dir, children)
            workers = Workers(args, log_dir, children)
            grpc_samples, inproc_samples = [], []
            for s in range(total):
                order = ("grpc", "inproc") if s % 2 == 0 else ("inproc", "grpc")
                for side in order:
                    if side == "grpc":
                        sample = grpc_ranks.step(messages[s])
                        if s >= args.warmup:
                            grpc_samples.append(sample)
                    else:
                        sample = workers.step(s)
                        if s >= args.warmup:
                            inproc_samples.append(sample)
            for (_, tg, _), (_, ti, _) in zip(grpc_samples, inproc_samples, strict=True):
                if tg != ti:
                    raise RuntimeError(f"trained tokens differ: gRPC {tg}, in-process {ti}")
            grpc_rate = summary("gRPC TrainStep", grpc_samples)
            inproc_rate = summary("in-process train_step", inproc_samples)
            pairs = [
                (tg / wg) / (ti / wi)
                for (wg, tg, _), (wi, ti, _) in zip(grpc_samples, inproc_samples, strict=True)
            ]
            print(
                f"  per-step gRPC/in-process ratios: {' '.join(f'{r:.3f}' for r in pairs)} "
                f"(median {statistics.median(pairs):.3f})",
                flush=True,
            )
        except BaseException:
            for child in children:
                if child.log_path is not None and child.log_path.exists():
                    sys.stderr.write(f"--- {child.name}\n{child.log_path.read_text()[-3000:]}")
            raise
        finally:
            if grpc_ranks is not None:
                grpc_ranks.close()
            stop_children(children)
    ffd_waste, fixed_waste = padding_bench(args)
    print("(tok/s: medians over the timed steps; waste: means over the trials)")
    result("train_step", grpc_rate, "tok/s", inproc_rate, "0.9")
    result("microbatch_padding", ffd_waste, "fraction", fixed_waste, "1.0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--groups", type=int, default=8, help="groups per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-median", type=int, default=24)
    parser.add_argument("--response-median", type=int, default=96)
    parser.add_argument("--max-seq-len", type=int, default=512, help="the model's context")
    parser.add_argument("--max-tokens-per-mb", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side")
    parser.add_argument("--mb-trials", type=int, default=500)
    parser.add_argument("--mb-groups", type=int, default=16, help="groups of 8 per shard")
    parser.add_argument("--mb-budget", type=int, default=16384, help="tokens per micro-batch")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--master-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--prefix-sharing",
        action="store_true",
        help="train_step_tree_groups and _sessions instead: shared prefixes computed once "
        "vs every row whole, both through TrainStep",
    )
    parser.add_argument(
        "--compare-precision",
        action="store_true",
        help="train_step_bf16 instead: bf16 compute vs fp32 compute, both through TrainStep",
    )
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
    else:
        signal.signal(signal.SIGTERM, exit_on_sigterm)
        if args.prefix_sharing:
            sharing_main(args)
        else:
            (precision_main if args.compare_precision else driver_main)(args)


if __name__ == "__main__":
    main()
