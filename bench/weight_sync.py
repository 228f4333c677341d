"""Seconds per weight sync for each method, ~100M-parameter model, loopback, vs baselines.

Run by hand: ``.venv/bin/python bench/weight_sync.py [--reps N] [--layers L | --model SOURCE]``.

What runs (all on this machine, loopback):

* A local Qwen2 config (hidden 1024, 8 layers, MLP 2816, byte vocabulary: ~104M parameters,
  float32, random init, no downloads) saved as an HF directory.
* One ``areal-trainer`` process (world size 1, FSDP2 over gloo; DISK keeps 2 versions, the
  trainer's default).
* Per method, one rollout server process (hf engine + RolloutService + WeightSyncService),
  updated repeatedly as in a training run: the trainer takes a tiny step (not timed), then the
  coordinator's ``clients.fleet.update_fleet_weights`` moves the new version by that method,
  over channels kept from one update to the next (as the coordinator keeps them).
  The time is the whole fleet update (pause, negotiate, gather, transfer, swap into the served
  model, confirm, resume).

Baselines, measured in the same run on the same bytes (the state dict the trainer publishes):

* shared_memory: a plain memcpy of the same bytes into fresh memory (allocated and written
  once, in this process, one thread), as a new version must be written while the old one is
  still served; the copy into warm buffers is printed too.
* socket and stream: a raw TCP copy between two processes (``sendall`` from tensor memory,
  ``recv_into`` preallocated buffers, one ack at the end).
* disk: ``safetensors.torch.save_file`` then ``load_file`` of the state dict (``load_file``
  maps the file, as our receiver does: neither copies the bytes again).
* distributed: a bare ``torch.distributed`` gloo group of two fresh processes broadcasting
  the same tensors one by one (as the protocol does).

Each method runs ``KEEP_VERSIONS`` times unmeasured (the steady state of a long run: see the
comment in ``main``), then ``--reps`` times; then its baseline, likewise (in a block of its
own). Each method prints
``RESULT bench=weight_sync_<method> value=<s> unit=s baseline=<s> ratio=<r> target=1.3``
(medians). ``--device cuda`` puts the trainer and the rollout servers on one GPU (the cases
are then named ``weight_sync_<method>_gpu``; the baselines stay the CPU ones above, on the same
bytes: the floor of getting them from one process to another once they are off the GPU).
``--tls`` runs the trainer, the rollout servers and the coordinator's channels under TLS (a
throwaway CA; SOCKET's side channel then speaks TLS too): the cases are named
``weight_sync_<method>_tls``, against the same plaintext floors, which gives the price of TLS.
``--link GBIT`` puts the rollout servers, and the receiving end of each baseline, on a second
"host": a network namespace reached over a veth pair shaped to GBIT Gbit/s each way
(``bench/link.py``; needs root). The cases are named ``weight_sync_<method>_link<GBIT>gbit``,
against floors that cross the same link; ``shared_memory`` and ``disk`` need the same host and
are left out. ``--servers N`` updates N rollout servers per method at once (the cases get
``_<N>servers``); the floors stay one copy, so the ratio says how many copies' time it took.
``--engine vllm`` (needs ``./scripts/setup --vllm``) serves the rollout servers on vLLM: every
method lands in vLLM's layerwise reload in its worker: from a safetensors file for socket and
stream (the engine's staged file in shared memory, which they receive into) and for disk and
shared_memory (the update's own files); from the worker's own buffers for distributed (the
worker joins the group and takes the broadcast itself). Its cases are
``weight_sync_<method>_vllm``, the transfer alone (the fleet update less the server's own
load, which it logs) against the method's floor; the load prints apart as
``weight_sync_vllm_load_<method>`` against a memcpy of the same bytes (no target).
``--dtype bfloat16`` has the rollout servers serve bf16, so the trainer (fp32 weights) sends
bf16: half the bytes. Its cases are ``weight_sync_<method>_bf16``, each against the same method
into float32 servers in the same run (target 0.7: half the bytes, plus the sender's cast).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import link as shaped
import torch
from arealgrpc.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from results import result
from safetensors.torch import load_file, save_file
from transformers import ByT5Tokenizer, Qwen2Config, Qwen2ForCausalLM

from areal_grpc.config import ModelConfig, RolloutConfig
from areal_grpc.launch import Child, python_module_argv, start_child, start_children, stop_children
from areal_grpc.model import resolve_source, save_pretrained
from areal_grpc.server import sync_channel

TARGET = 1.3
# Versions DISK keeps on disk (the trainer's default), and unmeasured rounds of each case.
KEEP_VERSIONS = 2
METHODS = ("shared_memory", "socket", "stream", "disk", "distributed")
# Methods that need the receiver on the sender's host (memory, or here a filesystem, shared).
SAME_HOST = ("shared_memory", "disk")
ACK = b"k"


# ------------------------------------------------------------------------------ the model


def build_model_dir(path: Path, layers: int) -> Path:
    """A random-init Qwen2 model (~104M parameters at 8 layers) saved as an HF directory."""
    tok = ByT5Tokenizer()
    config = Qwen2Config(
        vocab_size=384,
        hidden_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=2816,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    save_pretrained(model, tok, path)
    return path


def published_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors a trainer publishes for this model (tied lm_head left out)."""
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    sd.pop("lm_head.weight", None)
    return sd


