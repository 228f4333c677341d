"""One trainer rank: model, FSDP2 sharding, optimizer and the GRPO / decoupled-PPO step.

Built from small composable pieces (torchtitan style):

* :func:`init_distributed` joins the process group (gloo on CPU, nccl on GPU) from explicit
  settings or torchrun's environment variables.
* :func:`build_model` builds the policy with :func:`areal_grpc.model.load_model` (same source
  and seed on every rank, hence the same initial weights as the rollout servers) and
  :func:`apply_fsdp` shards it with ``fully_shard`` per decoder layer and at the root.
* :func:`build_optimizer` / :func:`build_scheduler`: AdamW and a warm-up schedule.
* :class:`TrainerEngine` runs a step: proximal log-probs (no grad), advantages, the PPO
  update over token-budget micro-batches with gradient accumulation, clipping, optimizer
  step, version += 1; statistics reduced over ranks. It also saves/loads sharded checkpoints
  and exports the full model in Hugging Face format.

The same engine runs without FSDP and without a process group (``fsdp=False``, one process):
the plain reference a multi-rank step must equal.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from areal_servers.trainer.algorithm import (
    LossStats,
    compute_advantages,
    gap_stats,
    loglinear_prox_logp,
    logp_gap,
    masked_token_logprobs,
    ppo_loss,
    trainable_mask,
)
from areal_servers.trainer.microbatch import (
    Batch,
    MicroBatchSpec,
    plan_minibatches,
    split_microbatches,
)
from areal_servers.trainer.prefix_tree import Forest, attention_weight, pack_forest, sharing
from areal_servers.trainer.safe_checkpoint import SafeFileSystemReader, SafeLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from areal_grpc.config import LoraSettings, ModelConfig, OptimizerSettings, TrainerConfig
from areal_grpc.errors import PreconditionError
from areal_grpc.model import (
    adapter_names,
    decoder_layers,
    is_lora,
    load_model,
    load_tokenizer,
    masked_logits,
    save_pretrained,
)
from areal_grpc.paths import check_replaceable, remove_owned, replace_dir, write_marker
from areal_grpc.precision import bf16_compute

log = logging.getLogger(__name__)


def _has_dropout(model: torch.nn.Module) -> bool:
    """True when ``model`` drops anything in training mode (modules or attention dropout)."""
    config = getattr(model, "config", None)
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0.0:
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


# Progress callback: (phase, micro-batches done, micro-batches total).
Progress = Callable[[str, int, int], None]

CHECKPOINT_META = "trainer_meta.json"


@dataclass
class DistConfig:
    """Where the rank's process group rendezvouses; unset fields come from torchrun's env."""

    backend: str | None = None  # None: nccl when CUDA is available, else gloo
    master_addr: str | None = None
    master_port: int | None = None
    rank: int | None = None
    world_size: int | None = None
    # Collectives waiting longer than this fail instead of hanging forever.
    timeout_s: float = 600.0


# AdamW's moment decay rates and epsilon (torch's defaults, AReaL's too).
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


def init_distributed(cfg: DistConfig, device: torch.device | None = None) -> tuple[int, int]:
    """Joins (or reuses) the default process group; returns (rank, world size).

    With no backend configured, the group is nccl when this rank trains on ``device`` = a GPU
    (default: :func:`resolve_device`), else gloo.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank = cfg.rank if cfg.rank is not None else int(os.environ.get("RANK", "0"))
    world = cfg.world_size if cfg.world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    addr = cfg.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = cfg.master_port or int(os.environ.get("MASTER_PORT", "29500"))
    device = device if device is not None else resolve_device(None, rank)
    backend = cfg.backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl":
        if device.type != "cuda":
            raise ValueError(f"the nccl backend needs a CUDA device, this rank trains on {device}")
        torch.cuda.set_device(device)
    host = f"[{addr}]" if ":" in addr else addr
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
    )
    return rank, world


def resolve_device(device: str | None, rank: int = 0) -> torch.device:
    """The rank's device: ``device`` when given (bare "cuda": cuda:<local rank>), else
    cuda:<local rank> when CUDA is available, else CPU.

    The local rank is LOCAL_RANK (torchrun sets it), else ``rank``. A local rank without a GPU
    of its own is an error rather than a second rank on one GPU: NCCL refuses two ranks on
    one device, and FSDP cannot mix CPU and GPU ranks.
    """
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    if device:
        d = torch.device(device)
        if d.type != "cuda":
            return d
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available here")
        d = d if d.index is not None else torch.device("cuda", local)
    elif torch.cuda.is_available():
        d = torch.device("cuda", local)
    else:
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if d.index is not None and d.index >= count:
        raise ValueError(
            f"this rank would train on {d}, but only {count} GPU(s) are visible: run at most "
            f"one rank per GPU, or train on the CPU (--device cpu)"
        )
    return d


