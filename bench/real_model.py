"""The real model through the mesh: SmolLM2-135M-Instruct on this machine's CPU cores.

Cases (one ``RESULT`` line each, medians where a case repeats):

* ``real_model_learning``: the documented example (``examples/smollm2_arith.yaml``, README
  "Train a real model") run as a user runs it, ``python -m areal_grpc.coordinator --config
  ...``, on a freshly generated arithmetic set. value = held-out greedy accuracy at the end,
  baseline = at step 0, ratio = value - baseline (target 0.5), plus the wall time (the issue
  asks for it within 15 minutes).
* ``real_model_time_to_target``: wall seconds until a held-out evaluation (100 prompts, as
  the anchor's, every ``--target-eval-every`` steps) reaches ``--target-accuracy`` (0.8), on
  the issue's anchor task (``--target-mix``: half 1-digit sums, half a 2-digit number plus a
  1-digit one, in that order, ``add_2_1_ordered``; the example's own mix has word problems
  neither side gets past 0.2 on in its budget, and sums with the 1-digit number first, which
  neither learns past about 0.1 when they carry; the 1-digit sums have only 100 distinct
  questions, so the 50 held out are never trained on and the train set repeats the other
  50) and the anchor's sampling temperature 0.7 and learning rate 1e-5 (the example's
  settings otherwise), for at most ``--target-steps`` steps, vs a plain in-process
  synchronous loop (``--plain-loop``, one process, no gRPC, on-policy GRPO:
  ``model.generate`` then one AdamW step on the same settings, same evaluation set and
  schedule, same reward, same loss code). Both clocks start at process start (model loading
  included). A side that never reaches the target reports ``inf``. Each side's step is
  profiled (generating, training, syncing). ``--target-seeds n`` runs both sides with seeds
  0..n-1 (``--target-first-seed`` moves the range; ``model.seed``: the data order and the
  sampling; the plain loop takes the same seed) and compares the medians: one run per side
  mostly measures which drew the luckier first steps (docs/getting-started/real-model.md).
* ``real_model_memory``: peak RSS of the whole mesh (coordinator + every child, summed over
  the process tree, sampled every 0.5 s) during that run, vs the plain loop's peak.
* ``real_model_rollout``: generated tokens/s through ``RunEpisodes`` on a rollout server
  subprocess vs ``model.generate`` in this process on the same chat prompts (8 x 8 samples,
  16 new tokens each, no early stop so both generate the same count; same torch threads).
* ``real_model_train``: ``bench/train_step.py`` on the real model (TrainStep on 2 FSDP2 ranks
  vs the same ranks in-process), arithmetic-sized sequences.
* ``real_model_sync_<method>``: ``bench/weight_sync.py --model`` on the real model (seconds
  per full fleet update vs that method's floor: a memcpy into fresh memory, raw TCP,
  safetensors save+load, bare gloo broadcast).

``--engine vllm`` (needs ``./scripts/setup --vllm``) runs the learning case with the rollout
server on vLLM (``real_model_learning_vllm``: the same line as for hf), then the same example on
the hf engine, and compares their wall times (``real_model_wall_vllm``: vLLM's over hf's, no
target); ``--vllm-reserved-cpus 0`` gives vLLM's model worker every core instead of keeping one
for its scheduler (the cases get ``_allcores``), and ``--vllm-reserved-cpus default,0`` runs
both before the one hf run. Only the learning case runs with it.

``--dtype bf16`` runs only bf16 against fp32, side by side: ``real_model_rollout_bf16`` (the
rollout case's RunEpisodes rounds on a server with ``rollout.dtype=bfloat16`` and one with
``float32``, alternating; ``_vllm`` with ``--engine vllm``, ``_sglang`` with ``--engine
sglang``, which needs ``./scripts/setup --sglang``), its ``_memory`` (peak RSS of each
server's process tree), and ``real_model_train_bf16`` (``bench/train_step.py
--compare-precision`` on the real model: trainer.mixed_precision on vs off) with its
``_memory``; each ratio is bf16's over fp32's.

``--quick`` skips the learning and time-to-target runs and takes memory from a
3-step run of the example instead; about 10 minutes on 2 cores::

    .venv/bin/python bench/real_model.py [--quick]

The machine must be otherwise idle: every case compares wall times on the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import psutil
import torch
import yaml
from areal_servers.rollout.workflows import ChatSettings
from arealgrpc.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from coordinator_run import coordinator, interrupt, metrics_records, watch
from memory import peak_rss_gib
from results import result
from teardown import exit_on_sigterm

from areal_grpc.config import PPOSettings
from areal_grpc.data import load_file, write_arithmetic
from areal_grpc.launch import python_module_argv, start_child, stop_children
from areal_grpc.model import load_model, load_tokenizer, masked_logits, resolve_source
from areal_grpc.rewards import gsm8k_reward
from areal_grpc.server import aio_channel

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "smollm2_arith.yaml"
BENCH = Path(__file__).resolve().parent
# Where the mesh's servers and every baseline keep the model (``--device``).
DEVICE = "cpu"


def real_train_step_args(model_dir: str) -> list[str]:
    """bench/train_step.py's options for the real model: arithmetic-sized sequences."""
    return [
        f"--model={model_dir}",
        "--groups=8",
        "--group-size=8",
        "--prompt-median=40",
        "--response-median=8",
        "--max-seq-len=128",
        "--steps=3",
    ]