# ------------------------------------------------------------------------- rollout child


def make_pki(d: Path, *hosts: str) -> dict[str, str]:
    """A throwaway CA and one certificate for 127.0.0.1 and ``hosts`` (every process of the
    run)."""
    import trustme

    ca = trustme.CA()
    node = ca.issue_cert("127.0.0.1", *hosts)
    files = {"ca": d / "ca.pem", "cert": d / "node.pem", "key": d / "node.key"}
    ca.cert_pem.write_to_path(files["ca"])
    node.cert_chain_pems[0].write_to_path(files["cert"])
    node.private_key_pem.write_to_path(files["key"])
    return {k: str(v) for k, v in files.items()}


def serve_rollout(
    model: str,
    disk_root: str,
    device: str = "cpu",
    cert_key: Sequence[str] | None = None,
    netns: str | None = None,
    host: str = "127.0.0.1",
    engine_kind: str = "hf",
    dtype: str = "float32",
) -> None:
    """Child mode: a rollout server with WeightSyncService on ``host`` (under TLS with
    ``cert_key``, the certificate and key files; inside ``netns`` when given); prints
    LISTENING host:port; the engine serves ``dtype``, which the trainer then sends."""
    if netns:
        shaped.enter(netns)
    from areal_servers.rollout.hf_engine import HFEngine
    from areal_servers.rollout.receive.base import ReceiverConfig
    from areal_servers.rollout.service import RolloutServicer
    from areal_servers.rollout.weight_sync import build_weight_sync_service
    from arealgrpc.v1 import rollout_pb2, rollout_pb2_grpc

    from areal_grpc.model import load_tokenizer
    from areal_grpc.security import ServerTls
    from areal_grpc.server import ServerOptions, serve_until_signal, service, start_server

    torch.set_num_threads(1)
    tls = ServerTls(*cert_key) if cert_key else None

    async def main() -> None:
        if engine_kind == "vllm":
            import logging

            from areal_servers.rollout.vllm_engine import VLLMEngine

            from areal_grpc.config import VllmSettings

            # Its per-update load times, which the parent reads from this child's log.
            logging.basicConfig(level=logging.WARNING)
            logging.getLogger("areal_servers.rollout.vllm_engine").setLevel(logging.INFO)
            engine = VLLMEngine(
                model, VllmSettings(kv_cache_gib=0.5, max_model_len=512), dtype=dtype
            )
            await engine.start()
        else:
            engine = HFEngine(
                ModelConfig(source=model),
                RolloutConfig(device=device, dtype=dtype),  # type: ignore[arg-type]
            )
        rollout = RolloutServicer(engine, load_tokenizer(model))
        services = [
            service(rollout, rollout_pb2_grpc.add_RolloutServiceServicer_to_server, rollout_pb2),
            build_weight_sync_service(
                engine,
                ReceiverConfig(disk_root=disk_root, socket_host=host, socket_tls=tls),
            ),
        ]
        # Beyond loopback only behind --link: the namespace's link reaches nothing else.
        running = await start_server(
            services, ServerOptions(host=host, port=0, tls=tls, allow_plaintext=True)
        )
        print(f"LISTENING {running.address}", flush=True)
        await serve_until_signal(running)
        await engine.close()

    asyncio.run(main())


# ----------------------------------------------------------------------------- trainer


