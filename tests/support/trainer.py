"""Shared pieces of the trainer tests: random trajectories near the initial policy (the
``make_batch`` fixture), the trainer section they train with, and 2-rank FSDP2 groups forked
on loopback (gloo) to compare with one plain process."""

from __future__ import annotations

import multiprocessing as mp
import traceback

import torch
from areal_servers.trainer.algorithm import token_logprobs, trainable_mask
from areal_servers.trainer.engine import DistConfig, TrainerEngine, init_distributed

from areal_grpc.config import ModelConfig, OptimizerSettings, PPOSettings, TrainerConfig
from areal_grpc.model import load_model
from areal_grpc.ports import free_port

MODEL = "builtin:micro"
POLICY = ModelConfig(source=MODEL)


def random_batch(
    n_groups: int = 4, group_size: int = 2, seed: int = 0, length: int | None = None
) -> dict[str, torch.Tensor]:
    """Random prompts + completions with behaviour log-probs near the initial policy's.

    ``length``: every row that long, with a 3-token prompt (equal tokens per row).
    """
    gen = torch.Generator().manual_seed(seed)
    rows = n_groups * group_size
    lengths = torch.randint(6, 14, (rows,), generator=gen)
    prompts = torch.randint(2, 5, (rows,), generator=gen)
    if length is not None:
        lengths, prompts = torch.full((rows,), length), torch.full((rows,), 3)
    s = int(lengths.max())
    ids = torch.zeros(rows, s, dtype=torch.int64)
    attn = torch.zeros(rows, s, dtype=torch.bool)
    loss = torch.zeros(rows, s, dtype=torch.bool)
    for i in range(rows):
        n = int(lengths[i])
        ids[i, :n] = torch.randint(3, 384, (n,), generator=gen)
        attn[i, :n] = True
        loss[i, int(prompts[i]) : n] = True
    model = load_model(MODEL)
    with torch.no_grad():
        logp, _ = token_logprobs(model(input_ids=ids, attention_mask=attn).logits, ids)
    behave = (logp + 0.05 * torch.randn(rows, s, generator=gen)).clamp(max=0) * loss
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": loss,
        "logprobs": behave.float(),
        "versions": torch.where(loss, 0, -1),
        "rewards": torch.randint(0, 2, (rows,), generator=gen).float(),
        "group_index": torch.arange(n_groups).repeat_interleave(group_size),
    }


def rows_of(batch, rows, group_offset=0):
    """A shard holding ``rows`` of ``batch`` (group indices renumbered from 0)."""
    idx = torch.tensor(rows)
    out = {k: v[idx] for k, v in batch.items()}
    out["group_index"] = out["group_index"] - out["group_index"].min()
    return out


def config(
    fsdp: bool,
    max_tokens: int | None = None,
    dtype: str = "float32",
    lr: float = 1e-3,
    mixed_precision: str = "off",
) -> TrainerConfig:
    """The trainer section of these tests (max_tokens None: every shard in one micro-batch).

    Computing in ``dtype`` unless told (``mixed_precision`` "auto" is bf16 on a CPU with bf16
    units): these tests check fp32 arithmetic; bf16 compute has tests of its own.
    """
    return TrainerConfig(
        mixed_precision=mixed_precision,  # type: ignore[arg-type]
        dtype=dtype,
        fsdp=fsdp,
        device="cpu",
        ppo=PPOSettings(kl_ctl=0.0),
        max_tokens_per_mb=max_tokens or 1 << 30,
        optimizer=OptimizerSettings(lr=lr, warmup_steps=2, grad_clip=1.0),
    )


def params(engine: TrainerEngine) -> dict[str, torch.Tensor]:
    return engine.full_state_dict()


def max_diff(a, b) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _rank_main_cfg(
    rank: int, port: int, shards, out: mp.Queue, cfg: TrainerConfig, policy: ModelConfig
) -> None:
    try:
        torch.set_num_threads(1)
        init_distributed(DistConfig("gloo", "127.0.0.1", port, rank, 2, timeout_s=120))
        engine = TrainerEngine(cfg, policy)
        results = [engine.train_step(step_shards[rank]) for step_shards in shards]
        state = {k: v.numpy() for k, v in params(engine).items()}
        out.put((rank, results, state if rank == 0 else None))
        torch.distributed.destroy_process_group()
    except BaseException:
        out.put((rank, traceback.format_exc(), None))


def two_ranks(
    shards, cfg: TrainerConfig, policy: ModelConfig = POLICY
) -> dict[int, tuple[list, dict | None]]:
    """Trains ``shards[step][rank]`` on 2 spawned FSDP2 ranks (gloo on loopback): per rank, its
    step results and (rank 0) its final full parameters."""
    # spawn, not fork: the test process may hold threads (gRPC, an SDK's heartbeats) whose
    # locks a forked child inherits taken; in CI two forked ranks once spun for 37 minutes.
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main_cfg, args=(r, port, shards, out, cfg, policy))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(2):
            rank, results, state = out.get(timeout=120)
            assert not isinstance(results, str), results
            got[rank] = (results, state)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:  # a rank that hung is not left running
            if p.is_alive():
                p.kill()
    return got


def ppo_config(
    fsdp: bool, n_minibatches: int, epochs: int, max_tokens: int = 30, **ppo: object
) -> TrainerConfig:
    cfg = config(fsdp=fsdp, max_tokens=max_tokens, dtype="float64")
    cfg.ppo = PPOSettings(kl_ctl=0.0, n_minibatches=n_minibatches, epochs=epochs, **ppo)  # type: ignore[arg-type]
    return cfg


def with_exact_behaviour(engine_model, batch):
    """``batch`` with its behaviour log-probs set to the fp32 model's own, and the largest
    logit's magnitude: a trainer computing in fp32 finds no gap on it."""
    with torch.no_grad():
        logits = engine_model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits.float()
    exact, _ = token_logprobs(logits, batch["input_ids"])
    mask = trainable_mask(batch["loss_mask"], batch["attention_mask"])
    batch["versions"] = torch.where(mask, 0, -1)
    batch["logprobs"] = exact * batch["loss_mask"]
    return batch, float(logits.abs().max())