def named(case: str) -> str:
    """A case's RESULT name: on a GPU the same case is another one (``_gpu``)."""
    return case if DEVICE == "cpu" else f"{case}_gpu"


class TreeRSS:
    """Peak RSS summed over a process and its descendants, sampled in a thread."""

    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        self.peak = 0
        self.per_process: dict[str, int] = {}
        self._root = psutil.Process(pid)
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                procs = [self._root, *self._root.children(recursive=True)]
            except psutil.Error:
                return
            total = 0
            for p in procs:
                try:
                    rss = p.memory_info().rss
                    name = " ".join(a for a in p.cmdline()[1:3])
                except psutil.Error:
                    continue
                total += rss
                self.per_process[name] = max(self.per_process.get(name, 0), rss)
            self.peak = max(self.peak, total)
            self._stop.wait(self._every_s)

    def stop(self) -> float:
        """Stops sampling; the peak in GiB."""
        self._stop.set()
        self._thread.join()
        return self.peak / 2**30


# ------------------------------------------------------------------ the example, as a user runs it


def example_config(
    tmp: Path,
    overrides: dict[str, Any],
    mix: dict[str, float] | None = None,
    sizes: tuple[int, int] = (4000, 200),
) -> Path:
    """The documented example with its data (of ``mix``; train and test ``sizes``) and
    output under ``tmp``."""
    cfg = yaml.safe_load(EXAMPLE.read_text())
    data = tmp / "data"
    write_arithmetic(data, *sizes, seed=0, mix=mix)
    cfg["data"]["path"] = str(data / "train.jsonl")
    cfg["data"]["eval_path"] = str(data / "test.jsonl")
    cfg["output"] = {**cfg.get("output", {}), "dir": str(tmp / "run"), "progress_bar": False}
    # What "auto" picks on such a machine, said outright (the plain loop takes the same).
    cfg["rollout"]["device"] = cfg["trainer"]["device"] = DEVICE
    for dotted, value in overrides.items():
        node = cfg
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_mesh(config: Path, out: Path, stop_at: float | None = None) -> dict[str, Any]:
    """Runs the coordinator on ``config``; evaluations with their wall time, peak RSS.

    ``stop_at``: interrupt the run (SIGINT, a clean stop) once an evaluation reaches it.
    """
    start = time.monotonic()
    log_path = out.parent / "coordinator.log"
    evals: list[dict[str, Any]] = []
    with coordinator(["--config", str(config)], log_path) as proc:
        rss = TreeRSS(proc.pid)
        try:
            # Evaluation records timestamped as they appear (polled every 0.5 s).
            for new in watch(proc, out / "metrics.jsonl"):
                for record in new:
                    if record.get("kind") == "eval":
                        evals.append({**record, "wall_s": time.monotonic() - start})
                        if stop_at is not None and record["accuracy"] >= stop_at:
                            interrupt(proc)
        finally:
            peak = rss.stop()
    stopped = stop_at is not None and any(e["accuracy"] >= stop_at for e in evals)
    # 130: the clean stop after SIGINT asked for above.
    if proc.returncode != 0 and not (stopped and proc.returncode == 130):
        raise RuntimeError(f"the run failed ({proc.returncode}): see {log_path}")
    train = [r for r in metrics_records(out / "metrics.jsonl") if r["kind"] == "train"]
    return {
        "wall_s": time.monotonic() - start,
        "evals": evals,
        "peak_gib": peak,
        "per_process_gib": {k: v / 2**30 for k, v in rss.per_process.items()},
        "train": train,
    }