def train_one_step(address: str, step: int = 0, version: int = 0) -> int:
    """One tiny training step (the published version goes up by one); the new version."""
    with sync_channel(address) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        group = common_pb2.TrajectoryGroup(group_id="g")
        for i in range(2):
            group.trajectories.append(
                common_pb2.Trajectory(
                    token_ids=[5 + i, 9, 11, 13, 17, 19, 23, 29],
                    logprobs=[0.0] * 3 + [-5.9] * 5,
                    versions=[-1] * 3 + [version] * 5,
                    loss_mask=[False] * 3 + [True] * 5,
                    reward=float(i),
                    prompt_length=3,
                    group_id="g",
                )
            )
        msgs = [
            trainer_pb2.TrainStepRequest(
                begin=trainer_pb2.StepBegin(global_step=step, policy_version=version, group_count=1)
            ),
            trainer_pb2.TrainStepRequest(group=group),
            trainer_pb2.TrainStepRequest(end=trainer_pb2.StepEnd()),
        ]
        version = 0
        for resp in stub.TrainStep(iter(msgs), timeout=600):
            if resp.HasField("stats"):
                version = resp.stats.policy_version
        return int(version)


class Fleet:
    """The coordinator's side of the updates: one event loop, channels kept between updates
    (as ``python -m areal_grpc.coordinator`` keeps them from one step to the next)."""

    def __init__(self) -> None:
        from areal_grpc.server import ChannelCache

        self.loop = asyncio.new_event_loop()
        self.channels = ChannelCache()

    def time_sync(
        self, trainer: str, rollouts: Sequence[str], method: str, relayed: bool = False
    ) -> float:
        """One fleet update by ``method`` into every rollout server; seconds (``relayed``:
        servers may take it from their host's relay, by shared memory)."""
        from areal_clients.fleet import update_fleet_weights

        start = time.perf_counter()
        result = self.loop.run_until_complete(
            update_fleet_weights(
                [trainer], rollouts, methods=(method,), timeout_s=600, channels=self.channels
            )
        )
        elapsed = time.perf_counter() - start
        taken = {method, "shared_memory"} if relayed else {method}
        if result.failed_servers or any(s.method not in taken for s in result.servers):
            raise RuntimeError(f"{method} sync failed: {result.servers}")
        print(
            f"  {method}: version {result.version}: fleet update {elapsed:.3f} s, of which "
            f"PublishWeights on rank 0 {result.publish_elapsed_s:.3f} s",
            flush=True,
        )
        return elapsed

    def close(self) -> None:
        """Closes the channels and the loop."""
        self.loop.run_until_complete(self.channels.aclose())
        self.loop.close()


# ---------------------------------------------------------------------------- baselines


def _tcp_receiver(port_q: mp.Queue, sizes: list[int], link: shaped.Link | None) -> None:
    if link:
        shaped.enter(link.netns)
    bufs = [bytearray(n) for n in sizes]  # preallocated, like the receiver's staging buffers
    with socket.socket() as srv:
        srv.bind((link.peer_ip if link else "127.0.0.1", 0))
        srv.listen(1)
        port_q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            for buf in bufs:
                view = memoryview(buf)
                got = 0
                while got < len(buf):
                    got += conn.recv_into(view[got:], len(buf) - got)
            conn.sendall(ACK)