def build_model(
    source: str,
    seed: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    lora: LoraSettings | None = None,
) -> PreTrainedModel:
    """The policy on ``device`` (identical on every rank for a built-in source)."""
    model = load_model(source, seed=seed, dtype=dtype, lora=lora)
    # The eager path gives the same numbers for every padding width.
    model.config.use_cache = False
    return model.to(device)


def apply_fsdp(
    model: PreTrainedModel, mixed_precision: bool, device: torch.device | None = None
) -> PreTrainedModel:
    """``fully_shard`` every decoder layer, then the root (embeddings, norm, head).

    The mesh is on ``device``'s type (default: the model's): FSDP2's own default is the
    machine's accelerator, which would move a CPU rank's parameters onto a GPU.
    """
    device = device if device is not None else next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def build_optimizer(model: torch.nn.Module, cfg: OptimizerSettings) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (DTensors under FSDP)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=cfg.weight_decay
    )


def lr_factor(step: int, cfg: OptimizerSettings, total_steps: int | None) -> float:
    """Multiplier of the base learning rate for optimizer step ``step`` (0-based) of
    ``total_steps`` (None: no decay)."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant" or not total_steps:
        return 1.0
    span = max(total_steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    if cfg.lr_schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimizerSettings, total_steps: int | None
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR applying :func:`lr_factor`."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg, total_steps)
    )


def empty_batch() -> Batch:
    """A batch with no rows: a rank with an empty shard still joins the step."""
    return {
        "input_ids": torch.zeros(0, 0, dtype=torch.int64),
        "attention_mask": torch.zeros(0, 0, dtype=torch.bool),
        "loss_mask": torch.zeros(0, 0, dtype=torch.bool),
        "logprobs": torch.zeros(0, 0, dtype=torch.float32),
        "versions": torch.zeros(0, 0, dtype=torch.int64),
        "rewards": torch.zeros(0, dtype=torch.float32),
        "group_index": torch.zeros(0, dtype=torch.int64),
    }


@dataclass
class StepPlan:
    """A step's shard cut into mini- and micro-batches, with the global-batch counts its
    losses are normalised by (all ranks)."""

    # This rank's shard, on the device, with its trainable mask.
    batch: Batch
    total_tokens: float
    total_rows: float
    reward_sum: float
    staleness_sum: float
    # Sequences with a trained token.
    total_seqs: float
    # Per mini-batch: its micro-batches, each (rows of the shard it holds, the micro-batch).
    minis: list[list[tuple[list[int], Batch]]]
    # Per mini-batch: (trained tokens, sequences) over all ranks.
    mini_counts: list[tuple[float, float]]
    epochs: int
    # Prefix sharing: the nodes of the micro-batches' tries and their rows' tokens (0, 0 off).
    packed_nodes: int = 0
    packed_tokens: int = 0

    @property
    def microbatches(self) -> list[tuple[list[int], Batch]]:
        """Every micro-batch of the step, mini-batch by mini-batch."""
        return [pair for part in self.minis for pair in part]

    @property
    def updates(self) -> int:
        """Optimizer steps the step takes: mini-batches x epochs."""
        return len(self.minis) * self.epochs


@dataclass
class StepResult:
    """Statistics of one step, reduced over all ranks."""

    global_step: int
    policy_version: int
    loss: float
    grad_norm: float
    clip_fraction: float
    entropy: float
    importance_weight_mean: float
    importance_weight_max: float
    reward_mean: float
    trained_tokens: int
    sequences: int
    learning_rate: float
    elapsed_seconds: float
    microbatches: int
    extra: dict[str, float] = field(default_factory=dict)


class TrainerEngine:
    """A trainer rank's model, optimizer and step (call from one thread only)."""

    def __init__(
        self,
        cfg: TrainerConfig,
        policy: ModelConfig,
        *,
        device: str | None = None,
        total_steps: int | None = None,
        temperature: float = 1.0,
    ) -> None:
        """A rank of the run's ``trainer`` section training its ``model`` section's policy.

        Per process: ``device`` (None: ``cfg.device``), the run's ``total_steps`` (the
        schedule decays to it; None: no decay) and the sampling ``temperature`` log-probs are
        recomputed under (greedy, 0, has nothing to correct: pass 1). ``cfg.ppo``'s
        ``loss_constant_len`` must be resolved (> 0) when ``loss_agg`` is "constant".
        """
        self.cfg, self.policy = cfg, policy
        self.temperature = temperature
        self.microbatch = MicroBatchSpec(max_tokens_per_mb=cfg.max_tokens_per_mb)
        self.distributed = dist.is_initialized()
        if cfg.fsdp and not self.distributed:
            raise ValueError("fsdp=True needs a process group: call init_distributed first")
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        wanted = device or (None if cfg.device == "auto" else cfg.device)
        self.device = resolve_device(wanted, self.rank)
        self.backend = dist.get_backend() if self.distributed else "none"
        self.tokenizer = load_tokenizer(policy.source)
        self.pad_token_id = int(self.tokenizer.pad_token_id or 0)
        self.dtype = getattr(torch, cfg.dtype)
        self.model = build_model(policy.source, policy.seed, self.device, self.dtype, policy.lora)
        self.vocab_size = int(self.model.config.vocab_size)
        self.mixed_precision, why = bf16_compute(cfg.mixed_precision, cfg.dtype, self.device.type)
        self.prefix_sharing, sharing_why = sharing(cfg.prefix_sharing, self.model)
        self.microbatch.share_prefixes = self.prefix_sharing
        self._pair_cost = attention_weight(self.model)
        if cfg.fsdp:
            apply_fsdp(self.model, self.mixed_precision, self.device)
        if self.rank == 0:
            log.info(
                "trainer: %s compute, %s weights and optimizer state (%s); shared prefixes "
                "computed %s (%s)",
                "bfloat16" if self.mixed_precision else cfg.dtype,
                cfg.dtype,
                why,
                "once" if self.prefix_sharing else "per row",
                sharing_why,
            )
        # The step's micro-batches packed as tries (prefix sharing), by id of the micro-batch:
        # set by plan_step, dropped when the step ends.
        self._forests: dict[int, Forest] = {}
        self._autocast = self.mixed_precision and not cfg.fsdp
        self.ref_model: PreTrainedModel | None = None
        # The reference policy is the initial one: with LoRA that is the base model, the
        # policy with its adapters switched off, so no second copy is loaded.
        self._has_ref = cfg.ppo.kl_ctl != 0.0 or cfg.ppo.kl_loss_coef != 0.0
        # Dropout makes a training forward differ from the proximal (eval) one.
        self._has_dropout = _has_dropout(self.model)
        if self._has_ref and not is_lora(self.model):
            # The reference policy is the initial one; frozen, replicated (no gradients).
            self.ref_model = build_model(policy.source, policy.seed, self.device, self.dtype)
            self.ref_model.eval()
            self.ref_model.requires_grad_(False)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.optimizer, total_steps)
        self.version = 0
        self.global_step = 0

    # -- collectives (no-ops on one process) --------------------------------------------------

    def reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks."""
        if self.distributed and self.world_size > 1:
            x = x.clone()
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    def reduce_max_ints(self, values: list[int]) -> list[int]:
        """Element-wise max of small ints over ranks."""
        if not (self.distributed and self.world_size > 1):
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def barrier(self) -> None:
        """Waits for every rank."""
        if self.distributed and self.world_size > 1:
            dist.barrier()

    # -- the step -----------------------------------------------------------------------------

    def _forward_logprobs(
        self, model: torch.nn.Module, mb: Batch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of the trained tokens of ``mb`` (0 elsewhere), [B, S]."""

        forest = self._forests.get(id(mb))
        packed = forest.forward(model) if forest is not None else None

        def forward(keep: torch.Tensor) -> torch.Tensor:
            # Without FSDP (whose policy casts the parameters) bf16 compute is autocast's.
            with torch.autocast(self.device.type, torch.bfloat16, enabled=self._autocast):
                if packed is not None:
                    return packed(keep)
                return masked_logits(model, mb["input_ids"], mb["attention_mask"], keep)

        return masked_token_logprobs(forward, mb["input_ids"], mb["train_mask"], self.temperature)

    def _reference_logprobs(self, mb: Batch) -> torch.Tensor:
        """The reference (initial) policy's log-probs of the trained tokens of ``mb``."""
        if self.ref_model is not None:
            return self._forward_logprobs(self.ref_model, mb)[0]
        with self.model.disable_adapter():  # type: ignore[operator]
            return self._forward_logprobs(self.model, mb)[0]

    def train_step(self, batch: Batch | None, progress: Progress | None = None) -> StepResult:
        """One PPO step on this rank's shard (``None``: empty shard). Collective.

        The phases, each a method of its own: :meth:`plan_step` (global counts, mini- and
        micro-batches), :meth:`proximal_logprobs` (and the reference ones), :meth:`advantages`,
        then :meth:`update` (one optimizer step per mini-batch and epoch).
        """
        start = time.perf_counter()
        report = progress or (lambda phase, done, total: None)
        try:
            plan = self.plan_step(batch)
            report("received", 0, len(plan.microbatches))
            prox_mode = self.proximal_mode(plan)
            self.proximal_logprobs(plan, prox_mode, report)
            adv_stats = self.advantages(plan)
            lr = float(self.scheduler.get_last_lr()[0])
            stats, approx, grad_norm = self.update(plan, prox_mode, report)
        finally:
            self._forests.clear()
        return self._step_result(plan, stats, approx, grad_norm, lr, adv_stats, prox_mode, start)

    def plan_step(self, batch: Batch | None) -> StepPlan:
        """This rank's shard on the device with its trainable mask, the counts of the global
        batch (all-reduced), and its mini- and micro-batches. Collective."""
        cfg = self.cfg.ppo
        batch = empty_batch() if batch is None else dict(batch)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        if "group_index" not in batch:
            batch["group_index"] = torch.zeros_like(batch["rewards"], dtype=torch.int64)
        batch["train_mask"] = trainable_mask(batch["loss_mask"], batch["attention_mask"])
        # Trained tokens per row: the token counts, the sequences that have any, and the
        # mini-batch split all follow from it.
        row_tokens = batch["train_mask"].sum(dim=1)
        totals = self.reduce_sum(
            torch.tensor(
                [
                    float(row_tokens.sum()),
                    float(batch["rewards"].shape[0]),
                    float(batch["rewards"].double().sum()),
                    # Staleness of trained tokens: versions behind the weights being trained.
                    float(((self.version - batch["versions"]) * batch["train_mask"]).sum()),
                    # Sequences with a trained token (what a per-sequence loss averages over).
                    float((row_tokens > 0).sum()),
                ],
                dtype=torch.float64,
                device=self.device,
            )
        )
        total_tokens, total_rows, reward_sum, staleness_sum, total_seqs = (
            float(v) for v in totals.tolist()
        )
        if total_rows == 0:
            raise ValueError("the global batch has no trajectories")
        # PPO mini-batches: token-balanced row slices, each cut into micro-batches (the
        # micro-batch count is agreed across ranks per mini-batch, so collectives pair up).
        n_minis = max(1, cfg.n_minibatches)
        mini_rows: list[list[int] | None] = [None]
        if n_minis > 1:
            mini_rows = list(plan_minibatches(row_tokens.tolist(), n_minis))
        minis: list[list[tuple[list[int], Batch]]] = []
        for rows in mini_rows:
            part = split_microbatches(
                batch, self.microbatch, self.reduce_max_ints, self.pad_token_id, rows=rows
            )
            for k, (_, mb) in enumerate(part):
                mb.setdefault("train_mask", torch.zeros_like(mb["loss_mask"]))
                part[k] = (part[k][0], {key: v.to(self.device) for key, v in mb.items()})
            minis.append(part)
        packed = [0, 0]  # nodes computed, tokens unshared
        self._forests.clear()
        if self.prefix_sharing:
            for part in minis:
                for rows, mb in part:
                    if not rows:  # a dummy micro-batch
                        continue
                    # None where packing would not pay (see pack_forest): the rows as they are.
                    forest = pack_forest(
                        mb["input_ids"],
                        mb["attention_mask"],
                        mb.get("group_index"),
                        self.pad_token_id,
                        self._pair_cost,
                    )
                    tokens = int(mb["attention_mask"].sum())
                    if forest is not None:
                        self._forests[id(mb)] = forest
                    packed[0] += forest.nodes if forest is not None else tokens
                    packed[1] += tokens
        # Each update's loss is normalised over its own mini-batch (all ranks): its trained
        # tokens and the sequences that have any.
        mini_counts = [(total_tokens, total_seqs)]
        if n_minis > 1:
            local = [
                [float(row_tokens[r].sum()), float((row_tokens[r] > 0).sum())]
                for r in (
                    torch.as_tensor(picked or [], dtype=torch.int64, device=row_tokens.device)
                    for picked in mini_rows
                )
            ]
            sums = self.reduce_sum(torch.tensor(local, dtype=torch.float64, device=self.device))
            mini_counts = [(float(t), float(q)) for t, q in sums.tolist()]
        return StepPlan(
            batch=batch,
            total_tokens=total_tokens,
            total_rows=total_rows,
            reward_sum=reward_sum,
            staleness_sum=staleness_sum,
            total_seqs=total_seqs,
            minis=minis,
            mini_counts=mini_counts,
            epochs=max(1, cfg.epochs),
            packed_nodes=packed[0],
            packed_tokens=packed[1],
        )

    def proximal_mode(self, plan: StepPlan) -> str:
        """How this step has its proximal log-probs: "exact" (the training forward's own),
        or the configured prox_logp_method.

        The proximal policy is the weights before the step's first update: with a single
        update every micro-batch's training forward runs with exactly those weights, so
        without dropout its detached log-probs *are* the proximal ones and no extra forward
        is needed (a quarter of the step's compute). Later updates of several run on weights
        already moved: then the proximal log-probs are recomputed ("recompute", "metrics") or
        approximated from the training forward ("loglinear").
        """
        if not self._has_dropout and plan.updates == 1:
            return "exact"
        return self.cfg.ppo.prox_logp_method

    def proximal_logprobs(
        self, plan: StepPlan, prox_mode: str, report: Progress | None = None
    ) -> None:
        """Each micro-batch's ``prox_logp`` (when ``prox_mode`` recomputes them) and
        ``ref_logp`` (with a reference policy), from the current weights without grad."""
        recompute = prox_mode in ("recompute", "metrics")
        if not (recompute or self._has_ref):
            return
        mbs = plan.microbatches
        self.model.eval()
        with torch.no_grad():
            for k, (_, mb) in enumerate(mbs):
                if recompute:
                    mb["prox_logp"] = self._forward_logprobs(self.model, mb)[0]
                if self._has_ref:
                    mb["ref_logp"] = self._reference_logprobs(mb)
                if report is not None:
                    report("logprobs", k + 1, len(mbs))

    def advantages(self, plan: StepPlan) -> list[float]:
        """Advantages of the whole shard (batch-level statistics all-reduced), handed to each
        micro-batch as ``advantages``; returns the global (sum, sum of squares) over trained
        tokens. Collective."""
        batch, mbs = plan.batch, plan.microbatches
        ref_full = None
        if self._has_ref:
            ref_full = torch.zeros_like(batch["logprobs"])
            for rows_k, mb in mbs:
                if rows_k:
                    idx = torch.tensor(rows_k, device=self.device)
                    ref_full[idx, : mb["ref_logp"].shape[1]] = mb["ref_logp"]
        adv_full = compute_advantages(
            batch["rewards"],
            batch["train_mask"],
            self.cfg.ppo,
            group_index=batch["group_index"],
            behave_logp=batch["logprobs"],
            ref_logp=ref_full,
            reduce=self.reduce_sum,
        )
        adv_stats = self.reduce_sum(
            torch.stack(
                [
                    (adv_full.double() * batch["train_mask"]).sum(),
                    (adv_full.double().square() * batch["train_mask"]).sum(),
                ]
            )
        ).tolist()
        for rows_k, mb in mbs:
            if rows_k:
                idx = torch.tensor(rows_k, device=self.device)
                mb["advantages"] = adv_full[idx, : mb["input_ids"].shape[1]]
            else:
                mb["advantages"] = torch.zeros_like(mb["logprobs"])
        return adv_stats

    def update(
        self, plan: StepPlan, prox_mode: str, report: Progress | None = None
    ) -> tuple[LossStats, torch.Tensor, float]:
        """The PPO updates: one optimizer step per mini-batch and epoch, gradients accumulated
        over the mini-batch's micro-batches; the version advances once. Returns this rank's
        loss stats, loglinear's summed error ("metrics"), and the mean gradient norm."""
        self.model.train()
        # FSDP averages gradients over ranks; each rank's loss is already divided by the
        # global token count, so scaling by the world size turns the average into the sum.
        scale = float(self.world_size) if self.cfg.fsdp else 1.0
        stats = LossStats()
        # "metrics": |loglinear - recomputed| summed over trained tokens, in log-probs and in
        # behaviour importance weights exp(prox - behaviour).
        approx = torch.zeros(2, dtype=torch.float64, device=self.device)
        grad_norms: list[float] = []
        done, total = 0, len(plan.microbatches) * plan.epochs

        def trained_one() -> None:
            nonlocal done
            done += 1
            if report is not None:
                report("update", done, total)

        for epoch in range(plan.epochs):
            for m, (part, counts) in enumerate(zip(plan.minis, plan.mini_counts, strict=True)):
                # Until the first optimizer step the weights are the ones that sampled the
                # step's fresh tokens: where the train/rollout gap can be read off exactly.
                first = epoch == 0 and m == 0
                grad_norms.append(
                    self._update(part, counts, prox_mode, scale, stats, approx, trained_one, first)
                )
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self.global_step += 1
        return stats, approx, sum(grad_norms) / plan.updates

    def _step_result(
        self,
        plan: StepPlan,
        stats: LossStats,
        approx: torch.Tensor,
        grad_norm: float,
        lr: float,
        adv_stats: list[float],
        prox_mode: str,
        start: float,
    ) -> StepResult:
        """The step's global stats (all-reduced). Collective."""
        sums = self.reduce_sum(
            torch.tensor(
                [
                    stats.loss,
                    stats.clipped_tokens,
                    stats.imp_weight_sum,
                    stats.entropy_sum,
                    stats.tokens,
                    stats.capped_tokens,
                    stats.kl_sum,
                    stats.gap_abs_sum,
                    stats.gap_kl_sum,
                    stats.gap_tokens,
                    plan.packed_nodes,
                    plan.packed_tokens,
                ],
                dtype=torch.float64,
                device=self.device,
            )
        ).tolist()
        # Tokens computed / tokens unshared, over the step's micro-batches on every rank.
        shared = {"prefix_sharing_ratio": sums[10] / sums[11]} if sums[11] else {}
        imp_max = self._reduce_max_float(stats.imp_weight_max)
        gap_max = self._reduce_max_float(stats.gap_abs_max)
        tokens = sums[4]
        kept = tokens - sums[5]
        kl = {"kl_loss_mean": sums[6] / kept if kept else 0.0} if self.cfg.ppo.kl_loss_coef else {}
        return StepResult(
            global_step=self.global_step - 1,
            policy_version=self.version,
            # Mean over the updates; each token is trained once per epoch.
            loss=sums[0] / plan.updates,
            grad_norm=float(grad_norm),
            clip_fraction=sums[1] / tokens if tokens else 0.0,
            entropy=sums[3] / tokens if tokens else 0.0,
            importance_weight_mean=sums[2] / kept if kept else 0.0,
            importance_weight_max=imp_max,
            reward_mean=plan.reward_sum / plan.total_rows,
            trained_tokens=round(tokens / plan.epochs),
            sequences=int(plan.total_rows),
            learning_rate=lr,
            elapsed_seconds=time.perf_counter() - start,
            microbatches=len(plan.microbatches),
            extra=self._extra_stats(sums[5], plan.staleness_sum, adv_stats, plan.total_tokens)
            | self._approx_stats(prox_mode, approx, tokens)
            | gap_stats(sums[7], gap_max, sums[8], sums[9])
            | kl
            | shared,
        )

    def _update(
        self,
        part: list[tuple[list[int], Batch]],
        counts: tuple[float, float],
        prox_mode: str,
        scale: float,
        stats: LossStats,
        approx: torch.Tensor,
        trained_one: Callable[[], None],
        first: bool = False,
    ) -> float:
        """One optimizer step over the micro-batches of one mini-batch; its gradient norm.
        ``first``: no optimizer step of this train step came before it."""
        cfg = self.cfg.ppo
        self.optimizer.zero_grad(set_to_none=True)
        for k, (_, mb) in enumerate(part):
            if self.cfg.fsdp:
                # Reduce-scatter once, after the last micro-batch.
                self.model.set_requires_gradient_sync(k == len(part) - 1)  # type: ignore[operator]
            logp, entropy = self._forward_logprobs(self.model, mb)
            loss, mb_stats = ppo_loss(
                logp,
                self._prox_logp(mb, logp.detach(), prox_mode, approx),
                mb["logprobs"],
                mb["advantages"],
                mb["train_mask"],
                cfg,
                counts[0],
                entropy,
                total_seqs=counts[1],
                ref_logp=mb.get("ref_logp"),
            )
            (loss * scale).backward()
            stats.add(mb_stats)
            stats.add(self._gap(mb, logp, prox_mode, first))
            trained_one()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.grad is not None], self.cfg.optimizer.grad_clip
        )
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        return float(grad_norm)

    def _gap(self, mb: Batch, logp: torch.Tensor, prox_mode: str, first: bool) -> LossStats:
        """The train/rollout log-prob gap (algorithm.logp_gap) on the micro-batch's trained
        tokens that the weights being trained sampled (version == this step's): recomputed
        log-probs when the step has them, else this forward's while it is the first update."""
        if prox_mode in ("recompute", "metrics"):
            trainer = mb["prox_logp"]
        elif first:
            trainer = logp.detach()
        else:
            return LossStats()
        fresh = mb["train_mask"].bool() & (mb["versions"] == self.version)
        return logp_gap(trainer, mb["logprobs"], fresh)

    def _prox_logp(
        self, mb: Batch, current: torch.Tensor, prox_mode: str, approx: torch.Tensor
    ) -> torch.Tensor:
        """The proximal log-probs of a micro-batch under ``prox_mode`` (see train_step)."""
        if prox_mode == "exact":
            return current
        if prox_mode == "recompute":
            return mb["prox_logp"]
        guess = loglinear_prox_logp(mb["logprobs"], current, mb["versions"], self.version)
        if prox_mode == "loglinear":
            return guess
        # "metrics": train on the recomputed ones, measure how far the guess was.
        prox, mask = mb["prox_logp"], mb["train_mask"]
        behave = mb["logprobs"].to(prox.dtype)
        with torch.no_grad():
            approx[0] += ((guess - prox).abs().double() * mask).sum()
            approx[1] += (
                ((guess - behave).exp() - (prox - behave).exp()).abs().double() * mask
            ).sum()
        return prox

    @staticmethod
    def _extra_stats(
        capped: float, staleness_sum: float, adv_sums: list[float], tokens: float
    ) -> dict[str, float]:
        n = max(tokens, 1.0)
        adv_mean = adv_sums[0] / n
        return {
            "capped_tokens": capped,
            "staleness_mean": staleness_sum / n,
            "advantage_mean": adv_mean,
            "advantage_std": math.sqrt(max(adv_sums[1] / n - adv_mean * adv_mean, 0.0)),
        }

    def _approx_stats(
        self, prox_mode: str, approx: torch.Tensor, tokens: float
    ) -> dict[str, float]:
        """Mean errors of the loglinear approximation (only under "metrics")."""
        if prox_mode != "metrics":
            return {}
        abs_err, weight_err = self.reduce_sum(approx).tolist()
        n = max(tokens, 1.0)
        return {"prox_approx_abs_error": abs_err / n, "prox_approx_weight_error": weight_err / n}

    def _reduce_max_float(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        if self.distributed and self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0])

    # -- parameters, checkpoints, export ------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) model state dict on CPU; collective, complete on every rank."""
        if not self.cfg.fsdp:
            return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().cpu() for k, v in full.items()}

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """A LoRA model's trained parameters, full (unsharded) on CPU; collective, complete on
        every rank."""
        trained = adapter_names(self.model)
        return {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
            for name, p in self.model.named_parameters()
            if name in trained
        }

    @staticmethod
    def checkpoint_tmp(final: Path) -> Path:
        """Where the ranks write a checkpoint before it is renamed to ``final`` (same on all)."""
        return final.with_name(f".{final.name}.tmp")

    @classmethod
    def check_checkpoint_target(cls, final: Path) -> None:
        """PreconditionError unless ``final`` and its temporary directory may be (re)written.

        Only directories the project wrote are replaced (see :mod:`areal_grpc.paths`).
        """
        check_replaceable(final)
        check_replaceable(cls.checkpoint_tmp(final))

    def save_checkpoint(self, path: str, global_step: int | None = None) -> None:
        """Sharded DCP checkpoint of model, optimizer, scheduler, version and step (collective).

        Every rank writes its shard into ``<path>.tmp``; after a barrier rank 0 adds the
        metadata and renames the directory into place, so ``path`` is either the old
        checkpoint or the complete new one.
        """
        final = Path(path)
        tmp = self.checkpoint_tmp(final)
        # Every rank has checked the target (the service does, before the call); none may see
        # rank 0's writes below while it checks, or it would find a half-made directory and
        # refuse alone, leaving the others in the save's collectives.
        self.barrier()
        failure: Exception | None = None
        if self.rank == 0:
            try:
                # Checked again for direct callers: a leftover temporary directory is removed
                # only if it is ours.
                self.check_checkpoint_target(final)
                remove_owned(tmp)
                tmp.mkdir(parents=True)
                write_marker(tmp, "checkpoint")
            except Exception as exc:
                failure = exc
        # Only rank 0 writes the directories: its verdict reaches every rank before any of
        # them waits in a collective of the save.
        refused = self.reduce_sum(torch.tensor([float(failure is not None)], device=self.device))
        if failure is not None:
            raise failure
        if float(refused[0]) > 0:
            raise PreconditionError(
                f"path: rank 0 could not prepare the checkpoint {str(final)!r} (see its error)"
            )
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=str(tmp),
            no_dist=not self.distributed,
        )
        self.barrier()
        if self.rank == 0:
            meta = {
                "policy_version": self.version,
                # The caller's step number (default: the last step taken, -1 if none) and the
                # engine's count of completed steps are kept apart.
                "global_step": self.global_step - 1 if global_step is None else global_step,
                "steps_completed": self.global_step,
                "scheduler": self.scheduler.state_dict(),
                "world_size": self.world_size,
                "model": self.policy.source,
            }
            (tmp / CHECKPOINT_META).write_text(json.dumps(meta))
            replace_dir(tmp, final)
        self.barrier()

    def load_checkpoint(self, path: str, min_version: int = 0) -> tuple[int, int]:
        """Restores a :meth:`save_checkpoint` directory; returns (its global step, version).

        ``min_version`` raises the restored version label (the weights stay the checkpoint's):
        a restarted group must publish versions its rollout servers have not served yet.
        """
        meta_file = Path(path) / CHECKPOINT_META
        if not meta_file.is_file():
            raise FileNotFoundError(f"{path} is not a trainer checkpoint (no {CHECKPOINT_META})")
        meta = json.loads(meta_file.read_text())
        # Everything the restore needs is checked before any state changes, so a bad
        # checkpoint leaves the rank exactly as it was.
        missing = [
            k
            for k in ("scheduler", "policy_version", "steps_completed", "global_step")
            if k not in meta
        ]
        if missing:
            raise ValueError(f"{meta_file} lacks {missing}")
        reader = SafeFileSystemReader(path)
        # Read here too, not only inside dcp.load: some torch releases catch the reader's
        # error there and fail later with only "metadata is None".
        reader.read_metadata()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(
            state,
            storage_reader=reader,
            planner=SafeLoadPlanner(),
            no_dist=not self.distributed,
        )
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.scheduler.load_state_dict(meta["scheduler"])
        self.version = max(int(meta["policy_version"]), min_version)
        self.global_step = int(meta["steps_completed"])
        self.barrier()
        return int(meta["global_step"]), self.version

    def export_hf(self, path: str) -> None:
        """Writes the model in Hugging Face format (collective; rank 0 writes).

        The gathered weights go into a fresh unsharded model of the same source so that
        ``save_pretrained`` sees ordinary tensors; the directory appears atomically. With
        LoRA it holds the adapter (peft's adapter_config.json and adapter_model.safetensors,
        loadable over the base model) and, with ``lora.merged_export``, the merged full model
        in ``merged/``.
        """
        lora = is_lora(self.model)
        # A LoRA model's frozen base is the source's own weights, which load_model reads again
        # below: only the adapters are gathered (megabytes, not the whole model per rank).
        full = self.adapter_state_dict() if lora else self.full_state_dict()
        if self.rank == 0:
            final = Path(path)
            check_replaceable(final)
            tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
            plain = load_model(self.policy.source, seed=self.policy.seed, lora=self.policy.lora)
            loaded = plain.load_state_dict({k: v.float() for k, v in full.items()}, strict=not lora)
            if loaded.unexpected_keys:  # an adapter the fresh model lacks: never silently
                raise RuntimeError(f"export: the model has no {loaded.unexpected_keys}")
            try:
                save_pretrained(plain, self.tokenizer, tmp)
                if is_lora(plain) and self.policy.lora.merged_export:
                    merged = plain.merge_and_unload()  # type: ignore[operator]
                    save_pretrained(merged, self.tokenizer, tmp / "merged")
                write_marker(tmp, "export")
                replace_dir(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        self.barrier()