# ------------------------------------------------------------------ the plain in-process loop


def chat_ids(tokenizer: Any, system: str | None, question: str) -> list[int]:
    """Prompt ids as the rollout workflow renders them (system message, one user turn)."""
    messages = ChatSettings(system_prompt=system).messages({}, question)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), left-padded to the longest row."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def completions(
    model: Any, tokenizer: Any, prompts: list[list[int]], n: int, temperature: float, max_new: int
) -> list[list[int]]:
    """``n`` sampled (or greedy, temperature 0) completions per prompt, cut after end-of-turn."""
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    ids, mask = ids.to(model.device), mask.to(model.device)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    kwargs: dict[str, Any] = (
        {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
        if temperature > 0
        else {"do_sample": False}
    )
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            num_return_sequences=n,
            pad_token_id=tokenizer.pad_token_id,
            **kwargs,
        )
    rows = []
    for row in out[:, ids.shape[1] :].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        rows.append(row[:cut])
    return rows


def plain_eval(
    model: Any, tokenizer: Any, items: list[dict[str, Any]], cfg: dict[str, Any]
) -> float:
    """Greedy held-out accuracy (the gsm8k reward), in batches of 50."""
    system = cfg["rollout"].get("system_prompt")
    max_new = cfg["rollout"]["sampling"]["max_new_tokens"]
    model.eval()
    correct = 0.0
    for i in range(0, len(items), 50):
        chunk = items[i : i + 50]
        prompts = [chat_ids(tokenizer, system, it["question"]) for it in chunk]
        for it, comp in zip(
            chunk, completions(model, tokenizer, prompts, 1, 0.0, max_new), strict=True
        ):
            text = tokenizer.decode(comp, skip_special_tokens=True)
            correct += gsm8k_reward("", text, [], comp, it)
    return correct / len(items)


