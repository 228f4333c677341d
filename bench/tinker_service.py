"""The Tinker-compatible service (``python -m areal_grpc.tinker``) against plain in-process peft.

1. ``tinker_step``: one SFT step (``forward_backward`` with ``cross_entropy`` on a batch, then
   ``optim_step``) through the official ``tinker`` SDK against the service, and the same step
   written directly with peft and torch's AdamW in this process (the baseline). Both on the
   same model, adapter rank and batch, in alternating windows after a warm-up.
   ``ratio = in-process step time / SDK step time`` (1.0: the service adds nothing).
2. ``tinker_tenants_<n>`` for n = 1, 4, 16: n tenants, each with its own run, step at once
   (one SDK client each, in threads); ``ratio = aggregate steps per second / one tenant's``.
   The service computes a training step one call at a time (the queue takes tenants in turn;
   only calls that compute no gradient share a batch, case 3), so the ratio says how much the
   queue and the HTTP path overlap with compute, not parallel speed-up.
   Also printed: the trainer memory each adapter and its optimizer state take.
3. ``tinker_sample_batched_<n>``: n tenants (``--batch-tenants``) sample at once through the
   service's gRPC API, in process, each from its own adapter with its own seeds, the service
   batching their calls (one mixed-adapter batch) and, in alternating windows, running one
   call at a time. ``ratio = batched tokens/s / one-at-a-time tokens/s``; it also checks that
   the same seeds gave the same tokens both ways. ``tinker_forward_batched_<n>``: the same
   for forward-only calls (``--tokens`` long datums), and the log-probs' largest difference.
4. ``tinker_group_<n>``: one SFT step of ``--group-batch`` datums through the SDK against a
   service whose trainer group has n ranks (``tinker.trainer_ranks``, one thread each), and
   the same against a one-rank service whose torch uses n threads (``OMP_NUM_THREADS``), the
   other way to spend n cores; alternating windows. ``ratio = one rank's step time / the
   group's``. ``tinker_group_<n>_vs_1_thread``: the same against one rank on one thread.

    .venv/bin/python bench/tinker_service.py [--model smollm2-135m-instruct] [--rank 16]
        [--batch 4] [--tokens 64] [--steps 6] [--batch-tenants 8] [--group-ranks 2]
        [--group-batch 8] [--only sdk|batching|group]

The service process and the bench share the 2 cores; the SDK's client threads cost CPU too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import tinker
import torch
from areal_servers.lora_training.engine import LoraEngine
from areal_servers.lora_training.service import LoraTrainingServicer, Tenants
from arealgrpc.v1 import common_pb2
from arealgrpc.v1 import lora_training_pb2 as pb
from arealgrpc.v1 import lora_training_pb2_grpc as pb_grpc
from results import result
from tinker import types

from areal_grpc.config import TinkerConfig
from areal_grpc.durations import duration
from areal_grpc.launch import python_module_argv, start_child, stop_children
from areal_grpc.model import load_model
from areal_grpc.server import BackgroundServer, service

os.environ.setdefault("TINKER_TELEMETRY", "0")


def batch(n: int, tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (tokens + 1,), generator=g).tolist() for _ in range(n)]


def peft_step_s(model_source: str, rank: int, seqs: list[list[int]], steps: int) -> float:
    """Median seconds of one SFT step written directly with peft and AdamW."""
    from peft import LoraConfig, get_peft_model

    model = load_model(model_source)
    model.requires_grad_(False)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=32, target_modules=targets))
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    ids = torch.tensor([s[:-1] for s in seqs])
    targets_t = torch.tensor([s[1:] for s in seqs])
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        logits = peft_model(input_ids=ids).logits.float()
        lp = torch.log_softmax(logits, -1).gather(-1, targets_t[..., None])[..., 0]
        (-lp.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def sdk_step_s(tc: tinker.TrainingClient, seqs: list[list[int]], steps: int) -> list[float]:
    """Seconds of each SFT step through the SDK (the first, a warm-up, left out)."""
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
        )
        for s in seqs
    ]
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result()
        opt.result()
        times.append(time.perf_counter() - start)
    return times[1:]


# -- 3. tenants' calls batched together vs one at a time ----------------------------------------


@dataclass
class _Case:
    """An in-process service and its n tenants, each with a trained run and a sampler."""

    servicer: Any
    server: Any
    channel: grpc.Channel
    stub: Any
    keys: dict[str, str]
    runs: dict[str, str]
    samplers: dict[str, str]
    done: Callable[[str, pb.Operation], pb.Operation]  # awaits a tenant's operation


def _grpc_case_setup(model: str, n: int, rank: int) -> _Case:
    """The service over one engine, with n tenants ready to sample (see :class:`_Case`)."""
    keys = {f"t{i}": f"tml-bench-tenant-{i:04d}-0123456789" for i in range(n)}
    servicer = LoraTrainingServicer(
        LoraEngine(model), TinkerConfig(), Tenants(keys), Path(tempfile.mkdtemp()), [model]
    )
    bg = BackgroundServer(
        [service(servicer, pb_grpc.add_LoraTrainingServiceServicer_to_server, pb)]
    )
    running = bg.start()
    bg.call(servicer.start())
    channel = grpc.insecure_channel(running.address)
    stub = pb_grpc.LoraTrainingServiceStub(channel)

    def done(tenant: str, op: pb.Operation) -> pb.Operation:
        while not op.done:
            op = stub.WaitOperation(
                pb.WaitOperationRequest(name=op.name, timeout=duration(60)),
                metadata=_auth(keys[tenant]),
            ).operation
        if op.WhichOneof("result") == "error":
            raise RuntimeError(f"{op.name}: {op.error}")
        return op

    runs, samplers = {}, {}
    vocab = servicer.engine.vocab_size
    for i, tenant in enumerate(keys):
        meta = _auth(keys[tenant])
        created = stub.CreateTrainingRun(
            pb.CreateTrainingRunRequest(
                base_model=model, lora=pb.LoraSpec(rank=rank, train_attn=True, train_mlp=True)
            ),
            metadata=meta,
        ).operation
        run = runs[tenant] = done(tenant, created).training_run.name
        seq = batch(1, 16, vocab, seed=i)[0]
        datum = pb.Datum(input_tokens=seq[:-1], target_tokens=seq[1:], weights=[1.0] * 16)
        fb = stub.ForwardBackward(
            pb.ForwardBackwardRequest(
                training_run=run, data=[datum], loss_function=pb.LOSS_FUNCTION_CROSS_ENTROPY
            ),
            metadata=meta,
        ).operation
        opt = stub.OptimStep(
            pb.OptimStepRequest(
                training_run=run,
                adam=pb.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8),
            ),
            metadata=meta,
        ).operation
        done(tenant, fb), done(tenant, opt)
        saved = stub.SaveWeights(
            pb.SaveWeightsRequest(training_run=run, kind=pb.CHECKPOINT_KIND_SAMPLER),
            metadata=meta,
        ).operation
        samplers[tenant] = done(tenant, saved).checkpoint.name
    return _Case(servicer, bg, channel, stub, keys, runs, samplers, done)


def _auth(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def _sampling_window(
    case: _Case, args: argparse.Namespace
) -> tuple[float, dict[str, list[list[int]]]]:
    """Every tenant samples ``--batch-calls`` times at once; (sampled tokens per second,
    each tenant's completions)."""
    keys, done, stub, samplers = case.keys, case.done, case.stub, case.samplers
    vocab = case.servicer.engine.vocab_size
    got: dict[str, list[list[int]]] = {}

    def tenant(i: int, name: str) -> None:
        prompt = batch(1, 8 + 3 * (i % 4), vocab, seed=100 + i)[0]  # unequal: padding
        for k in range(args.batch_calls):
            sampling = common_pb2.SamplingParams(
                max_new_tokens=args.batch_new_tokens,
                n_samples=args.batch_samples,
                seed=1000 * i + k,
                ignore_eos=True,
            )
            op = stub.Sample(
                pb.SampleRequest(
                    checkpoint=samplers[name], prompt_tokens=prompt, sampling=sampling
                ),
                metadata=_auth(keys[name]),
            ).operation
            for c in done(name, op).sample.completions:
                got.setdefault(name, []).append(list(c.output_ids))

    elapsed = _in_threads(tenant, list(samplers))
    tokens = sum(len(c) for cs in got.values() for c in cs)
    return tokens / elapsed, got


def _forward_window(case: _Case, args: argparse.Namespace) -> tuple[float, dict[str, list[float]]]:
    """Every tenant makes ``--batch-calls`` forward-only calls at once (2 datums of unequal
    length); (tokens per second, each tenant's log-probs)."""
    vocab = case.servicer.engine.vocab_size
    got: dict[str, list[float]] = {}

    def tenant(i: int, name: str) -> None:
        for k in range(args.batch_calls):
            data = [
                pb.Datum(input_tokens=s[:-1], target_tokens=s[1:], weights=[1.0] * (len(s) - 1))
                for s in (
                    batch(1, args.tokens, vocab, seed=10 * i + k)[0],
                    batch(1, args.tokens // 2 + i, vocab, seed=10 * i + k + 5)[0],
                )
            ]
            op = case.stub.ForwardBackward(
                pb.ForwardBackwardRequest(
                    training_run=case.runs[name],
                    data=data,
                    loss_function=pb.LOSS_FUNCTION_CROSS_ENTROPY,
                    forward_only=True,
                ),
                metadata=_auth(case.keys[name]),
            ).operation
            for out in case.done(name, op).forward_backward.outputs:
                got.setdefault(name, []).extend(out.logprobs)

    elapsed = _in_threads(tenant, list(case.runs))
    return sum(len(v) for v in got.values()) / elapsed, got


def _in_threads(target: Callable[[int, str], None], tenants: list[str]) -> float:
    """Runs ``target(i, tenant)`` for every tenant at once; the seconds it took."""
    threads = [threading.Thread(target=target, args=(i, t)) for i, t in enumerate(tenants)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def _alternate(
    case: _Case, args: argparse.Namespace, window: Callable[..., tuple[float, dict[str, Any]]]
) -> tuple[dict[bool, list[float]], dict[bool, dict[str, Any]]]:
    """A warm-up, then ``--batch-repeats`` pairs of windows, one call at a time and batched:
    (rates, the last outputs) by batching."""
    rates: dict[bool, list[float]] = {False: [], True: []}
    seen: dict[bool, dict[str, Any]] = {}
    case.servicer.batching = True
    window(case, args)
    for _ in range(args.batch_repeats):
        for batching in (False, True):
            case.servicer.batching = batching
            rate, seen[batching] = window(case, args)
            rates[batching].append(rate)
            mode = "batched" if batching else "one at a time"
            print(f"  {window.__name__} window, {mode}: {rate:.1f} tokens/s", flush=True)
    return rates, seen


def _report(bench: str, what: str, rates: dict[bool, list[float]], same: str) -> None:
    for batching in (False, True):
        r = rates[batching]
        print(
            f"{what}, {'batched' if batching else 'one at a time'}: median "
            f"{statistics.median(r):.1f} tokens/s (range {min(r):.1f}-{max(r):.1f} over "
            f"{len(r)} windows)",
            flush=True,
        )
    ratios = [b / u for b, u in zip(rates[True], rates[False], strict=True)]
    print(f"per-window ratio {min(ratios):.2f}-{max(ratios):.2f}; {same}", flush=True)
    value, base = statistics.median(rates[True]), statistics.median(rates[False])
    result(bench, value, "tokens/s", base, "none")


def batching_case(args: argparse.Namespace) -> None:
    """``tinker_sample_batched_<n>``: n tenants sample at once (each its own adapter, seeded,
    prompts of unequal length); ``tinker_forward_batched_<n>``: they make forward-only calls
    at once. Each with the service batching their calls and one call at a time, in
    alternating windows; ratio = batched tokens/s / one-at-a-time tokens/s."""
    n = args.batch_tenants
    case = _grpc_case_setup(args.model, n, args.rank)
    try:
        rates, seen = _alternate(case, args, _sampling_window)
        same = seen[False] == seen[True]
        _report(
            f"tinker_sample_batched_{n}",
            f"{n} tenants sampling",
            rates,
            f"the same seeds gave the same tokens batched and alone: {same}",
        )
        rates, seen = _alternate(case, args, _forward_window)
        worst = max(
            abs(a - b)
            for t in seen[False]
            for a, b in zip(seen[False][t], seen[True][t], strict=True)
        )
        _report(
            f"tinker_forward_batched_{n}",
            f"{n} tenants' forward passes",
            rates,
            f"log-probs batched vs alone differ by at most {worst:.2g}",
        )
    finally:
        case.channel.close()
        case.server.call(case.servicer.stop())
        case.server.stop()


def _start_service(work: Path, name: str, model: str, threads: int, *overrides: str) -> Any:
    """``python -m areal_grpc.tinker`` with the tenants of ``work/tenants.json``, its output
    in ``work/name`` and its log ``work/name.log``, torch on ``threads`` threads."""
    return start_child(
        name,
        python_module_argv(
            "areal_grpc.tinker",
            f"model.source={model}",
            f"output.dir={work / name}",
            f"tinker.tenants_file={work / 'tenants.json'}",
            *overrides,
        ),
        log_dir=work,
        env={"OMP_NUM_THREADS": str(threads)},
        ready_timeout_s=600,
    )


def _base_model_name(url: str, key: str) -> str:
    """How the service at ``url`` lists its base model."""
    caps = tinker.RestClient(base_url=url, api_key=key).get_server_capabilities().result()
    return caps.supported_models[0].model_name


def group_case(args: argparse.Namespace) -> None:
    """4. A trainer group of n ranks against one rank on n threads and on one thread."""
    n = args.group_ranks
    work = Path(tempfile.mkdtemp(prefix="bench-tinker-group-"))
    keys = {"t0": "tml-bench-group-0123456789abcdef"}
    (work / "tenants.json").write_text(json.dumps(keys))
    vocab = 49152 if "smollm2" in args.model else 384
    seqs = batch(args.group_batch, args.tokens, vocab)
    setups = {
        "group": (1, f"tinker.trainer_ranks={n}"),
        "threads": (n, "tinker.trainer_ranks=1"),
        "one": (1, "tinker.trainer_ranks=1"),
    }
    children = []
    try:
        clients = {}
        for name, (threads, override) in setups.items():
            child = _start_service(work, name, args.model, threads, override)
            children.append(child)
            clients[name] = tinker.ServiceClient(
                base_url=f"http://{child.address}", api_key=keys["t0"]
            )
        base = _base_model_name(f"http://{children[0].address}", keys["t0"])
        runs = {
            name: client.create_lora_training_client(base_model=base, rank=args.rank).result()
            for name, client in clients.items()
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(2):
            for name, tc in runs.items():
                times[name].extend(sdk_step_s(tc, seqs, args.steps))
        med = {name: statistics.median(t) for name, t in times.items()}
        for name, t in times.items():
            print(
                f"{name}: step of {args.group_batch} x {args.tokens} tokens "
                f"median {med[name]:.3f} s "
                f"(range {min(t):.3f}-{max(t):.3f})",
                flush=True,
            )
        result(
            f"tinker_group_{n}",
            med["group"],
            "s",
            med["threads"],
            "none",
            ratio=med["threads"] / med["group"],
        )
        result(
            f"tinker_group_{n}_vs_1_thread",
            med["group"],
            "s",
            med["one"],
            "none",
            ratio=med["one"] / med["group"],
        )
    finally:
        stop_children(children)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tenants", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--batch-tenants", type=int, default=8)
    p.add_argument("--batch-calls", type=int, default=3, help="sampling calls per tenant")
    p.add_argument("--batch-samples", type=int, default=2, help="n_samples of each call")
    p.add_argument("--batch-new-tokens", type=int, default=32)
    p.add_argument("--batch-repeats", type=int, default=3)
    p.add_argument(
        "--only",
        choices=["sdk", "batching", "group"],
        help="run only the SDK cases (1, 2), only the batching case (3) or only the group (4)",
    )
    p.add_argument("--group-ranks", type=int, default=2, help="ranks of case 4's group")
    p.add_argument("--group-batch", type=int, default=8, help="datums of case 4's step")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.only in (None, "batching"):
        batching_case(args)
    if args.only in (None, "group"):
        group_case(args)
    if args.only in ("batching", "group"):
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench-tinker-"))
    n_max = max(args.tenants)
    keys = {f"t{i}": f"tml-bench-tenant-{i:04d}-0123456789" for i in range(n_max)}
    (work / "tenants.json").write_text(json.dumps(keys))
    child = _start_service(
        work, "tinker", args.model, 1, f"tinker.max_runs_per_tenant={len(args.tenants) + 1}"
    )
    url = f"http://{child.address}"
    print(f"{os.cpu_count()} CPU(s); service {url}; model {args.model}", flush=True)
    try:
        clients = {
            name: tinker.ServiceClient(base_url=url, api_key=key) for name, key in keys.items()
        }
        base_name = _base_model_name(url, keys["t0"])
        first = clients["t0"].create_lora_training_client(base_model=base_name, rank=args.rank)
        tc = first.result()
        vocab = 49152 if "smollm2" in args.model else 384
        seqs = batch(args.batch, args.tokens, vocab)

        # 1. one step: SDK vs in-process peft, alternating.
        sdk, direct = [], []
        for _ in range(2):
            sdk.extend(sdk_step_s(tc, seqs, args.steps))
            direct.append(peft_step_s(args.model, args.rank, seqs, args.steps))
        sdk_s, direct_s = statistics.median(sdk), statistics.median(direct)
        print(
            f"step ({args.batch} x {args.tokens} tokens, rank {args.rank}): SDK median "
            f"{sdk_s:.3f} s (range {min(sdk):.3f}-{max(sdk):.3f}), in-process peft "
            f"{direct_s:.3f} s",
            flush=True,
        )
        result("tinker_step", sdk_s, "s", direct_s, "0.8", ratio=direct_s / sdk_s)

        # 2. n tenants at once.
        runs = {}
        for i in range(n_max):
            name = f"t{i}"
            runs[name] = (
                tc
                if i == 0
                else clients[name]
                .create_lora_training_client(base_model=base_name, rank=args.rank)
                .result()
            )
        single = None
        for n in sorted(args.tenants):
            done: dict[str, int] = {}
            start = time.perf_counter()

            def tenant(name: str, done: dict[str, int] = done) -> None:
                done[name] = len(sdk_step_s(runs[name], seqs, args.steps))

            threads = [threading.Thread(target=tenant, args=(f"t{i}",)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            rate = sum(done.values()) / (time.perf_counter() - start)
            single = single or rate
            print(f"{n} tenant(s): {rate:.3f} steps/s in all", flush=True)
            result(f"tinker_tenants_{n}", rate, "steps/s", single, "none")
        log = (work / "tinker.log").read_text()
        grpc_address = next(
            line.split()[1] for line in log.splitlines() if line.startswith("GRPC ")
        )
        with grpc.insecure_channel(grpc_address) as channel:
            reply = pb_grpc.LoraTrainingServiceStub(channel).ListTrainingRuns(
                pb.ListTrainingRunsRequest(),
                metadata=[("authorization", f"Bearer {keys['t0']}")],
            )
        per_adapter = reply.training_runs[0].adapter_bytes / 2**20
        print(
            f"trainer memory per adapter (rank {args.rank}, weights + gradients + Adam "
            f"state): {per_adapter:.1f} MiB",
            flush=True,
        )
    finally:
        stop_children([child])
    return 0


if __name__ == "__main__":
    sys.exit(main())