def tcp_baseline(sd: dict[str, torch.Tensor], link: shaped.Link | None = None) -> float:
    """Raw TCP copy of the state dict's bytes to another process (across ``link``); seconds."""
    tensors = [t.contiguous() for t in sd.values()]
    sizes = [t.numel() * t.element_size() for t in tensors]
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_tcp_receiver, args=(q, sizes, link))
    proc.start()
    port = q.get(timeout=120)
    with socket.create_connection((link.peer_ip if link else "127.0.0.1", port)) as s:
        start = time.perf_counter()
        # No framing: both sides know the sizes, as a receiver knows them from the header.
        for t in tensors:
            s.sendall(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        assert s.recv(1) == ACK
        elapsed = time.perf_counter() - start
    proc.join(timeout=60)
    return elapsed


def memcpy_baseline(sd: dict[str, torch.Tensor]) -> float:
    """A plain copy of the state dict's bytes into fresh memory (allocated, then written
    once, as a new version must be: the old one is still being served); seconds. The copy
    into buffers already faulted in is printed beside it."""
    start = time.perf_counter()
    dst = [torch.empty_like(t) for t in sd.values()]
    for d, t in zip(dst, sd.values(), strict=True):
        d.copy_(t)
    fresh = time.perf_counter() - start
    start = time.perf_counter()
    for d, t in zip(dst, sd.values(), strict=True):
        d.copy_(t)
    print(
        f"  memcpy: into fresh memory {fresh:.3f} s, into warm buffers "
        f"{time.perf_counter() - start:.3f} s",
        flush=True,
    )
    return fresh


def disk_baseline(sd: dict[str, torch.Tensor], root: Path) -> float:
    """Plain safetensors save + load of the state dict; seconds."""
    path = root / "baseline.safetensors"
    start = time.perf_counter()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    back = load_file(str(path))
    elapsed = time.perf_counter() - start
    assert back.keys() == sd.keys()
    path.unlink()
    return elapsed


def _bcast_rank(
    rank: int, port: int, model_dir: str, out: mp.Queue, link: shaped.Link | None
) -> None:
    import torch.distributed as dist

    master = "127.0.0.1"
    if link:
        master = link.host_ip
        if rank:
            shaped.enter(link.netns)
        # gloo otherwise takes the address of this machine's hostname, which the other end
        # of the link cannot reach.
        os.environ["GLOO_SOCKET_IFNAME"] = link.peer_if if rank else link.host_if
    torch.set_num_threads(1)
    sd = published_state_dict(Path(model_dir))
    tensors = (
        [t.contiguous() for t in sd.values()]
        if rank == 0
        else [torch.empty_like(t) for t in sd.values()]
    )
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=300),
    )
    dist.barrier()
    start = time.perf_counter()
    for t in tensors:
        dist.broadcast(t, src=0)
    dist.barrier()
    if rank == 0:
        out.put(time.perf_counter() - start)
    dist.destroy_process_group()


def broadcast_baseline(model_dir: Path, link: shaped.Link | None = None) -> float:
    """A bare torch.distributed (gloo) broadcast of the same tensors, two processes (rank 1
    across ``link``); seconds."""
    from areal_grpc.ports import free_port

    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    port = free_port(link.host_ip if link else "127.0.0.1")
    procs = [
        ctx.Process(target=_bcast_rank, args=(r, port, str(model_dir), q, link)) for r in range(2)
    ]
    for p in procs:
        p.start()
    elapsed = q.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return float(elapsed)


# -------------------------------------------------------------------------------- main