def plain_loop(config: Path, target: float, threads: int) -> None:
    """On-policy GRPO in one process (the baseline); prints one JSON line per evaluation."""
    from areal_servers.trainer.algorithm import (
        compute_advantages,
        masked_token_logprobs,
        ppo_loss,
    )

    start = time.monotonic()
    torch.set_num_threads(threads)
    cfg = yaml.safe_load(config.read_text())
    # The run's seed, as the mesh takes it: the data order and the sampling.
    seed = int(cfg["model"].get("seed", 0))
    torch.manual_seed(seed)
    model_dir = resolve_source(cfg["model"]["source"])
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir).to(DEVICE)
    train_items = load_file(cfg["data"]["path"], "data.path")
    random.Random(seed).shuffle(train_items)
    eval_items = load_file(cfg["data"]["eval_path"], "data.eval_path")[: cfg["eval"]["max_prompts"]]
    t = cfg["trainer"]
    s = cfg["staleness"]
    sampling = cfg["rollout"]["sampling"]
    temperature = float(sampling["temperature"])
    system = cfg["rollout"].get("system_prompt")
    o = t["optimizer"]
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], weight_decay=o["weight_decay"])
    ppo = PPOSettings()
    every = cfg["eval"]["every_steps"]
    # Seconds generating and training so far (the step's profile beside the mesh's).
    spent = {"generate_s": 0.0, "train_s": 0.0}

    def report(step: int) -> bool:
        acc = plain_eval(model, tokenizer, eval_items, cfg)
        wall = time.monotonic() - start
        print(json.dumps({"step": step, "accuracy": acc, "wall_s": wall, **spent}), flush=True)
        return acc >= target

    if report(0):
        return
    for step in range(cfg["total_steps"]):
        items = train_items[step * s["batch_size"] : (step + 1) * s["batch_size"]]
        prompts = [chat_ids(tokenizer, system, it["question"]) for it in items]
        model.eval()
        t0 = time.monotonic()
        comps = completions(
            model, tokenizer, prompts, s["group_size"], temperature, sampling["max_new_tokens"]
        )
        t1 = time.monotonic()
        rows, rewards, groups, masks = [], [], [], []
        for j, comp in enumerate(comps):
            g = j // s["group_size"]
            rows.append(prompts[g] + comp)
            masks.append([0] * len(prompts[g]) + [1] * len(comp))
            text = tokenizer.decode(comp, skip_special_tokens=True)
            rewards.append(gsm8k_reward("", text, [], comp, items[g]))
            groups.append(g)
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        loss_mask = torch.zeros_like(ids, dtype=torch.bool)
        for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
            ids[i, : len(r)] = torch.tensor(r)
            attn[i, : len(r)] = 1
            loss_mask[i, : len(r)] = torch.tensor(m, dtype=torch.bool)
        loss_mask[:, 0] = False
        ids, attn, loss_mask = ids.to(DEVICE), attn.to(DEVICE), loss_mask.to(DEVICE)
        adv = compute_advantages(
            torch.tensor(rewards, device=DEVICE),
            loss_mask,
            ppo,
            group_index=torch.tensor(groups, device=DEVICE),
        )
        model.train()
        opt.zero_grad(set_to_none=True)

        def forward(
            keep: torch.Tensor, ids: torch.Tensor = ids, attn: torch.Tensor = attn
        ) -> torch.Tensor:
            return masked_logits(model, ids, attn, keep)

        logp, _ = masked_token_logprobs(forward, ids, loss_mask, temperature)
        # On-policy: the behaviour and proximal policies are the weights being trained.
        loss, _ = ppo_loss(
            logp, logp.detach(), logp.detach(), adv, loss_mask, ppo, float(loss_mask.sum())
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"])
        opt.step()
        spent["generate_s"] += t1 - t0
        spent["train_s"] += time.monotonic() - t1
        if every > 0 and (step + 1) % every == 0 and report(step + 1):
            return


def run_plain(config: Path, target: float, threads: int) -> dict[str, Any]:
    """The plain loop in a subprocess of its own (its own RSS); its evaluations and peak."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--plain-loop",
            str(config),
            f"--target-accuracy={target}",
            f"--threads={threads}",
            f"--device={DEVICE}",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
    )
    rss = TreeRSS(proc.pid)
    assert proc.stdout is not None
    evals = [json.loads(line) for line in proc.stdout if line.startswith("{")]
    proc.wait()
    peak = rss.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"the plain loop failed ({proc.returncode})")
    return {"evals": evals, "peak_gib": peak, "wall_s": time.monotonic() - start}


def time_to_target(tmp: Path, args: argparse.Namespace) -> None:
    """The mesh and the plain loop on the anchor mix until ``--target-accuracy``, once per seed
    of ``--target-seeds``; the medians of each side's times are compared."""
    mix = {k: float(v) for k, _, v in (p.partition("=") for p in args.target_mix.split(","))}
    times: dict[str, list[float]] = {"mesh": [], "plain loop": []}
    for seed in range(args.target_first_seed, args.target_first_seed + args.target_seeds):
        overrides = {
            "total_steps": args.target_steps,
            "eval.every_steps": args.target_eval_every,
            "rollout.sampling.temperature": 0.7,
            "trainer.optimizer.lr": 1e-5,
            "model.seed": seed,
        }
        config = example_config(tmp / f"seed{seed}", overrides, mix, sizes=(4000, 100))
        mesh = run_mesh(config, tmp / f"seed{seed}" / "run", stop_at=args.target_accuracy)
        plain = run_plain(config, args.target_accuracy, args.threads)
        for side, run in (("mesh", mesh), ("plain loop", plain)):
            trail = [(e["step"], e["accuracy"], round(e["wall_s"])) for e in run["evals"]]
            print(
                f"time to target, seed {seed}, {side}: evaluations (step, accuracy, wall s) {trail}"
            )
            times[side].append(first_at(run["evals"], args.target_accuracy))
        print(f"time to target, seed {seed}, mesh: {step_profile(mesh['train'])}")
        last = plain["evals"][-1]
        if last["step"]:
            print(
                "time to target, seed {}, plain loop: per step {:.1f} s generating, {:.1f} s "
                "training".format(
                    seed, last["generate_s"] / last["step"], last["train_s"] / last["step"]
                )
            )
    print(f"time to target: seconds per seed {times}")
    ours, base = statistics.median(times["mesh"]), statistics.median(times["plain loop"])
    ratio = ours / base if math.isfinite(base) else math.nan
    result(named("real_model_time_to_target"), ours, "s", base, "1.0", ratio=ratio)


def step_profile(train: list[dict[str, Any]]) -> str:
    """The mesh's median step and its parts, from its ``train`` metrics records."""
    if not train:
        return "no step ran"
    m = {
        k: statistics.median(r[k] for r in train) for k in ("step_s", "wait_s", "train_s", "sync_s")
    }
    return (
        f"median step {m['step_s']:.1f} s (waiting for rollouts {m['wait_s']:.1f} s, "
        f"training {m['train_s']:.1f} s, weight sync {m['sync_s']:.2f} s)"
    )


def first_at(evals: list[dict[str, Any]], target: float) -> float:
    """Wall seconds of the first evaluation at or above ``target`` (inf: none)."""
    return next((e["wall_s"] for e in evals if e["accuracy"] >= target), math.inf)


# ------------------------------------------------------------------ rollout throughput


ROLLOUT_GROUPS, ROLLOUT_NEW = 8, 16
ROLLOUT_SYSTEM = "Answer with just the number."


def rollout_items() -> list[dict[str, str]]:
    """The rollout cases' 8 chat questions."""
    return [
        {"question": f"What is {a} + {b}?", "answer": str(a + b)}
        for a, b in zip(range(11, 19), range(31, 39), strict=True)
    ]


def start_rollout_server(model_dir: str, threads: int, *overrides: str) -> Any:
    """A rollout server subprocess on the real model (run config ``overrides`` last)."""
    return start_child(
        "rollout",
        python_module_argv(
            "areal_servers.rollout",
            "--port=0",
            "--log-level=WARNING",
            f"model.source={model_dir}",
            f"rollout.torch_threads={threads}",
            f"rollout.device={DEVICE}",
            *overrides,
        ),
        env={"OMP_NUM_THREADS": str(threads)},
        ready_timeout_s=600,
    )


async def episodes_round(address: str, prompts: list[list[int]]) -> tuple[int, float]:
    """(generated tokens, seconds) of one RunEpisodes round on the server at ``address``:
    each of the rollout items as a group of ROLLOUT_GROUPS, ROLLOUT_NEW tokens each."""
    sampling = common_pb2.SamplingParams(
        temperature=1.0, max_new_tokens=ROLLOUT_NEW, ignore_eos=True
    )
    params = {"chat_template": "on", "system_prompt": ROLLOUT_SYSTEM, "reward_fn": "gsm8k"}
    tasks = []
    for i, it in enumerate(rollout_items()):
        task = rollout_pb2.EpisodeTask(
            task_id=f"t{i}", workflow="rlvr", group_size=ROLLOUT_GROUPS, sampling=sampling
        )
        task.data.update(it)
        task.workflow_params.update(params)
        tasks.append(rollout_pb2.RunEpisodesRequest(task=task))
    async with aio_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        t0 = time.perf_counter()
        tokens = 0
        async for res in stub.RunEpisodes(iter(tasks)):
            if res.outcome != rollout_pb2.EPISODE_OUTCOME_ACCEPTED:
                raise RuntimeError(f"{res.task_id}: {res.reason}")
            for traj in res.group.trajectories:
                if list(traj.token_ids[: traj.prompt_length]) != prompts[int(res.task_id[1:])]:
                    raise RuntimeError("the server rendered another prompt")
                tokens += len(traj.token_ids) - traj.prompt_length
        return tokens, time.perf_counter() - t0


def rollout_case(model_dir: str, threads: int, repeats: int) -> None:
    """RunEpisodes on a rollout server subprocess vs model.generate in this process."""
    tokenizer = load_tokenizer(model_dir)
    items = rollout_items()
    groups, new = ROLLOUT_GROUPS, ROLLOUT_NEW
    prompts = [chat_ids(tokenizer, ROLLOUT_SYSTEM, it["question"]) for it in items]
    server = start_rollout_server(model_dir, threads, "rollout.dtype=float32")
    torch.set_num_threads(threads)
    model = load_model(model_dir).to(DEVICE)
    model.eval()

    def generate_round() -> tuple[int, float]:
        ids, mask = left_pad(prompts, tokenizer.pad_token_id)
        ids, mask = ids.to(DEVICE), mask.to(DEVICE)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=new,
                min_new_tokens=new,
                num_return_sequences=groups,
                pad_token_id=tokenizer.pad_token_id,
            )
        return (out.shape[1] - ids.shape[1]) * out.shape[0], time.perf_counter() - t0

    try:
        asyncio.run(episodes_round(server.address, prompts))
        generate_round()
        ours, theirs = [], []
        for r in range(repeats):
            for side in ("grpc", "generate") if r % 2 == 0 else ("generate", "grpc"):
                if side == "grpc":
                    ours.append(asyncio.run(episodes_round(server.address, prompts)))
                else:
                    theirs.append(generate_round())
    finally:
        stop_children([server])
    expected = len(items) * groups * new
    for n, _ in ours + theirs:
        if n != expected:
            raise RuntimeError(f"a round generated {n} tokens, expected {expected}")
    value = statistics.median(n / s for n, s in ours)
    base = statistics.median(n / s for n, s in theirs)
    print(
        f"rollout: RunEpisodes {value:.0f} tok/s, model.generate {base:.0f} tok/s "
        f"({len(items)} prompts x {groups} x {new} tokens, {threads} thread(s), {repeats} rounds)"
    )
    result(named("real_model_rollout"), value, "tok/s", base, "0.9")


