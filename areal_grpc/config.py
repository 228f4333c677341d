"""Typed configuration of a whole run: dataclasses, a YAML file, dotted ``key=value`` overrides.

Precedence: dataclass defaults < YAML file < overrides (applied left to right, the last wins).
Every error is a :class:`~areal_grpc.errors.FieldError` naming the dotted key, e.g.
``trainer.lr: ...``, whether the key is unknown, the value has the wrong type or it is out of
range.

The defaults are the built-in run: the small built-in model, the built-in ``first3`` task, one
rollout server, two trainer ranks, and GRPO settings from measurements of what a tiny
random-init model learns on a CPU (32 prompts x 8 samples,
temperature 1, lr 1e-3, 1 PPO epoch, no KL, clip 0.2, grad clip 1, eval every 25 steps).

Example::

    cfg = load_config("run.yaml", ["trainer.lr=5e-4", "staleness.max_staleness=0"])
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from areal_grpc.errors import FieldError

__all__ = [
    "ALGORITHMS",
    "EXTERNAL_TASK",
    "NORM_LEVELS",
    "WEIGHT_SYNC_METHODS",
    "CheckpointConfig",
    "DataConfig",
    "EvalConfig",
    "LauncherConfig",
    "LoraSettings",
    "ModelConfig",
    "NormSettings",
    "OutputConfig",
    "PPOSettings",
    "RolloutConfig",
    "RunConfig",
    "SamplingSettings",
    "SecurityConfig",
    "StalenessConfig",
    "TrainerConfig",
    "VllmSettings",
    "WeightSyncConfig",
    "load_config",
    "to_json",
    "to_yaml",
    "validate_config",
]

ENGINES = ("hf", "vllm", "sglang")
# Model dtypes the vllm engine loads.
VLLM_DTYPES = ("float32", "bfloat16", "float16")
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
# Where a normalisation's mean or std is taken: per trajectory group, over the global batch,
# or not at all.
NORM_LEVELS = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")
# How far the proximal policy may be from the behaviour one (trainer.ppo.rejection.metric);
# "none" applies no behaviour weight at all.
REJECTION_METRICS = ("ratio", "kl_k1", "kl_k2", "kl_k3", "binary_kl", "none")
REJECTION_AGGS = ("mean", "sum", "max")
# data.task of a run that trains only on what producers submit.
EXTERNAL_TASK = "external"
PROX_LOGP_METHODS = ("recompute", "loglinear", "metrics")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean", "constant")

# Named algorithms as settings of the same objective: what ``algorithm: <name>`` sets, below
# whatever the file and the overrides set (so each of these keys can still be changed).
# Meanings as in AReaL's docs/en/algorithms/grpo_series.md.
ALGORITHMS: dict[str, dict[str, Any]] = {
    # Group-normalised rewards, token-level ratios, token mean over the batch.
    "grpo": {},
    # No std in the baseline; the token sum over a constant (max_new_tokens x sequences).
    "dr_grpo": {"trainer": {"ppo": {"reward_norm": {"std_level": "none"}, "loss_agg": "constant"}}},
    # Leave-one-out group mean as the baseline, no std.
    "rloo": {"trainer": {"ppo": {"reward_norm": {"std_level": "none", "mean_leave1out": True}}}},
    # Group mean, batch std; token mean.
    "liteppo": {"trainer": {"ppo": {"reward_norm": {"std_level": "batch"}}}},
    # PPO without a critic: no per-group baseline, advantages normalised over the global
    # batch (AReaL's PPO settings, the value model left out).
    "ppo_no_critic": {
        "trainer": {
            "ppo": {
                "reward_norm": {"mean_level": "none", "std_level": "none"},
                "adv_norm": {"mean_level": "batch", "std_level": "batch"},
            }
        }
    },
    # REINFORCE++: the same, with a small k1 KL-to-reference penalty in the token rewards
    # (summed from each token on); it loads a frozen reference model on every trainer rank.
    "reinforce_pp": {
        "trainer": {
            "ppo": {
                "reward_norm": {"mean_level": "none", "std_level": "none"},
                "adv_norm": {"mean_level": "batch", "std_level": "batch"},
                "kl_ctl": 0.001,
                "kl_estimator": "k1",
            }
        }
    },
    # Clip-higher, dynamic sampling (groups whose rewards are all equal are dropped at the
    # rollout server and their places filled by new prompts), token mean. The overlong
    # penalty is trainer.ppo.overlong_* (it needs the length budget).
    "dapo": {
        "trainer": {"ppo": {"eps_clip": 0.2, "eps_clip_higher": 0.28}},
        "rollout": {"workflow_params": {"accept": "nonuniform"}},
    },
    # IcePop: tokens whose behaviour ratio left [0.5, 5] are dropped from the loss.
    "icepop": {"trainer": {"ppo": {"rejection": {"metric": "ratio", "lower": 0.5, "upper": 5.0}}}},
    # KPop: tokens whose two-way Bernoulli KL between the proximal and behaviour
    # probabilities exceeds 2 are dropped.
    "kpop": {"trainer": {"ppo": {"rejection": {"metric": "binary_kl", "upper": 2.0}}}},
    # One importance ratio per sequence, with the paper's narrow clip range.
    "gspo": {
        "trainer": {
            "ppo": {
                "importance_sampling_level": "sequence",
                "eps_clip": 3e-4,
                "eps_clip_higher": 4e-4,
            }
        }
    },
}
DTYPES = ("float32", "float64")
MIXED_PRECISION = ("auto", "on", "off")
REJECTION_ACTIONS = ("mask", "clamp")
LR_SCHEDULES = ("constant", "linear", "cosine")
WEIGHT_SYNC_METHODS = ("distributed", "shared_memory", "socket", "stream", "disk")
LAUNCH_MODES = ("local", "attach", "ray", "slurm")
RAY_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass
class LoraSettings:
    """LoRA adapters (through peft) on the policy: only they train, and only they travel in a
    weight update; the base weights stay frozen in every process. ``rank`` 0: no LoRA, the
    whole model trains."""

    rank: int = 0
    alpha: float = 16.0
    # Module names (or suffixes) that get adapters; "all-linear" is every linear layer but
    # the output head (peft's meaning).
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    dropout: float = 0.0
    # Exports hold the adapter (adapter_config.json + adapter_model.safetensors, for peft);
    # with this set, also the merged full model in <export>/merged.
    merged_export: bool = False


@dataclass
class ModelConfig:
    """Which policy to train."""

    # "builtin:micro" (0.16M params), "builtin:tiny" (about 1M), or a local HF checkpoint dir.
    # micro is the default because the measured runs that learn within a minute on one CPU
    # core used a model of that size; larger ones learned several times slower.
    source: str = "builtin:micro"
    # Seeds model init, the dataloader order and sampling.
    seed: int = 0
    lora: LoraSettings = field(default_factory=LoraSettings)


@dataclass
class DataConfig:
    """The prompts."""

    # A built-in task (areal_grpc.tasks: "first3", "echo"), a task whose items come from path,
    # or "external": no prompts of the run's own, it trains only on the groups producers
    # submit (the gateway's sessions, SubmitTrajectories).
    task: str = "first3"
    # Train items (JSONL or Parquet, read with the datasets library) for tasks that are not
    # built in (e.g. "gsm8k"); None for built-ins.
    path: str | None = None
    # Held-out items for eval (same formats); None: the first 10% of path is held out.
    eval_path: str | None = None
    shuffle: bool = True


@dataclass
class SamplingSettings:
    """Sampling of rollouts."""

    temperature: float = 1.0
    top_p: float = 1.0
    # 0: no top-k limit.
    top_k: int = 0
    # None: the task's own answer length (2 tokens for the built-in tasks).
    max_new_tokens: int | None = None


@dataclass
class VllmSettings:
    """The vllm engine's own settings (``rollout.engine: vllm``), per rollout server.

    The defaults start on 2 CPU cores and 24 GiB: fp32 (this CPU has no fast bf16), a 2 GiB
    KV cache, eager mode.
    """

    # KV cache per server, GiB (host memory on the CPU backend, GPU memory on a GPU).
    kv_cache_gib: float = 2.0
    # Sequences decoded at once at most (vLLM's max_num_seqs).
    max_num_seqs: int = 64
    # Longest prompt + output; 0: the model's context, capped at 4096 (the KV cache must
    # hold one sequence of this length).
    max_model_len: int = 0
    dtype: str = "float32"
    # CPU cores vLLM keeps for its own scheduler process (None: vLLM's default, one); the
    # rest run its model worker. 0 gives the worker every core.
    reserved_cpus: int | None = None
    # Seconds the engine may take to start (imports, its processes, the model load).
    start_timeout_s: float = 600.0
    # vLLM's engine process is asked whether it is alive this often; one that has died or
    # does not answer within health_timeout_s takes the server down, so its launcher
    # replaces it.
    health_interval_s: float = 5.0
    health_timeout_s: float = 60.0
    # Seconds vLLM's model worker busy-waits for its next message before it sleeps (vLLM
    # itself spins 1 s after every message, a core's worth of CPU that the trainer sharing
    # these cores lost: on 2 cores its steps took 19.5 s instead of 14.9 s). A step of a
    # running batch comes sooner than this, so generation does not wait on a wake-up.
    idle_spin_s: float = 0.05


@dataclass
class RolloutConfig:
    """The rollout (inference) servers and what they run."""

    num_servers: int = 1
    engine: str = "hf"
    device: str = "auto"
    # One SGLang base URL per rollout server when engine is "sglang" in local mode.
    sglang_urls: list[str] = field(default_factory=list)
    # A registered workflow name or an import path "pkg.mod:name".
    workflow: str = "rlvr"
    # A reward in areal_grpc.rewards.REWARD_FNS ("task": the task's own) or an import path.
    reward: str = "task"
    # Prompts through the model's chat template: "auto" when the tokenizer has one, "on"
    # (an error without one), "off" (raw text).
    chat_template: str = "auto"
    # The system message of chat prompts (None: the template's own default, if any).
    system_prompt: str | None = None
    # Torch CPU threads of each rollout server.
    torch_threads: int = 1
    # Requests each hf server decodes at once at most (rows of its batch).
    max_running_requests: int = 256
    # Default parameters of the workflow (a request's own params override them).
    workflow_params: dict[str, Any] = field(default_factory=dict)
    # KV cache budget of each hf server in token slots (rows x the longest row's prompt +
    # max_new_tokens); requests wait until they fit; None: unbounded but for 256 rows.
    max_batch_tokens: int | None = None
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    vllm: VllmSettings = field(default_factory=VllmSettings)
    # Prompts generating at once over all servers; None: staleness.batch_size (AReaL's default).
    max_concurrent_rollouts: int | None = None
    # A server holding a task longer than this is taken as stalled: out of rotation, its work
    # re-queued elsewhere. Generous: one episode of a long workflow may take minutes.
    episode_timeout_s: float = 1800.0
    # Liveness check of every server in rotation: a server whose health check fails (or does
    # not answer within health_timeout_s) is treated like a stalled one.
    health_interval_s: float = 5.0
    health_timeout_s: float = 5.0
    # Restarts of rollout servers that died (their process is gone, or they stayed out of
    # rotation too long), over the whole run and all servers; local and Ray launchers only.
    max_restarts: int = 3
    # A launcher's server that still runs but has been out of rotation this long is replaced
    # (stopped, a fresh one started) instead of waited for; one whose process is gone at once.
    replace_after_s: float = 60.0
    # With no server left in rotation for this long, the run fails instead of waiting forever.
    no_server_timeout_s: float = 300.0


@dataclass
class NormSettings:
    """Mean/std normalisation of rewards or advantages (AReaL's NormConfig, same meaning).

    x -> (x - mean) / (std + eps), each statistic over ``*_level``: GRPO is group/group,
    Dr.GRPO group/none, RLOO group/none with ``mean_leave1out``, LitePPO group/batch,
    REINFORCE++ batch/batch; none/none leaves the values as they are.
    """

    mean_level: str = "group"
    std_level: str = "group"
    # The mean of the *other* members of the group (RLOO's baseline).
    mean_leave1out: bool = False
    # n - 1 in the std's denominator.
    std_unbiased: bool = True
    eps: float = 1e-5


@dataclass
class RejectionSettings:
    """The behaviour importance weight exp(prox - behaviour) and the tokens it rejects
    (AReaL's rejection_sampling): ``metric`` per token ("ratio" of the probabilities, Schulman's
    KL estimators "kl_k1".."kl_k3" of it, or KPop's "binary_kl"), judged per token or per
    sequence (``level``, with ``agg`` of the sequence's values), outside ``[lower, upper]``
    masked or (ratio only) clamped into it. The default is the cap exp(prox - behaviour) <= 5;
    IcePop adds lower 0.5; metric "none": no weight.
    """

    metric: str = "ratio"
    level: str = "token"
    action: str = "mask"
    agg: str = "mean"
    lower: float | None = None
    upper: float = 5.0


@dataclass
class PPOSettings:
    """GRPO / decoupled-PPO actor settings (AReaL's defaults where it has one)."""

    eps_clip: float = 0.2
    # Upper clip (clip-higher); None: eps_clip.
    eps_clip_higher: float | None = None
    # Dual-clip constant (> 1); None disables it.
    c_clip: float | None = None
    # Which tokens the decoupled loss trusts (see RejectionSettings).
    rejection: RejectionSettings = field(default_factory=RejectionSettings)
    # Normalisation of the (shaped) sequence rewards before they become advantages: GRPO's
    # per-group mean and std by default.
    reward_norm: NormSettings = field(default_factory=NormSettings)
    # Extra normalisation of the token advantages; none, as in the measured GRPO runs.
    adv_norm: NormSettings = field(default_factory=lambda: NormSettings("none", "none"))
    # Rewards are (r + overlong penalty + reward_bias) * reward_scale, clipped to
    # +-reward_clip, before norms.
    reward_bias: float = 0.0
    reward_scale: float = 1.0
    reward_clip: float = 20.0
    kl_ctl: float = 0.0
    # KL estimator of the penalty (Schulman's k1, k2, k3).
    kl_estimator: str = "k1"
    # KL to the reference (initial) model as a loss term, beta * KL per trained token,
    # instead of or beside the reward penalty kl_ctl; either one loads the reference model.
    kl_loss_coef: float = 0.0
    kl_loss_estimator: str = "k3"
    # PPO mini-batches: the batch is cut into n_minibatches token-balanced slices (the same
    # count on every rank), one optimizer step each, and passed over `epochs` times; the
    # policy version still advances once per batch. More than one update per batch
    # recomputes the proximal log-probs before the first (one extra forward pass).
    n_minibatches: int = 1
    epochs: int = 1
    # The proximal log-probs when several updates (or dropout) make them cost a forward pass:
    # "recompute" (that pass), "loglinear" (interpolated by version, no pass), "metrics"
    # (recompute, and report loglinear's error as prox_approx_* step stats).
    prox_logp_method: str = "recompute"
    # "token" ratios, or "sequence": GSPO's one ratio per sequence (exp of its mean token
    # log-ratio) with the sequence's mean advantage.
    importance_sampling_level: str = "token"
    # Token losses to the step's loss: "token_mean" over the batch, "seq_mean" (each
    # sequence's token mean, averaged), "constant" (token sum over loss_constant_len x
    # sequences, Dr.GRPO; loss_constant_len 0: rollout.sampling.max_new_tokens).
    loss_agg: str = "token_mean"
    loss_constant_len: int = 0
    # DAPO's overlong penalty, added to the raw reward (before bias and scale): 0 up to
    # overlong_max_len - overlong_cache response tokens, then down linearly to
    # -overlong_factor at overlong_max_len and beyond (overlong_max_len 0: off).
    overlong_max_len: int = 0
    overlong_cache: int = 0
    overlong_factor: float = 1.0


@dataclass
class TrainerConfig:
    """The trainer ranks (one SPMD group) and the optimiser."""

    ranks: int = 2
    # Torch CPU threads of each rank.
    torch_threads: int = 1
    # "auto": gloo on CPU, nccl on GPU.
    backend: str = "auto"
    device: str = "auto"
    lr: float = 1e-3
    # Weight decay 0: the measured runs used none.
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    # The linear / cosine schedule decays to lr x min_lr_ratio at total_steps.
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    max_tokens_per_mb: int = 16384
    # Parameter dtype, and bf16 compute with fp32 reduce ("auto": on GPUs that support it).
    dtype: str = "float32"
    mixed_precision: str = "auto"
    # False: a single plain process without FSDP or a process group (one rank only).
    fsdp: bool = True
    # Deadline of one collective inside a rank (gloo/NCCL timeout).
    collective_timeout_s: float = 600.0
    ppo: PPOSettings = field(default_factory=PPOSettings)
    # Deadline of each collective call to the ranks (TrainStep, checkpoints, export): a rank
    # that hangs (rather than dies) fails the call instead of stopping the run for good.
    call_timeout_s: float = 3600.0
    # Restarts of a failed trainer group (from the latest checkpoint) before the run fails.
    max_restarts: int = 3
    # How long a restarted group may take to come back (attach mode: restarted by its own
    # supervisor, e.g. torchrun) before the run fails.
    restart_timeout_s: float = 300.0
    # During a collective call the ranks' health is checked this often (0: never): a rank
    # that hangs (frozen, not dead) fails the call within about interval + timeout instead
    # of call_timeout_s, and the group is restarted.
    health_interval_s: float = 10.0
    health_timeout_s: float = 10.0


@dataclass
class StalenessConfig:
    """Asynchrony: how far rollouts may run ahead of training."""

    # eta: a rollout is trained at most this many versions after it started; 0 is synchronous.
    max_staleness: int = 2
    # Prompts (groups) per training step.
    batch_size: int = 32
    # Samples per prompt.
    group_size: int = 8
    # Seconds an external producer's lease (AcquireRollout, a gateway session) lasts since it
    # was taken or last renewed (RenewRollout; the gateway renews while a session works): an
    # abandoned lease frees its capacity after this long.
    lease_ttl_s: float = 60.0


@dataclass
class WeightSyncConfig:
    """How new weights reach the rollout servers."""

    # False: rollout servers keep their initial weights (only for debugging the loop: the run
    # cannot learn, and versions advance on the trainers alone).
    enabled: bool = True
    # Offered in this order; each server accepts the first it supports. Empty: the trainer's
    # order for its device (README "Which method wins where"): shared_memory, distributed,
    # socket, stream, disk on CPU; distributed first on GPU.
    methods: list[str] = field(default_factory=list)
    # Seconds one fleet update may take before the step fails.
    timeout_s: float = 600.0
    # Root for the disk method; None: <output.dir>/weights.
    disk_root: str | None = None
    # Versions kept under disk_root (older ones are pruned).
    keep_versions: int = 2
    # Parameters are gathered and sent in buckets of this many MiB.
    bucket_mb: float = 64.0
    # Address rollout servers use to reach trainer rank 0's weight group (None: its gRPC host).
    master_addr: str | None = None
    # Backend of the distributed method's group: "auto" is nccl on GPU, gloo on CPU.
    backend: str = "auto"

    def accepted_methods(self) -> tuple[str, ...]:
        """The methods the run may use: those listed, or every one when none is."""
        return tuple(self.methods or WEIGHT_SYNC_METHODS)


@dataclass
class GatewaySettings:
    """The OpenAI-compatible agent gateway (areal-gateway) the coordinator may start."""

    enabled: bool = False
    host: str = "127.0.0.1"
    # 0: any free port (printed as GATEWAY http://host:port/v1).
    port: int = 0
    # Environment variable holding the bearer token clients must send (unset: no auth).
    api_key_env: str = "AREAL_GATEWAY_API_KEY"
    # max_tokens of requests that give none.
    max_tokens: int = 256
    # A Jinja chat template file used instead of the model's own (e.g. one that renders
    # `tools` for a model whose template does not); "": the model's, else the default one.
    chat_template: str = ""
    # Seconds one completion may take at its rollout server before the request fails (504).
    # As long as rollout.episode_timeout_s: on a busy 2-core machine the agent example's
    # completions took over 300 s.
    generate_timeout_s: float = 1800.0


@dataclass
class EvalConfig:
    """Evaluation on the task's eval split (greedy)."""

    # 0 disables evaluation.
    every_steps: int = 25
    # None: the whole eval split.
    max_prompts: int | None = None


@dataclass
class CheckpointConfig:
    """Recovery checkpoints and the final export."""

    # 0 disables periodic checkpoints.
    every_steps: int = 50
    # None: <output.dir>/checkpoints.
    dir: str | None = None
    # Write a Hugging Face model at the end.
    export_hf: bool = True


@dataclass
class OutputConfig:
    """Where metrics and logs go."""

    dir: str = "outputs/run"
    log_level: str = "INFO"
    # TensorBoard event files under dir/tensorboard (needs the tensorboard package).
    tensorboard: bool = False
    plot: bool = True
    progress_bar: bool = True


@dataclass
class LauncherConfig:
    """Start the mesh here (local), on a Ray cluster (ray), as job steps of the Slurm
    allocation the coordinator runs in (slurm), or use running servers (attach)."""

    mode: str = "local"
    host: str = "127.0.0.1"
    # Port of the coordinator's own gRPC service (external producers connect here); 0: any free.
    coordinator_port: int = 0
    # attach mode: one host:port per rollout server / trainer rank.
    rollout_addresses: list[str] = field(default_factory=list)
    trainer_addresses: list[str] = field(default_factory=list)
    # ray mode: the cluster (host:port of the head's GCS, "auto" for the one `ray start` made
    # on this machine, or ray://host:port); None starts a private Ray instance on this machine
    # (stopped with the run).
    ray_address: str | None = None
    # ray mode: one placement-group bundle per node; the servers (trainer ranks first, then
    # rollout servers) are dealt to the bundles in contiguous blocks.
    ray_nodes: int = 1
    ray_strategy: str = "PACK"
    # ray mode: logical resources each server reserves (Ray schedules by these; a server may
    # use more or less). slurm mode: each server's step asks for these CPUs and GPUs (gres).
    rollout_cpus: float = 1.0
    rollout_gpus: float = 0.0
    trainer_cpus: float = 1.0
    trainer_gpus: float = 0.0
    # ray mode: how long placement and the servers' start may take before the run fails.
    ray_start_timeout_s: float = 300.0
    # slurm mode, for the job `python -m areal_grpc.coordinator.submit` writes and submits:
    # nodes, time limit, partition, account, gres per node (e.g. "gpu:8"); None: the
    # cluster's default.
    slurm_nodes: int = 1
    slurm_time: str = "01:00:00"
    slurm_partition: str | None = None
    slurm_account: str | None = None
    slurm_gres: str | None = None


@dataclass
class SecurityConfig:
    """TLS, mutual TLS and the bearer token of every process of the run (servers and clients).

    All None/False (the default) is plaintext, which the servers accept only on loopback.
    """

    # This process's certificate chain and key (PEM): every server of the run serves with them
    # and, with mutual_tls, every client presents them.
    tls_cert: str | None = None
    tls_key: str | None = None
    # CA (PEM) that signed the servers' certificates; clients verify servers against it, and
    # with mutual_tls servers verify clients against it.
    tls_ca: str | None = None
    mutual_tls: bool = False
    # File holding the bearer token every call must carry; None: $AREAL_AUTH_TOKEN if set.
    auth_token_file: str | None = None
    # Serve without TLS on a non-loopback launcher.host.
    allow_plaintext: bool = False


@dataclass
class RunConfig:
    """A whole run."""

    name: str = "builtin"
    # A named algorithm (one of ALGORITHMS): the settings it stands for are applied first,
    # then the file and the overrides; --print-config shows the result.
    algorithm: str = "grpo"
    total_steps: int = 400
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    gateway: GatewaySettings = field(default_factory=GatewaySettings)


# -- loading ---------------------------------------------------------------------------------


# Keys that earlier versions read, and what replaced them (named in the unknown-key error).
REPLACED_KEYS = {
    "trainer.ppo.behav_imp_weight_cap": "trainer.ppo.rejection.upper (null: rejection.metric=none)",
    "trainer.ppo.behav_imp_weight_mode": "trainer.ppo.rejection.action",
}


def _omegaconf_error(exc: OmegaConfBaseException, fallback: str) -> FieldError:
    key = getattr(exc, "full_key", None) or fallback
    first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, ConfigKeyError):
        if key in REPLACED_KEYS:
            return FieldError(key, f"no longer read: use {REPLACED_KEYS[key]}")
        return FieldError(key, f"unknown key ({first_line})")
    return FieldError(key, first_line)


def _merge(base: DictConfig, other: Any, fallback_key: str) -> DictConfig:
    try:
        merged = OmegaConf.merge(base, other)
    except OmegaConfBaseException as exc:
        raise _omegaconf_error(exc, fallback_key) from exc
    if not isinstance(merged, DictConfig):
        raise TypeError(f"expected a DictConfig, got {type(merged).__name__}")
    return merged


def _parse_override(override: str) -> tuple[str, Any]:
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise FieldError(override, "an override must look like key=value, e.g. trainer.lr=5e-4")
    try:
        # The YAML reading of the value, as on the command line of most tools: 3 -> int,
        # [a,b] -> list, null -> None.
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise FieldError(key, f"cannot parse value {raw!r}: {exc}") from exc
    return key, value


def load_config(
    path: str | None, overrides: Sequence[str] = (), *, sections: Sequence[str] | None = None
) -> RunConfig:
    """The run config: defaults, then the YAML file at ``path`` (if any), then ``overrides``.

    ``path`` may also be the document itself, a YAML/JSON mapping starting with ``{`` (how a
    launcher hands a server its run config). ``sections``: what :func:`validate_config`
    checks (default: the whole run).
    """
    cfg = OmegaConf.structured(RunConfig)
    data: dict[str, Any] | None = None
    if path is not None:
        inline = path.lstrip().startswith("{")
        text = path if inline else Path(path).read_text()
        if inline:
            path = "config"
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise FieldError(str(path), f"not valid YAML: {exc}") from exc
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise FieldError(
                str(path), f"the top level must be a mapping, got {type(data).__name__}"
            )
    parsed = [_parse_override(o) for o in overrides]
    # The algorithm's settings go under everything the user set: find its name first.
    algorithm = next(
        (str(v) for k, v in reversed(parsed) if k == "algorithm"),
        str(data.get("algorithm", "grpo")) if data is not None else "grpo",
    )
    if algorithm not in ALGORITHMS:
        raise FieldError("algorithm", f"must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    cfg = _merge(cfg, ALGORITHMS[algorithm], "algorithm")
    if data is not None:
        cfg = _merge(cfg, data, str(path))
    for key, value in parsed:
        # One override at a time, so an error names the override's key even when OmegaConf
        # does not (e.g. a scalar given for a whole section).
        cfg = _merge(cfg, _nested(key, value), key)
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        # e.g. an interpolation "${...}" that does not resolve.
        raise _omegaconf_error(exc, "config") from exc
    if not isinstance(obj, RunConfig):
        raise TypeError(f"expected RunConfig, got {type(obj).__name__}")
    validate_config(obj, sections)
    return obj


def to_json(cfg: RunConfig) -> str:
    """``cfg`` as one line of JSON that :func:`load_config` reads back (a launcher's handoff)."""
    return json.dumps(OmegaConf.to_container(OmegaConf.structured(cfg)), separators=(",", ":"))


def _nested(key: str, value: Any) -> dict[str, Any]:
    parts = key.split(".")
    if any(not p for p in parts):
        raise FieldError(key, "empty component in dotted key")
    out: dict[str, Any] = {parts[-1]: value}
    for part in reversed(parts[:-1]):
        out = {part: out}
    return out


def to_yaml(cfg: RunConfig) -> str:
    """``cfg`` as YAML that :func:`load_config` reads back to an equal config."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# -- validation ------------------------------------------------------------------------------


def _choice(key: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise FieldError(key, f"must be one of {', '.join(choices)}; got {value!r}")


def _at_least(key: str, value: float, low: float) -> None:
    if not value >= low:
        raise FieldError(key, f"must be >= {low}, got {value}")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise FieldError(key, f"must be > 0, got {value}")


def _address(key: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise FieldError(key, f"must be host:port with a port in 1-65535, got {value!r}")


def _validate_security(sec: SecurityConfig) -> None:
    for key in ("tls_cert", "tls_key", "tls_ca", "auth_token_file"):
        value = getattr(sec, key)
        if value is not None and not Path(value).is_file():
            raise FieldError(f"security.{key}", f"no such file: {value!r}")
    if (sec.tls_cert is None) != (sec.tls_key is None):
        missing = "tls_key" if sec.tls_key is None else "tls_cert"
        raise FieldError(f"security.{missing}", "tls_cert and tls_key go together")
    if sec.tls_cert is not None and sec.tls_ca is None:
        # Every process is also a client of the others and must verify their certificates.
        raise FieldError("security.tls_ca", "TLS needs the CA that signed the servers' certs")
    if sec.tls_ca is not None and sec.tls_cert is None:
        raise FieldError("security.tls_cert", "security.tls_ca is set but TLS is not (no cert)")
    if sec.mutual_tls and sec.tls_cert is None:
        raise FieldError("security.mutual_tls", "needs security.tls_cert, tls_key and tls_ca")
    if sec.auth_token_file is not None and not Path(sec.auth_token_file).read_text().strip():
        raise FieldError("security.auth_token_file", f"{sec.auth_token_file!r} is empty")


def _validate_run(cfg: RunConfig) -> None:
    if not cfg.name:
        raise FieldError("name", "must not be empty")
    _at_least("total_steps", cfg.total_steps, 1)


def _validate_model(cfg: RunConfig) -> None:
    if not cfg.model.source:
        raise FieldError("model.source", "must not be empty")
    _at_least("model.seed", cfg.model.seed, 0)
    lora = cfg.model.lora
    _at_least("model.lora.rank", lora.rank, 0)
    if lora.rank:
        _positive("model.lora.alpha", lora.alpha)
        if not 0.0 <= lora.dropout < 1.0:
            raise FieldError("model.lora.dropout", f"must be in [0, 1), got {lora.dropout}")
        if not lora.target_modules or not all(lora.target_modules):
            raise FieldError("model.lora.target_modules", "must name at least one module")


def _validate_data(cfg: RunConfig) -> None:
    if not cfg.data.task:
        raise FieldError("data.task", "must not be empty")
    for key in ("path", "eval_path"):
        value = getattr(cfg.data, key)
        if value is not None and not Path(value).is_file():
            raise FieldError(f"data.{key}", f"{value!r} is not a file")
    if cfg.data.eval_path is not None and cfg.data.path is None:
        raise FieldError("data.eval_path", "needs data.path (the train items)")
    if cfg.data.task == EXTERNAL_TASK:
        if cfg.data.path is not None:
            raise FieldError("data.path", "data.task=external has no items of its own")
        if cfg.eval.every_steps:
            raise FieldError(
                "eval.every_steps",
                "data.task=external has no held-out items to evaluate: set eval.every_steps=0",
            )


def _validate_rollout(cfg: RunConfig) -> None:
    if (
        cfg.rollout.engine == "sglang"
        and cfg.model.lora.rank > 0
        and set(cfg.weight_sync.accepted_methods()) <= {"distributed"}
    ):
        raise FieldError(
            "weight_sync.methods",
            "SGLang takes LoRA adapters from disk or stream updates only, not distributed ones",
        )
    r = cfg.rollout
    _at_least("rollout.num_servers", r.num_servers, 1)
    _at_least("rollout.torch_threads", r.torch_threads, 1)
    _at_least("rollout.max_running_requests", r.max_running_requests, 1)
    if r.max_batch_tokens is not None:
        _at_least("rollout.max_batch_tokens", r.max_batch_tokens, 2)
    _choice("rollout.engine", r.engine, ENGINES)
    _choice("rollout.device", r.device, DEVICES)
    _choice("rollout.chat_template", r.chat_template, ("auto", "on", "off"))
    for name in ("workflow", "reward"):
        if not getattr(r, name):
            raise FieldError(f"rollout.{name}", "must not be empty")
    _at_least("rollout.sampling.temperature", r.sampling.temperature, 0.0)
    if not 0.0 < r.sampling.top_p <= 1.0:
        raise FieldError("rollout.sampling.top_p", f"must be in (0, 1], got {r.sampling.top_p}")
    _at_least("rollout.sampling.top_k", r.sampling.top_k, 0)
    if r.sampling.max_new_tokens is not None:
        _at_least("rollout.sampling.max_new_tokens", r.sampling.max_new_tokens, 1)
    if r.max_concurrent_rollouts is not None:
        _at_least("rollout.max_concurrent_rollouts", r.max_concurrent_rollouts, 1)
    _positive("rollout.episode_timeout_s", r.episode_timeout_s)
    _at_least("rollout.health_interval_s", r.health_interval_s, 0.0)
    _positive("rollout.health_timeout_s", r.health_timeout_s)
    _at_least("rollout.max_restarts", r.max_restarts, 0)
    _positive("rollout.no_server_timeout_s", r.no_server_timeout_s)
    _positive("rollout.replace_after_s", r.replace_after_s)
    v = r.vllm
    _positive("rollout.vllm.kv_cache_gib", v.kv_cache_gib)
    _at_least("rollout.vllm.max_num_seqs", v.max_num_seqs, 1)
    _at_least("rollout.vllm.max_model_len", v.max_model_len, 0)
    _choice("rollout.vllm.dtype", v.dtype, VLLM_DTYPES)
    if v.reserved_cpus is not None:
        _at_least("rollout.vllm.reserved_cpus", v.reserved_cpus, 0)
    _positive("rollout.vllm.start_timeout_s", v.start_timeout_s)
    _positive("rollout.vllm.health_interval_s", v.health_interval_s)
    _positive("rollout.vllm.health_timeout_s", v.health_timeout_s)
    if not 0 <= v.idle_spin_s < float("inf"):
        raise FieldError("rollout.vllm.idle_spin_s", f"must be >= 0, got {v.idle_spin_s}")
    if r.engine == "vllm":
        # vLLM reports log-probs after top-p/top-k truncation (renormalised), ours are taken
        # before it (rollout.proto, Completion.output_logprobs): no setting gives both.
        if r.sampling.top_p != 1.0:
            raise FieldError(
                "rollout.sampling.top_p",
                f"must be 1 with rollout.engine=vllm (vLLM reports log-probs after top-p "
                f"truncation), got {r.sampling.top_p}",
            )
        if r.sampling.top_k != 0:
            raise FieldError(
                "rollout.sampling.top_k",
                f"must be 0 with rollout.engine=vllm (vLLM reports log-probs after top-k "
                f"truncation), got {r.sampling.top_k}",
            )


def _validate_trainer(cfg: RunConfig) -> None:
    t = cfg.trainer
    _at_least("trainer.ranks", t.ranks, 1)
    _at_least("trainer.torch_threads", t.torch_threads, 1)
    _choice("trainer.backend", t.backend, BACKENDS)
    _choice("trainer.device", t.device, DEVICES)
    _positive("trainer.lr", t.lr)
    _at_least("trainer.weight_decay", t.weight_decay, 0.0)
    _at_least("trainer.warmup_steps", t.warmup_steps, 0)
    _choice("trainer.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise FieldError("trainer.min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}")
    _choice("trainer.dtype", t.dtype, DTYPES)
    _choice("trainer.mixed_precision", t.mixed_precision, MIXED_PRECISION)
    _positive("trainer.collective_timeout_s", t.collective_timeout_s)
    _positive("trainer.grad_clip", t.grad_clip)
    _at_least("trainer.max_tokens_per_mb", t.max_tokens_per_mb, 1)
    p = t.ppo
    _positive("trainer.ppo.eps_clip", p.eps_clip)
    if p.eps_clip_higher is not None:
        _positive("trainer.ppo.eps_clip_higher", p.eps_clip_higher)
    if p.c_clip is not None and not p.c_clip > 1.0:
        raise FieldError("trainer.ppo.c_clip", f"must be > 1 when set, got {p.c_clip}")
    _validate_rejection(p.rejection)
    for name, norm in (("reward_norm", p.reward_norm), ("adv_norm", p.adv_norm)):
        _choice(f"trainer.ppo.{name}.mean_level", norm.mean_level, NORM_LEVELS)
        _choice(f"trainer.ppo.{name}.std_level", norm.std_level, NORM_LEVELS)
        _at_least(f"trainer.ppo.{name}.eps", norm.eps, 0.0)
        if norm.mean_leave1out and norm.mean_level != "group":
            raise FieldError(
                f"trainer.ppo.{name}.mean_leave1out",
                f"needs mean_level group (the other members of the group), got {norm.mean_level}",
            )
    _positive("trainer.ppo.reward_clip", p.reward_clip)
    _at_least("trainer.ppo.kl_ctl", p.kl_ctl, 0.0)
    _choice("trainer.ppo.kl_estimator", p.kl_estimator, KL_ESTIMATORS)
    _at_least("trainer.ppo.kl_loss_coef", p.kl_loss_coef, 0.0)
    _choice("trainer.ppo.kl_loss_estimator", p.kl_loss_estimator, KL_ESTIMATORS)
    _at_least("trainer.ppo.n_minibatches", p.n_minibatches, 1)
    _at_least("trainer.ppo.epochs", p.epochs, 1)
    _choice("trainer.ppo.prox_logp_method", p.prox_logp_method, PROX_LOGP_METHODS)
    _choice(
        "trainer.ppo.importance_sampling_level",
        p.importance_sampling_level,
        IMPORTANCE_SAMPLING_LEVELS,
    )
    _choice("trainer.ppo.loss_agg", p.loss_agg, LOSS_AGGREGATIONS)
    _at_least("trainer.ppo.loss_constant_len", p.loss_constant_len, 0)
    _at_least("trainer.ppo.overlong_max_len", p.overlong_max_len, 0)
    _at_least("trainer.ppo.overlong_cache", p.overlong_cache, 0)
    if p.overlong_cache > p.overlong_max_len:
        raise FieldError(
            "trainer.ppo.overlong_cache",
            f"{p.overlong_cache} exceeds overlong_max_len {p.overlong_max_len}",
        )
    _positive("trainer.call_timeout_s", t.call_timeout_s)
    _at_least("trainer.max_restarts", t.max_restarts, 0)
    _positive("trainer.restart_timeout_s", t.restart_timeout_s)
    _at_least("trainer.health_interval_s", t.health_interval_s, 0.0)
    _positive("trainer.health_timeout_s", t.health_timeout_s)


def _validate_rejection(r: RejectionSettings) -> None:
    key = "trainer.ppo.rejection"
    _choice(f"{key}.metric", r.metric, REJECTION_METRICS)
    _choice(f"{key}.level", r.level, IMPORTANCE_SAMPLING_LEVELS)
    _choice(f"{key}.action", r.action, REJECTION_ACTIONS)
    _choice(f"{key}.agg", r.agg, REJECTION_AGGS)
    if r.metric == "none":
        return
    if r.level == "token" and r.agg != "mean":
        # AReaL warns and ignores it; a setting that silently does nothing is refused here.
        raise FieldError(f"{key}.agg", f"{r.agg!r} is used only with {key}.level sequence")
    if r.action == "clamp" and r.metric != "ratio":
        raise FieldError(f"{key}.action", f"'clamp' bounds a ratio; metric is {r.metric!r}")
    if r.metric == "ratio":
        if not r.upper > 1.0:
            raise FieldError(f"{key}.upper", f"a ratio bound must be > 1, got {r.upper}")
        if r.lower is not None and not 0.0 < r.lower < 1.0:
            raise FieldError(f"{key}.lower", f"a ratio bound must be in (0, 1), got {r.lower}")
        return
    if r.metric != "kl_k1":
        _positive(f"{key}.upper", r.upper)
    if r.lower is not None and r.lower >= r.upper:
        raise FieldError(f"{key}.lower", f"{r.lower} is not below upper {r.upper}")


def _validate_gateway(cfg: RunConfig) -> None:
    g = cfg.gateway
    if not 0 <= g.port <= 65535:
        raise FieldError("gateway.port", f"must be in [0, 65535], got {g.port}")
    _at_least("gateway.max_tokens", g.max_tokens, 1)
    if not 0 < g.generate_timeout_s < float("inf"):
        raise FieldError("gateway.generate_timeout_s", f"must be > 0, got {g.generate_timeout_s}")
    if g.chat_template:
        read_chat_template(g.chat_template)


def read_chat_template(path: str) -> str:
    """The text of ``gateway.chat_template``'s file, checked to be a Jinja template."""
    import jinja2  # transformers' own template engine

    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise FieldError("gateway.chat_template", f"{path!r} cannot be read: {exc}") from None
    try:
        # As transformers compiles chat templates (loop controls on).
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise FieldError(
            "gateway.chat_template", f"{path!r} line {exc.lineno}: {exc.message}"
        ) from None
    return text


def _validate_staleness(cfg: RunConfig) -> None:
    s = cfg.staleness
    _at_least("staleness.max_staleness", s.max_staleness, 0)
    _at_least("staleness.batch_size", s.batch_size, 1)
    _at_least("staleness.group_size", s.group_size, 1)
    if not 0 < s.lease_ttl_s < float("inf"):
        raise FieldError(
            "staleness.lease_ttl_s", f"must be a finite number of seconds > 0, got {s.lease_ttl_s}"
        )
    # One sample per prompt centred on its own group's mean is centred on itself: every
    # reward is erased and the run cannot learn. (External producers choose their own group
    # sizes; group_size is the run's own rollouts'.)
    if s.group_size == 1 and cfg.data.task != EXTERNAL_TASK:
        for name in ("reward_norm", "adv_norm"):
            if getattr(cfg.trainer.ppo, name).mean_level == "group":
                raise FieldError(
                    "staleness.group_size",
                    f"1 with trainer.ppo.{name}.mean_level group centres each sample on "
                    "itself and erases its reward; use mean_level batch or none",
                )


def _validate_weight_sync(cfg: RunConfig) -> None:
    w = cfg.weight_sync
    for i, m in enumerate(w.methods):
        _choice(f"weight_sync.methods[{i}]", m, WEIGHT_SYNC_METHODS)
    if len(set(w.methods)) != len(w.methods):
        raise FieldError("weight_sync.methods", f"lists a method twice: {w.methods}")
    _positive("weight_sync.timeout_s", w.timeout_s)
    _at_least("weight_sync.keep_versions", w.keep_versions, 1)
    _positive("weight_sync.bucket_mb", w.bucket_mb)
    if w.master_addr is not None and not w.master_addr:
        raise FieldError("weight_sync.master_addr", "must not be empty (leave it unset instead)")
    _choice("weight_sync.backend", w.backend, BACKENDS)


def _validate_eval(cfg: RunConfig) -> None:
    _at_least("eval.every_steps", cfg.eval.every_steps, 0)
    if cfg.eval.max_prompts is not None:
        _at_least("eval.max_prompts", cfg.eval.max_prompts, 1)


def _validate_checkpoint(cfg: RunConfig) -> None:
    _at_least("checkpoint.every_steps", cfg.checkpoint.every_steps, 0)


def _validate_output(cfg: RunConfig) -> None:
    if not cfg.output.dir:
        raise FieldError("output.dir", "must not be empty")
    _choice("output.log_level", cfg.output.log_level, LOG_LEVELS)
    if cfg.output.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise FieldError(
            "output.tensorboard", "needs the tensorboard package (pip install tensorboard)"
        )


def _validate_launcher(cfg: RunConfig) -> None:
    r, t = cfg.rollout, cfg.trainer
    la = cfg.launcher
    _choice("launcher.mode", la.mode, LAUNCH_MODES)
    if not la.host:
        raise FieldError("launcher.host", "must not be empty")
    if not 0 <= la.coordinator_port < 65536:
        raise FieldError(
            "launcher.coordinator_port", f"must be in 0-65535, got {la.coordinator_port}"
        )
    for key in ("rollout_addresses", "trainer_addresses"):
        for i, addr in enumerate(getattr(la, key)):
            _address(f"launcher.{key}[{i}]", addr)
    _at_least("launcher.ray_nodes", la.ray_nodes, 1)
    _choice("launcher.ray_strategy", la.ray_strategy, RAY_STRATEGIES)
    for key in ("rollout_cpus", "rollout_gpus", "trainer_cpus", "trainer_gpus"):
        _at_least(f"launcher.{key}", getattr(la, key), 0)
    _positive("launcher.ray_start_timeout_s", la.ray_start_timeout_s)
    _at_least("launcher.slurm_nodes", la.slurm_nodes, 1)
    if not re.fullmatch(r"(\d+-)?\d+(:\d{1,2}){0,2}", la.slurm_time):
        raise FieldError(
            "launcher.slurm_time",
            f"must be a Slurm time limit like 01:00:00, got {la.slurm_time!r}",
        )
    if la.mode == "ray" and la.ray_nodes > r.num_servers + t.ranks:
        raise FieldError(
            "launcher.ray_nodes",
            f"{la.ray_nodes} bundles for {r.num_servers + t.ranks} servers would leave "
            "a bundle empty",
        )
    if la.ray_address is not None and not la.ray_address:
        raise FieldError("launcher.ray_address", "must not be empty (leave it unset instead)")
    if la.mode == "attach":
        if len(la.rollout_addresses) != r.num_servers:
            raise FieldError(
                "launcher.rollout_addresses",
                f"attach mode needs one address per rollout server (rollout.num_servers = "
                f"{r.num_servers}), got {len(la.rollout_addresses)}",
            )
        if len(la.trainer_addresses) != t.ranks:
            raise FieldError(
                "launcher.trainer_addresses",
                f"attach mode needs one address per trainer rank (trainer.ranks = {t.ranks}), "
                f"got {len(la.trainer_addresses)}",
            )
    elif r.engine == "sglang" and len(r.sglang_urls) != r.num_servers:
        raise FieldError(
            "rollout.sglang_urls",
            f"engine sglang needs one SGLang URL per rollout server (rollout.num_servers = "
            f"{r.num_servers}), got {len(r.sglang_urls)}",
        )


# Each section's checks, in the order a whole run is checked.
SECTION_CHECKS: dict[str, Callable[[RunConfig], None]] = {
    "run": _validate_run,
    "model": _validate_model,
    "data": _validate_data,
    "rollout": _validate_rollout,
    "trainer": _validate_trainer,
    "staleness": _validate_staleness,
    "weight_sync": _validate_weight_sync,
    "eval": _validate_eval,
    "checkpoint": _validate_checkpoint,
    "output": _validate_output,
    "security": lambda cfg: _validate_security(cfg.security),
    "launcher": _validate_launcher,
    "gateway": _validate_gateway,
}


def validate_config(cfg: RunConfig, sections: Sequence[str] | None = None) -> None:
    """Checks ranges, choices and cross-field rules of ``sections`` (default: all, the whole
    run); raises FieldError naming the first bad key.

    A server checks only the sections it uses: a trainer on another node need not see the
    coordinator's data files.
    """
    for name in sections if sections is not None else SECTION_CHECKS:
        SECTION_CHECKS[name](cfg)