def main() -> int:
    """Runs the benchmark and prints one RESULT line per method."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--model", help="a model source instead of the random-init one (e.g. a real model)"
    )
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the trainer and the rollout servers keep the model (cuda: one GPU for both, "
        "so DISTRIBUTED runs over gloo: NCCL cannot join two processes on one GPU)",
    )
    parser.add_argument(
        "--tls", action="store_true", help="every process and channel under TLS (a throwaway CA)"
    )
    shaped.add_option(parser, "the rollout servers (shared_memory and disk left out)")
    parser.add_argument(
        "--servers",
        type=int,
        default=1,
        help="rollout servers per method, all updated at once (the floors stay one copy)",
    )
    parser.add_argument(
        "--engine", choices=("hf", "vllm"), default="hf", help="the rollout servers' engine"
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="what the rollout servers serve (and the trainer sends); bfloat16: each method's "
        "bf16 update against its float32 update, measured in the same run",
    )
    parser.add_argument("--serve-rollout", nargs=2, metavar=("MODEL", "DISK_ROOT"))
    parser.add_argument("--serve-tls", nargs=2, help=argparse.SUPPRESS)  # child: cert, key
    parser.add_argument("--serve-netns", nargs=2, help=argparse.SUPPRESS)  # child: netns, host
    args = parser.parse_args()
    if args.serve_rollout:
        netns, host = args.serve_netns or (None, "127.0.0.1")
        serve_rollout(
            *args.serve_rollout,
            device=args.device,
            cert_key=args.serve_tls,
            netns=netns,
            host=host,
            engine_kind=args.engine,
            dtype=args.dtype,
        )
        return 0
    torch.set_num_threads(1)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    if args.servers < 1:
        parser.error(f"--servers must be at least 1, got {args.servers}")
    if args.link is not None:
        same_host = [m for m in methods if m in SAME_HOST]
        if args.methods == parser.get_default("methods"):
            methods = [m for m in methods if m not in SAME_HOST]
        elif same_host:
            parser.error(f"--link: {same_host} need the same host; leave them out")
    with shaped.from_args(parser, args.link) as link:
        return run(args, methods, link)


def run(args: argparse.Namespace, methods: list[str], link: shaped.Link | None) -> int:
    """The benchmark proper (across ``link`` when given)."""
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        base = Path(tmp)
        tls_argv: list[str] = []
        pki_argv: list[str] = []
        if args.tls:
            from areal_grpc.security import ClientTls
            from areal_grpc.server import ChannelOptions, set_default_channel_options

            pki = make_pki(base, *([link.peer_ip] if link else []))
            tls_argv = [
                f"--tls-cert={pki['cert']}",
                f"--tls-key={pki['key']}",
                f"--tls-ca={pki['ca']}",
            ]
            pki_argv = ["--serve-tls", pki["cert"], pki["key"]]
            # The coordinator's side (this process): channels that trust the run's CA.
            set_default_channel_options(ChannelOptions(tls=ClientTls(pki["ca"])))
        model_dir = (
            Path(resolve_source(args.model))
            if args.model
            else build_model_dir(base / "model", args.layers)
        )
        sd = published_state_dict(model_dir)
        n_params = sum(t.numel() for t in sd.values())
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        print(f"model: {n_params / 1e6:.1f}M parameters, {nbytes / 2**20:.0f} MiB float32")
        weights_root = base / "weights"
        weights_root.mkdir()
        trainer = start_child(
            "trainer",
            python_module_argv(
                "areal_servers.trainer",
                "--port=0",
                "--rank=0",
                "--world-size=1",
                "--master-addr=127.0.0.1",
                f"--master-port={_port()}",
                "--log-level=WARNING",
                f"model.source={model_dir}",
                "trainer.torch_threads=1",
                f"weight_sync.disk_root={weights_root}",
                f"output.dir={base}",
                f"weight_sync.keep_versions={KEEP_VERSIONS}",
                f"trainer.device={args.device}",
                "weight_sync.backend=gloo",
                # Where the servers across the link join the trainer's weight group.
                *([f"weight_sync.master_addr={link.host_ip}"] if link else []),
                *tls_argv,
            ),
            log_dir=base / "logs",
            env={"OMP_NUM_THREADS": "1"},
            ready_timeout_s=300,
        )
        fleet = Fleet()
        try:
            step, version = 0, 0

            def train() -> None:
                nonlocal step, version
                version = train_one_step(trainer.address, step, version)
                step += 1

            print(
                f"trainer: 1 rank (FSDP2) on {args.device}; rollout servers on {args.device}"
                + ("; every process and channel under TLS" if args.tls else "")
                + (
                    f"; the rollout servers across a {link.gbit:g} Gbit/s link "
                    f"({link.host_ip} -> {link.peer_ip} in {link.netns})"
                    if link
                    else ""
                )
            )
            baselines = {
                "shared_memory": ("memcpy", lambda: memcpy_baseline(sd)),
                "socket": ("raw TCP copy", lambda: tcp_baseline(sd, link)),
                "stream": ("raw TCP copy", lambda: tcp_baseline(sd, link)),
                "disk": ("safetensors save+load", lambda: disk_baseline(sd, base)),
                "distributed": (
                    "bare gloo broadcast",
                    lambda: broadcast_baseline(model_dir, link),
                ),
            }

            def measure(method: str, dtype: str) -> tuple[list[float], list[float], list[Child]]:
                """Unmeasured and measured syncs of rollout servers of their own serving
                ``dtype``, updated repeatedly as in a run (the servers, stopped, returned)."""
                argv = [
                    sys.executable,
                    __file__,
                    "--serve-rollout",
                    str(model_dir),
                    str(weights_root),
                    f"--device={args.device}",
                    f"--engine={args.engine}",
                    f"--dtype={dtype}",
                    *pki_argv,
                    *(["--serve-netns", link.netns, link.peer_ip] if link else []),
                ]
                rollouts: list[Child] = []
                warm, syncs = [], []
                try:
                    start_children(
                        [(f"rollout-{method}-{dtype}-{i}", argv) for i in range(args.servers)],
                        rollouts.append,
                        log_dir=base / "logs",
                        ready_timeout_s=900,
                    )
                    addresses = [r.address for r in rollouts]
                    # Unmeasured rounds first: the first update of a process pays one-off
                    # costs (page faults of fresh buffers, connection set-up), and until
                    # DISK has KEEP_VERSIONS versions on disk each new one grows the page
                    # cache instead of taking over the pages of the one pruned (3-4x the
                    # steady state here). A run pays both once; thousands of syncs follow.
                    for _ in range(KEEP_VERSIONS):
                        train()
                        warm.append(fleet.time_sync(trainer.address, addresses, method))
                    for _ in range(args.reps):
                        train()  # not timed: only makes the next version
                        syncs.append(fleet.time_sync(trainer.address, addresses, method))
                finally:
                    stop_children(rollouts)
                return warm, syncs, rollouts

            for method in methods:
                label, baseline_fn = baselines[method]
                if args.dtype == "bfloat16":
                    # The same method into float32 servers, then into bfloat16 ones.
                    _, wide, _ = measure(method, "float32")
                    warm, narrow, _ = measure(method, "bfloat16")
                    print(
                        f"{method}: float32 syncs {[round(x, 3) for x in wide]} s, bfloat16 "
                        f"(unmeasured {[round(x, 3) for x in warm]}) "
                        f"{[round(x, 3) for x in narrow]} s",
                        flush=True,
                    )
                    result(
                        f"weight_sync_{method}_bf16",
                        statistics.median(narrow),
                        "s",
                        statistics.median(wide),
                        "0.7",
                    )
                    continue
                warm, syncs, rollouts = measure(method, "float32")
                # The baseline in a block of its own, after the syncs, likewise warmed up:
                # interleaved, each side writes into the page-cache memory the other just
                # freed (cheap here) and leaves it to grow the page cache (several times
                # dearer here), and the ratio measures who went first.
                for _ in range(KEEP_VERSIONS):
                    baseline_fn()
                bases = [baseline_fn() for _ in range(args.reps)]
                value = statistics.median(syncs)
                baseline = statistics.median(bases)
                loads: list[float] = []
                if args.engine == "vllm":
                    # The server's own load of each measured version (write + reload), from
                    # its log; the transfer is the rest of the fleet update.
                    writes, reloads = vllm_load_times(rollouts[0].log_path)
                    writes, reloads = writes[-args.reps :], reloads[-args.reps :]
                    loads = [w + r for w, r in zip(writes, reloads, strict=True)]
                    value = statistics.median(s - ld for s, ld in zip(syncs, loads, strict=True))
                print(
                    f"{method}: unmeasured {[round(s, 3) for s in warm]} s, "
                    f"syncs {[round(s, 3) for s in syncs]} s; {label} "
                    f"{[round(b, 3) for b in bases]} s",
                    flush=True,
                )
                # Named apart on a GPU: the same method is another case there.
                name = f"weight_sync_{method}" + ("" if args.device == "cpu" else "_gpu")
                name += "_tls" if args.tls else ""
                name += f"_{link.label}" if link else ""
                name += f"_{args.servers}servers" if args.servers > 1 else ""
                name += "_vllm" if args.engine == "vllm" else ""
                result(name, value, "s", baseline, str(TARGET))
                if loads:
                    copy = statistics.median(memcpy_baseline(sd) for _ in range(args.reps))
                    load = statistics.median(loads)
                    print(
                        f"  vllm load per version {[round(x, 3) for x in loads]} s "
                        f"(writing its file {[round(x, 3) for x in writes]} s, "
                        f"vLLM's reload {[round(x, 3) for x in reloads]} s)",
                        flush=True,
                    )
                    result(f"weight_sync_vllm_load_{method}", load, "s", copy, "none")
        finally:
            fleet.close()
            stop_children([trainer])
    return 0


def vllm_load_times(log_path: Path | None) -> tuple[list[float], list[float]]:
    """Seconds of each version's load a vllm rollout server logged, in order: writing its
    file (0 for a file received in place or the update's own), and vLLM's reload."""
    import re

    text = log_path.read_text() if log_path is not None else ""
    pattern = r"loaded: ([0-9.]+) s writing .* MiB, ([0-9.]+) s in vLLM's reload"
    found = re.findall(pattern, text)
    return [float(a) for a, _ in found], [float(b) for _, b in found]


def _port() -> int:
    from areal_grpc.ports import free_port

    return free_port()


if __name__ == "__main__":
    raise SystemExit(main())