def rollout_dtype_case(model_dir: str, threads: int, repeats: int, engine: str) -> None:
    """RunEpisodes tok/s and peak RSS of a rollout server in bf16 vs one in fp32, the rounds
    alternating between them (``real_model_rollout_bf16``, ratio = bf16 / fp32)."""
    tokenizer = load_tokenizer(model_dir)
    prompts = [chat_ids(tokenizer, ROLLOUT_SYSTEM, it["question"]) for it in rollout_items()]
    engine_args = [f"rollout.engine={engine}"]
    if engine == "vllm":
        engine_args += ["rollout.vllm.kv_cache_gib=1", "rollout.vllm.max_model_len=512"]
    servers = {}
    try:
        for dtype in ("float32", "bfloat16"):
            servers[dtype] = start_rollout_server(
                model_dir, threads, *engine_args, f"rollout.dtype={dtype}"
            )
        rates: dict[str, list[float]] = {d: [] for d in servers}
        for server in servers.values():
            asyncio.run(episodes_round(server.address, prompts))  # warm-up
        for r in range(repeats):
            for dtype in ("float32", "bfloat16") if r % 2 == 0 else ("bfloat16", "float32"):
                n, secs = asyncio.run(episodes_round(servers[dtype].address, prompts))
                rates[dtype].append(n / secs)
        peak = {d: peak_rss_gib([s.process.pid], descendants=True) for d, s in servers.items()}
    finally:
        stop_children(list(servers.values()))
    fp32, bf16 = (statistics.median(rates[d]) for d in ("float32", "bfloat16"))
    for dtype in ("float32", "bfloat16"):
        print(
            f"rollout {engine} {dtype}: {' '.join(f'{x:.0f}' for x in rates[dtype])} tok/s "
            f"(median {statistics.median(rates[dtype]):.0f}), peak RSS {peak[dtype]:.2f} GiB"
        )
    suffix = "" if engine == "hf" else f"_{engine}"
    result(named(f"real_model_rollout_bf16{suffix}"), bf16, "tok/s", fp32, "1.8")
    result(
        named(f"real_model_rollout_bf16{suffix}_memory"),
        peak["bfloat16"],
        "GiB",
        peak["float32"],
        "none",
    )


# ------------------------------------------------------------------ the existing benchmarks


def relabel(argv: list[str], renames: dict[str, str]) -> None:
    """Runs another benchmark of this directory and re-prints its RESULT lines renamed.

    Its other lines are passed on as they come, so a run cut short still shows how far it got.
    """
    proc = subprocess.Popen(
        [sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    assert proc.stdout is not None
    results = []
    for line in proc.stdout:
        if line.startswith("RESULT"):
            results.append(line.rstrip("\n"))
        else:
            print("  " + line, end="", flush=True)
    if proc.wait() != 0:
        raise RuntimeError(f"{argv[0]} failed ({proc.returncode})")
    for line in results:
        name = re.search(r"bench=(\S+)", line)
        if name and name.group(1) in renames:
            print(line.replace(f"bench={name.group(1)}", f"bench={renames[name.group(1)]}"))


def vllm_learning(tmp: Path, args: argparse.Namespace) -> None:
    """The documented example with its rollout server on vLLM (once per
    ``--vllm-reserved-cpus`` value), then on the hf engine: the learning line of each vLLM
    run, and its wall time over hf's."""
    variants: list[tuple[str, dict[str, Any]]] = []
    for reserved in args.vllm_reserved_cpus.split(","):
        overrides: dict[str, Any] = {"rollout.engine": "vllm"}
        suffix = "_vllm"
        if reserved != "default":
            overrides["rollout.vllm.reserved_cpus"] = int(reserved)
            suffix += "_allcores" if int(reserved) == 0 else f"_reserved{reserved}"
        variants.append((suffix, overrides))
    walls = {}
    for label, extra in [*variants, ("hf", {})]:
        mesh = run_mesh(example_config(tmp / label, extra), tmp / label / "run")
        walls[label] = mesh["wall_s"]
        evals = [(e["step"], e["accuracy"], round(e["wall_s"])) for e in mesh["evals"]]
        print(f"{label}: {mesh['wall_s']:.0f} s wall; evaluations {evals}", flush=True)
        print(f"{label}: {step_profile(mesh['train'])}", flush=True)
        first, last = mesh["evals"][0]["accuracy"], mesh["evals"][-1]["accuracy"]
        if label != "hf":
            result(
                named(f"real_model_learning{label}"),
                last,
                "accuracy",
                first,
                "0.5",
                ratio=last - first,
            )
    for label, _ in variants:
        result(named(f"real_model_wall{label}"), walls[label], "s", walls["hf"], "none")


def main() -> int:
    """Runs the cases (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="everything but the learning run")
    parser.add_argument("--target-accuracy", type=float, default=0.8)
    parser.add_argument("--target-mix", default="add_1_1=1,add_2_1_ordered=1")
    parser.add_argument("--target-steps", type=int, default=24)
    parser.add_argument("--target-eval-every", type=int, default=4)
    parser.add_argument(
        "--target-seeds",
        type=int,
        default=1,
        help="runs of each side (n seeds from --target-first-seed); medians",
    )
    parser.add_argument(
        "--target-first-seed", type=int, default=0, help="the first seed of --target-seeds"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the baselines")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated: learning,target,rollout,train,sync; plain: the learning run's "
        "plain loop (and with it the memory case)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="cuda: the mesh's servers and the baselines on one GPU (cases named *_gpu; "
        "the train case is skipped there)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        help="keep the runs' data, configs and logs here (default: a temp dir)",
    )
    parser.add_argument(
        "--engine",
        choices=("hf", "vllm", "sglang"),
        default="hf",
        help="vllm: the learning case on vLLM; sglang: only with --dtype bf16",
    )
    parser.add_argument(
        "--vllm-reserved-cpus",
        default="default",
        help="--engine vllm: rollout.vllm.reserved_cpus values, comma-separated, one run each "
        "(default: vLLM's own, one core; 0: every core to vLLM's worker)",
    )
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: only rollout and train in bf16 against fp32, side by side "
        "(real_model_rollout_bf16[_vllm], real_model_train_bf16), on --engine",
    )
    parser.add_argument("--plain-loop", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.plain_loop:
        plain_loop(args.plain_loop, args.target_accuracy, args.threads)
        return 0
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    skip = set(filter(None, args.skip.split(",")))
    if DEVICE != "cpu":
        # bench/train_step.py runs its ranks on the CPU only.
        skip.add("train")
    model_dir = resolve_source("smollm2-135m-instruct")
    print(f"model: {model_dir}; {os.cpu_count()} CPU(s)", flush=True)
    with contextlib.ExitStack() as stack:
        if args.workdir:
            tmp = args.workdir
            tmp.mkdir(parents=True, exist_ok=True)
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-real-model-")))
        if args.dtype == "bf16":
            if "rollout" not in skip:
                rollout_dtype_case(model_dir, args.threads, args.repeats, args.engine)
            if "train" not in skip:
                relabel(
                    [
                        str(BENCH / "train_step.py"),
                        "--compare-precision",
                        *real_train_step_args(model_dir),
                    ],
                    {
                        "train_step_bf16": named("real_model_train_bf16"),
                        "train_step_bf16_memory": named("real_model_train_bf16_memory"),
                    },
                )
            return 0
        if args.engine == "sglang":
            parser.error("--engine sglang runs only with --dtype bf16")
        if args.engine == "vllm":
            vllm_learning(tmp, args)
            return 0
        if "learning" not in skip:
            overrides: dict[str, Any] = {}
            if args.quick:
                overrides = {"total_steps": 3, "eval.every_steps": 0}
            config = example_config(tmp, overrides)
            mesh = run_mesh(config, tmp / "run")
            print(
                f"mesh: {mesh['wall_s']:.0f} s wall; evaluations "
                f"{[(e['step'], e['accuracy'], round(e['wall_s'])) for e in mesh['evals']]}"
            )
            print(
                f"mesh: peak RSS by process (GiB) "
                f"{ {k: round(v, 2) for k, v in mesh['per_process_gib'].items()} }"
            )
            print(f"mesh: {step_profile(mesh['train'])}")
            if not args.quick:
                first, last = mesh["evals"][0]["accuracy"], mesh["evals"][-1]["accuracy"]
                print(f"learning: {first:.3f} -> {last:.3f} in {mesh['wall_s'] / 60:.1f} min")
                result(
                    named("real_model_learning"), last, "accuracy", first, "0.5", ratio=last - first
                )
            if "plain" not in skip:
                plain_cfg = config
                if args.quick:
                    plain_cfg = example_config(
                        tmp / "plain",
                        {"total_steps": 3, "eval.every_steps": 0, "eval.max_prompts": 10},
                    )
                plain = run_plain(plain_cfg, args.target_accuracy, args.threads)
                print(
                    f"plain loop: {plain['wall_s']:.0f} s wall; evaluations "
                    f"{[(e['step'], e['accuracy'], round(e['wall_s'])) for e in plain['evals']]}"
                )
                result(
                    named("real_model_memory"), mesh["peak_gib"], "GiB", plain["peak_gib"], "2.0"
                )
        if "target" not in skip and not args.quick:
            time_to_target(tmp / "target", args)
        if "rollout" not in skip:
            rollout_case(model_dir, args.threads, args.repeats)
        if "train" not in skip:
            relabel(
                [
                    str(BENCH / "train_step.py"),
                    *real_train_step_args(model_dir),
                    "--mb-trials=1",
                ],
                {"train_step": "real_model_train"},
            )
        if "sync" not in skip:
            relabel(
                [
                    str(BENCH / "weight_sync.py"),
                    f"--model={model_dir}",
                    f"--reps={args.repeats}",
                    f"--device={DEVICE}",
                ],
                {
                    named(f"weight_sync_{m}"): named(f"real_model_sync_{m}")
                    for m in ("shared_memory", "socket", "stream", "disk", "distributed")
                },
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
