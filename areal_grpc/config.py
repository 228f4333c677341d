"""Typed configuration of a whole run: dataclasses, a YAML file, dotted ``key=value`` overrides.

Precedence: dataclass defaults < YAML file < overrides (applied left to right, the last wins).
Every error is a :class:`~areal_grpc.errors.FieldError` naming the dotted key, e.g.
``trainer.optimizer.lr: ...``, whether the key is unknown, the value has the wrong type or it
is out of range.

The defaults are the built-in run: the small built-in model, the built-in ``first3`` task, one
rollout server, two trainer ranks, and GRPO settings from measurements of what a tiny
random-init model learns on a CPU (32 prompts x 8 samples,
temperature 1, lr 1e-3, 1 PPO epoch, no KL, clip 0.2, grad clip 1, eval every 25 steps).

Example::

    cfg = load_config("run.yaml", ["trainer.optimizer.lr=5e-4", "staleness.max_staleness=0"])
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import textwrap
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from areal_grpc.errors import FieldError
from areal_grpc.rewards import REWARD_FNS, reward_fn_for_task
from areal_grpc.tasks import TASKS

__all__ = [
    "ALGORITHMS",
    "EXTERNAL_TASK",
    "NORM_LEVELS",
    "WEIGHT_SYNC_METHODS",
    "AttachSettings",
    "CheckpointConfig",
    "DataConfig",
    "EvalConfig",
    "FaultToleranceConfig",
    "LauncherConfig",
    "LoraSettings",
    "ModelConfig",
    "NormSettings",
    "OptimizerSettings",
    "OutputConfig",
    "PPOSettings",
    "RaySettings",
    "RolloutConfig",
    "RolloutSupervision",
    "RunConfig",
    "SamplingSettings",
    "SecurityConfig",
    "SglangSettings",
    "SlurmSettings",
    "StalenessConfig",
    "TinkerConfig",
    "TrainerConfig",
    "TrainerSupervision",
    "VllmSettings",
    "WeightSyncConfig",
    "choices_of",
    "describe",
    "load_config",
    "preflight",
    "reference_markdown",
    "to_json",
    "to_yaml",
    "validate_config",
]

Engine = Literal["hf", "vllm", "sglang"]
ENGINES: tuple[str, ...] = get_args(Engine)
# The dtype a rollout engine serves the model in; auto: bf16 where the hardware has fast bf16
# units, else fp32 (areal_grpc.precision).
Precision = Literal["auto", "float32", "bfloat16", "float16"]
# What a pause for a weight update does to vLLM's requests in flight (rollout.vllm.pause_mode).
VllmPauseMode = Literal["abort", "keep"]
# What a pause for a weight update does to SGLang's requests in flight (rollout.sglang.pause_mode).
SglangPauseMode = Literal["abort", "retract"]
Backend = Literal["auto", "gloo", "nccl"]
BACKENDS: tuple[str, ...] = get_args(Backend)
Device = Literal["auto", "cpu", "cuda"]
DEVICES: tuple[str, ...] = get_args(Device)
# Where a normalisation's mean or std is taken: per trajectory group, over the global batch,
# or not at all.
NormLevel = Literal["group", "batch", "none"]
NORM_LEVELS: tuple[str, ...] = get_args(NormLevel)
KlEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KlEstimator)
# How far the proximal policy may be from the behaviour one (trainer.ppo.rejection.metric);
# "none" applies no behaviour weight at all.
RejectionMetric = Literal["ratio", "kl_k1", "kl_k2", "kl_k3", "binary_kl", "none"]
REJECTION_METRICS: tuple[str, ...] = get_args(RejectionMetric)
RejectionAgg = Literal["mean", "sum", "max"]
REJECTION_AGGS: tuple[str, ...] = get_args(RejectionAgg)
# data.task of a run that trains only on what producers submit.
EXTERNAL_TASK = "external"
ProxLogpMethod = Literal["recompute", "loglinear", "metrics"]
PROX_LOGP_METHODS: tuple[str, ...] = get_args(ProxLogpMethod)
ImportanceSamplingLevel = Literal["token", "sequence"]
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = get_args(ImportanceSamplingLevel)
LossAggregation = Literal["token_mean", "seq_mean", "constant"]
LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)

# Named algorithms as settings of the same objective: ``algorithm: <name>`` applies the YAML
# file configs/algorithms/<name>.yaml of this repository below whatever the files and the
# overrides set (so each of its keys can still be changed; the files are also ``--config``
# files of their own). Meanings as in AReaL's
# https://github.com/inclusionAI/AReaL/blob/main/docs/en/algorithms/grpo_series.md
Algorithm = Literal[
    "grpo",
    "dr_grpo",
    "rloo",
    "liteppo",
    "ppo_no_critic",
    "reinforce_pp",
    "dapo",
    "icepop",
    "kpop",
    "gspo",
]
ALGORITHMS: tuple[str, ...] = get_args(Algorithm)
ALGORITHMS_DIR = Path(__file__).resolve().parent.parent / "configs" / "algorithms"


def algorithm_settings(name: str) -> dict[str, Any]:
    """The settings the named algorithm stands for (its preset file)."""
    if name not in ALGORITHMS:
        raise FieldError("algorithm", f"must be one of {', '.join(ALGORITHMS)}, got {name!r}")
    return yaml.safe_load((ALGORITHMS_DIR / f"{name}.yaml").read_text()) or {}


Dtype = Literal["float32", "float64"]
DTYPES: tuple[str, ...] = get_args(Dtype)
MixedPrecision = Literal["auto", "on", "off"]
MIXED_PRECISION: tuple[str, ...] = get_args(MixedPrecision)
RejectionAction = Literal["mask", "clamp"]
REJECTION_ACTIONS: tuple[str, ...] = get_args(RejectionAction)
LrSchedule = Literal["constant", "linear", "cosine"]
LR_SCHEDULES: tuple[str, ...] = get_args(LrSchedule)
WeightSyncMethod = Literal["distributed", "shared_memory", "socket", "stream", "disk"]
WEIGHT_SYNC_METHODS: tuple[str, ...] = get_args(WeightSyncMethod)
LaunchMode = Literal["local", "attach", "ray", "slurm"]
LAUNCH_MODES: tuple[str, ...] = get_args(LaunchMode)
RayStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
RAY_STRATEGIES: tuple[str, ...] = get_args(RayStrategy)
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)
# offline: W&B keeps the run on disk (`wandb sync` uploads it later); online: it uploads live;
# auto: W&B's WANDB_MODE, else offline.
WandbMode = Literal["auto", "offline", "online"]
ChatTemplateMode = Literal["auto", "on", "off"]
CHAT_TEMPLATE_MODES: tuple[str, ...] = get_args(ChatTemplateMode)


@functools.cache
def _hints(owner: type) -> dict[str, Any]:
    return typing.get_type_hints(owner)


def choices_of(owner: type, name: str) -> tuple[str, ...]:
    """The strings setting ``name`` of config class ``owner`` may hold (a list: each element):
    its ``Literal`` type's values; () for a free one."""
    hint = _hints(owner)[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is list:
        hint = typing.get_args(hint)[0]
    return tuple(typing.get_args(hint)) if typing.get_origin(hint) is Literal else ()


def setting(
    default: Any = MISSING,
    *,
    help: str,
    ge: float | None = None,
    gt: float | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A config field with its help text and the bounds a number must keep (``ge``: at least,
    ``gt``: above; None, where a field allows it, is not checked), which
    :func:`validate_config` enforces naming the key. A field of a fixed set of strings says so
    in its type, a ``Literal`` (see :func:`choices_of`)."""
    meta = {"help": help, "ge": ge, "gt": gt}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class LoraSettings:
    """LoRA adapters (through peft) on the policy: only they train, and only they travel in a
    weight update; the base weights stay frozen in every process. ``rank`` 0: no LoRA, the
    whole model trains."""

    rank: int = setting(0, help="Adapter rank r; 0: no LoRA, the whole model trains.", ge=0)
    alpha: float = setting(
        16.0,
        help="LoRA's alpha: the adapter's update is scaled by alpha / rank.",
        gt=0,
    )
    target_modules: list[str] = setting(
        factory=lambda: ["all-linear"],
        help='Module names (or suffixes) that get adapters; "all-linear" is every linear layer'
        " but the output head (peft's meaning).",
    )
    dropout: float = setting(0.0, help="Dropout on the adapters' input during training.")
    merged_export: bool = setting(
        False,
        help="Exports hold the adapter (adapter_config.json + adapter_model.safetensors, for "
        "peft); with this set, also the merged full model in <export>/merged.",
    )


@dataclass
class ModelConfig:
    """Which policy to train."""

    source: str = setting(
        "builtin:micro",
        help="builtin:micro (0.16M params), builtin:tiny (about 1M), a local HF checkpoint "
        "directory, a GGUF file, or a named model (smollm2-135m-instruct, converted once "
        "into the cache). micro is the default: the measured runs that learn within a "
        "minute on one CPU core used a model of that size.",
    )
    seed: int = setting(0, help="Seeds model init, the dataloader order and sampling.", ge=0)
    lora: LoraSettings = setting(
        factory=LoraSettings,
        help="LoRA adapters on the policy (rank 0: none).",
    )


@dataclass
class DataConfig:
    """The prompts."""

    task: str = setting(
        "first3",
        help='A built-in task (areal_grpc.tasks: "first3", "echo"), a task whose items come '
        'from path, or "external": no prompts of the run\'s own, it trains only on the '
        "groups producers submit (the gateway's sessions, SubmitTrajectories).",
    )
    path: str | None = setting(
        None,
        help="Train items (JSONL or Parquet, read with the datasets library) for tasks that are "
        'not built in (e.g. "gsm8k"); None for built-ins.',
    )
    eval_path: str | None = setting(
        None,
        help="Held-out items for eval (same formats); None: the first 10% of path is held out.",
    )
    shuffle: bool = setting(
        True,
        help="Shuffle the train items (seeded by model.seed) before each pass.",
    )


@dataclass
class SamplingSettings:
    """Sampling of rollouts."""

    temperature: float = setting(
        1.0,
        help="Sampling temperature; 0 is greedy. The trainer recomputes log-probs under the same"
        " temperature.",
        ge=0.0,
    )
    top_p: float = setting(
        1.0,
        help="Nucleus sampling: the smallest set of tokens whose probability reaches top_p (1: "
        "all).",
    )
    top_k: int = setting(0, help="Sample among the k most likely tokens only; 0: no limit.", ge=0)
    max_new_tokens: int | None = setting(
        None,
        help="Tokens generated per sample at most; null: the task's own answer length (2 tokens "
        "for the built-in tasks).",
        ge=1,
    )


@dataclass
class VllmSettings:
    """The vllm engine's own settings (``rollout.engine: vllm``), per rollout server.

    The defaults start on 2 CPU cores and 24 GiB: fp32 (this CPU has no fast bf16), a 2 GiB
    KV cache, eager mode.
    """

    kv_cache_gib: float = setting(
        2.0,
        help="KV cache per server, GiB (host memory on the CPU backend, GPU memory on a GPU).",
        gt=0,
    )
    max_num_seqs: int = setting(
        64, help="Sequences decoded at once at most (vLLM's max_num_seqs).", ge=1
    )
    max_model_len: int = setting(
        0,
        help="Longest prompt + output; 0: the model's context, capped at 4096 (the KV cache must"
        " hold one sequence of this length).",
        ge=0,
    )
    reserved_cpus: int | None = setting(
        None,
        help="CPU cores vLLM keeps for its own scheduler process (None: vLLM's default, one); "
        "the rest run its model worker. 0 gives the worker every core.",
        ge=0,
    )
    start_timeout_s: float = setting(
        600.0,
        help="Seconds the engine may take to start (imports, its processes, the model load).",
        gt=0,
    )
    health_interval_s: float = setting(
        5.0,
        help="vLLM's engine process is asked whether it is alive this often; one that has died "
        "or does not answer within health_timeout_s takes the server down, so its launcher "
        "replaces it.",
        gt=0,
    )
    health_timeout_s: float = setting(
        60.0,
        help="Seconds a liveness check of vLLM's engine process may take (see health_interval_s).",
        gt=0,
    )
    pause_mode: VllmPauseMode = setting(
        "abort",
        help="What an update does to requests in flight. abort: they end INTERRUPTED with their"
        " partial output and are sent again after it (as on the hf engine). keep: vLLM holds "
        "them, recomputes their KV cache under the new weights and goes on; each token still "
        "carries the version that generated it.",
    )
    idle_spin_s: float = setting(
        0.05,
        help="Seconds vLLM's model worker busy-waits for its next message before it sleeps (vLLM"
        " itself spins 1 s after every message, a core's worth of CPU that the trainer "
        "sharing these cores lost: on 2 cores its steps took 19.5 s instead of 14.9 s). A "
        "step of a running batch comes sooner than this, so generation does not wait on a "
        "wake-up.",
    )
    max_adapter_rank: int = setting(
        0,
        help="Largest LoRA rank of the named adapters (RolloutService.LoadAdapter) vLLM serves; "
        "0: vLLM serves none (its LoRA layers, which slow every step, are built only when the "
        "run's own LoRA or this asks for them).",
        ge=0,
    )
    max_loras: int = setting(
        4,
        help="Adapters vLLM computes in one step at most (vLLM's max_loras): the run's own "
        "LoRA versions and the named adapters; a request of another waits for a slot.",
        ge=1,
    )


@dataclass
class SglangSettings:
    """The sglang engine's own settings (``rollout.engine: sglang``): each rollout server
    launches an SGLang server of its own, or attaches to one in ``urls``.

    The defaults start on 2 CPU cores (SGLang's torch-native CPU path, fp32).
    """

    urls: list[str] = setting(
        factory=list,
        help="Attach: one SGLang base URL per rollout server (the launcher's servers in order); "
        "empty: each rollout server launches its own SGLang server.",
    )
    python: str = setting(
        "",
        help="The Python of SGLang's own venv, which launches its servers; empty: "
        ".venv-sglang/bin/python of this checkout (./scripts/setup --sglang) when it exists, "
        "else this Python.",
    )
    kv_cache_tokens: int = setting(
        8192,
        help="Tokens SGLang's KV cache holds (its --max-total-tokens; on a CPU it would size the "
        "cache from free host memory otherwise); 0: SGLang's own sizing.",
        ge=0,
    )
    attention_backend: str = setting(
        "",
        help="SGLang's --attention-backend; empty: torch_native on a CPU (the one that runs "
        "without SGLang's CPU kernels), SGLang's choice on a GPU.",
    )
    pause_mode: SglangPauseMode = setting(
        "abort",
        help="What an update does to requests in flight. abort: they end INTERRUPTED with their "
        "partial output and are sent again after it. retract: SGLang holds them, frees their KV "
        "cache, recomputes it under the new weights and goes on; each token carries the version "
        "that generated it.",
    )
    start_timeout_s: float = setting(
        600.0,
        help="Seconds a launched SGLang server may take to answer /health (imports, its "
        "scheduler process, the model load).",
        gt=0,
    )
    health_interval_s: float = setting(
        10.0,
        help="The SGLang server is checked this often: a launched one whose process exited, or "
        "one that fails /health twice in a row (it does not answer within health_timeout_s), "
        "takes the rollout server down, so its launcher replaces it.",
        gt=0,
    )
    health_timeout_s: float = setting(
        60.0,
        help="Seconds SGLang's /health may take (it generates one token when idle; SGLang itself "
        "answers 503 after 20 s without progress).",
        gt=0,
    )
    weights_dir: str = setting(
        "",
        help="Where the engine writes what SGLang reads (staged weight updates, LoRA adapters); "
        "empty: this host's shared memory. Attached to an SGLang server on another host: a "
        "directory both hosts see.",
    )
    extra_args: list[str] = setting(
        factory=list,
        help="More command-line arguments of the launched SGLang server.",
    )


@dataclass
class RolloutConfig:
    """The rollout (inference) servers and what they run."""

    num_servers: int = setting(
        1,
        help="Rollout servers the launcher starts (attach mode: the addresses given).",
        ge=1,
    )
    engine: Engine = setting(
        "hf",
        help="The rollout servers' inference engine: the in-process transformers engine (hf), "
        "vLLM, or an SGLang server per rollout server.",
    )
    device: Device = setting(
        "auto",
        help="Where the rollout servers generate; auto: a GPU when one is visible, else the CPU.",
    )
    dtype: Precision = setting(
        "auto",
        help="The dtype every engine serves the model in; auto: bfloat16 where the hardware has "
        "fast bf16 units (a CUDA GPU, a CPU with AMX-BF16 or AVX512-BF16), else float32. "
        "Log-probs are computed in float32 either way.",
    )
    workflow: str = setting(
        "rlvr",
        help='A registered workflow name or an import path "pkg.mod:name".',
    )
    reward: str = setting(
        "task",
        help='A reward in areal_grpc.rewards.REWARD_FNS ("task": the task\'s own) or an import '
        "path.",
    )
    chat_template: ChatTemplateMode = setting(
        "auto",
        help='Prompts through the model\'s chat template: "auto" when the tokenizer has one, '
        '"on" (an error without one), "off" (raw text).',
    )
    system_prompt: str | None = setting(
        None,
        help="The system message of chat prompts (None: the template's own default, if any).",
    )
    torch_threads: int = setting(1, help="Torch CPU threads of each rollout server.", ge=1)
    max_running_requests: int = setting(
        256,
        help="Requests each hf server decodes at once at most (rows of its batch).",
        ge=1,
    )
    workflow_params: dict[str, Any] = setting(
        factory=dict,
        help="Default parameters of the workflow (a request's own params override them).",
    )
    max_batch_tokens: int | None = setting(
        None,
        help="KV cache budget of each hf server in token slots (rows x the longest row's prompt "
        "+ max_new_tokens); requests wait until they fit; None: unbounded but for 256 rows.",
        ge=2,
    )
    sampling: SamplingSettings = setting(
        factory=SamplingSettings,
        help="Sampling of the run's own rollouts (a request's own parameters override them).",
    )
    vllm: VllmSettings = setting(factory=VllmSettings, help="The vllm engine's own settings.")
    sglang: SglangSettings = setting(
        factory=SglangSettings, help="The sglang engine's own settings."
    )
    max_adapters: int = setting(
        16,
        help="Named LoRA adapters (RolloutService.LoadAdapter) each rollout server holds at most "
        "beside the run's own policy; 0: none. One more is refused with RESOURCE_EXHAUSTED.",
        ge=0,
    )
    max_adapter_mib: float = setting(
        1024.0,
        help="Memory each rollout server gives named LoRA adapters' tensors, in MiB; a load "
        "beyond it is refused with RESOURCE_EXHAUSTED.",
        gt=0,
    )
    max_concurrent_rollouts: int | None = setting(
        None,
        help="Prompts generating at once over all servers; None: staleness.batch_size (AReaL's "
        "default).",
        ge=1,
    )


@dataclass
class NormSettings:
    """Mean/std normalisation of rewards or advantages (AReaL's NormConfig, same meaning).

    x -> (x - mean) / (std + eps), each statistic over ``*_level``: GRPO is group/group,
    Dr.GRPO group/none, RLOO group/none with ``mean_leave1out``, LitePPO group/batch,
    REINFORCE++ batch/batch; none/none leaves the values as they are.
    """

    mean_level: NormLevel = setting(
        "group",
        help="Where the mean is taken: per trajectory group, over the global batch, or none (no "
        "centring).",
    )
    std_level: NormLevel = setting(
        "group",
        help="Where the std is taken: per trajectory group, over the global batch, or none "
        "(divide by 1 and drop eps).",
    )
    mean_leave1out: bool = setting(
        False,
        help="The mean of the *other* members of the group (RLOO's baseline).",
    )
    std_unbiased: bool = setting(True, help="n - 1 in the std's denominator.")
    eps: float = setting(1e-5, help="Added to the std before dividing.", ge=0.0)


@dataclass
class RejectionSettings:
    """The behaviour importance weight exp(prox - behaviour) and the tokens it rejects
    (AReaL's rejection_sampling): ``metric`` per token ("ratio" of the probabilities, Schulman's
    KL estimators "kl_k1".."kl_k3" of it, or KPop's "binary_kl"), judged per token or per
    sequence (``level``, with ``agg`` of the sequence's values), outside ``[lower, upper]``
    masked or (ratio only) clamped into it. The default is the cap exp(prox - behaviour) <= 5;
    IcePop adds lower 0.5; metric "none": no weight.
    """

    metric: RejectionMetric = setting(
        "ratio",
        help="What is measured per token: the ratio exp(prox - behaviour), a KL estimator of it "
        "(kl_k1..kl_k3), KPop's binary_kl; none: no behaviour weight at all.",
    )
    level: ImportanceSamplingLevel = setting(
        "token",
        help="Judge each token, or a whole sequence by agg of its tokens' values.",
    )
    action: RejectionAction = setting(
        "mask",
        help="What happens to what falls outside [lower, upper]: dropped from the loss (mask), "
        "or, for metric ratio, its weight clamped into the bounds (clamp).",
    )
    agg: RejectionAgg = setting(
        "mean",
        help="How a sequence's token values are combined at level sequence (for ratio, of the "
        "log-ratios: mean is the geometric mean ratio).",
    )
    lower: float | None = setting(
        None,
        help="Lower bound of the metric (a ratio for metric ratio); null: none.",
    )
    upper: float = setting(5.0, help="Upper bound of the metric (a ratio for metric ratio).")


@dataclass
class PPOSettings:
    """GRPO / decoupled-PPO actor settings (AReaL's defaults where it has one)."""

    eps_clip: float = setting(
        0.2,
        help="PPO's clip range: the ratio is clipped to [1 - eps_clip, 1 + eps_clip_higher].",
        gt=0,
    )
    eps_clip_higher: float | None = setting(
        None, help="Upper clip (clip-higher); None: eps_clip.", gt=0
    )
    c_clip: float | None = setting(None, help="Dual-clip constant (> 1); None disables it.")
    rejection: RejectionSettings = setting(
        factory=RejectionSettings,
        help="Which tokens the decoupled loss trusts: the behaviour importance weight "
        "exp(prox - behaviour) and the tokens it rejects.",
    )
    reward_norm: NormSettings = setting(
        factory=NormSettings,
        help="Normalisation of the (shaped) sequence rewards before they become advantages: "
        "GRPO's per-group mean and std by default.",
    )
    adv_norm: NormSettings = setting(
        factory=lambda: NormSettings("none", "none"),
        help="Extra normalisation of the token advantages; none, as in the measured GRPO runs.",
    )
    reward_bias: float = setting(
        0.0,
        help="Rewards are (r + overlong penalty + reward_bias) * reward_scale, clipped to "
        "+-reward_clip, before norms.",
    )
    reward_scale: float = setting(
        1.0,
        help="Rewards are multiplied by this after the bias (see reward_bias).",
    )
    reward_clip: float = setting(20.0, help="Shaped rewards are clipped to +-reward_clip.", gt=0)
    kl_ctl: float = setting(
        0.0,
        help="KL-to-reference penalty in the token rewards, -kl_ctl * KL summed from each token "
        "on (0: none; else the reference model is loaded on every rank).",
        ge=0.0,
    )
    kl_estimator: KlEstimator = setting(
        "k1",
        help="KL estimator of the penalty (Schulman's k1, k2, k3).",
    )
    kl_loss_coef: float = setting(
        0.0,
        help="KL to the reference (initial) model as a loss term, beta * KL per trained token, "
        "instead of or beside the reward penalty kl_ctl; either one loads the reference "
        "model.",
        ge=0.0,
    )
    kl_loss_estimator: KlEstimator = setting(
        "k3",
        help="KL estimator of the loss term kl_loss_coef (k3 is unbiased and never negative).",
    )
    n_minibatches: int = setting(
        1,
        help="PPO mini-batches: the batch is cut into n_minibatches token-balanced slices (the "
        "same count on every rank), one optimizer step each, and passed over `epochs` "
        "times; the policy version still advances once per batch. More than one update per "
        "batch recomputes the proximal log-probs before the first (one extra forward pass).",
        ge=1,
    )
    epochs: int = setting(1, help="Passes over the batch's mini-batches (see n_minibatches).", ge=1)
    prox_logp_method: ProxLogpMethod = setting(
        "recompute",
        help="The proximal log-probs when several updates (or dropout) make them cost a forward "
        'pass: "recompute" (that pass), "loglinear" (interpolated by version, no pass),'
        ' "metrics" (recompute, and report loglinear\'s error as prox_approx_* step '
        "stats).",
    )
    importance_sampling_level: ImportanceSamplingLevel = setting(
        "token",
        help='"token" ratios, or "sequence": GSPO\'s one ratio per sequence (exp of its mean '
        "token log-ratio) with the sequence's mean advantage.",
    )
    loss_agg: LossAggregation = setting(
        "token_mean",
        help='Token losses to the step\'s loss: "token_mean" over the batch, "seq_mean" (each'
        ' sequence\'s token mean, averaged), "constant" (token sum over loss_constant_len '
        "x sequences, Dr.GRPO; loss_constant_len 0: rollout.sampling.max_new_tokens).",
    )
    loss_constant_len: int = setting(
        0,
        help="The constant of loss_agg constant (0: rollout.sampling.max_new_tokens).",
        ge=0,
    )
    overlong_max_len: int = setting(
        0,
        help="DAPO's overlong penalty, added to the raw reward (before bias and scale): 0 up to "
        "overlong_max_len - overlong_cache response tokens, then down linearly to "
        "-overlong_factor at overlong_max_len and beyond (overlong_max_len 0: off).",
        ge=0,
    )
    overlong_cache: int = setting(
        0,
        help="Response tokens over which the overlong penalty ramps down (see overlong_max_len).",
        ge=0,
    )
    overlong_factor: float = setting(
        1.0,
        help="The overlong penalty at and beyond overlong_max_len, in reward units (see "
        "overlong_max_len).",
    )


@dataclass
class OptimizerSettings:
    """The trainer's optimizer: AdamW, a warm-up then constant or decaying learning rate, and
    gradient-norm clipping."""

    lr: float = setting(1e-3, help="AdamW's learning rate (peak, after warm-up).", gt=0)
    weight_decay: float = setting(
        0.0, help="AdamW's weight decay (the measured runs used none).", ge=0.0
    )
    warmup_steps: int = setting(
        0,
        help="Linear warm-up of the learning rate over this many steps (0: none).",
        ge=0,
    )
    lr_schedule: LrSchedule = setting(
        "constant",
        help="After warm-up: constant, or a linear or cosine decay to lr x min_lr_ratio at "
        "total_steps.",
    )
    min_lr_ratio: float = setting(
        0.0,
        help="The linear / cosine schedule decays to lr x min_lr_ratio at total_steps.",
    )
    grad_clip: float = setting(1.0, help="Global gradient-norm clip.", gt=0)


@dataclass
class TrainerConfig:
    """The trainer ranks (one SPMD group) and the optimiser."""

    ranks: int = setting(
        2, help="Trainer ranks: one SPMD group sharding the model with FSDP2.", ge=1
    )
    torch_threads: int = setting(1, help="Torch CPU threads of each rank.", ge=1)
    backend: Backend = setting(
        "auto",
        help="The ranks' process-group backend; auto: gloo on CPU, nccl on GPU.",
    )
    device: Device = setting(
        "auto",
        help="Where the ranks train; auto: a GPU per rank when there are any, else the CPU.",
    )
    optimizer: OptimizerSettings = setting(
        factory=OptimizerSettings, help="AdamW, its learning-rate schedule and gradient clipping."
    )
    max_tokens_per_mb: int = setting(
        16384,
        help="Tokens per micro-batch at most (rows are packed by first-fit-decreasing; a longer "
        "row gets one alone).",
        ge=1,
    )
    dtype: Dtype = setting(
        "float32",
        help="Parameter (and optimizer state) dtype; float64 for exactness checks.",
    )
    mixed_precision: MixedPrecision = setting(
        "auto",
        help="bf16 compute (FSDP2's parameter casts, or autocast without FSDP) with weights, "
        "optimizer state, log-probs, the loss and gradient reduction in trainer.dtype; auto: on "
        "where the hardware has fast bf16 units (a CUDA GPU, a CPU with AMX-BF16 or "
        "AVX512-BF16) and trainer.dtype is float32.",
    )
    prefix_sharing: MixedPrecision = setting(
        "auto",
        help="Compute each prefix the rows of a group share once: the group's rows go through "
        "the model as one tree (a trie of their tokens, each token attending to its "
        "ancestors), with the same log-probs, loss and gradients; auto: on where that is exact "
        "(attention sdpa or eager, no sliding-window layers).",
    )
    fsdp: bool = setting(
        True,
        help="Shard the model with FSDP2 in a process group; false: one plain process (one rank "
        "only).",
    )
    collective_timeout_s: float = setting(
        600.0,
        help="Deadline of one collective inside a rank (gloo/NCCL timeout).",
        gt=0,
    )
    ppo: PPOSettings = setting(factory=PPOSettings, help="The GRPO / decoupled-PPO objective.")


@dataclass
class RolloutSupervision:
    """How the coordinator watches the rollout servers: stalls, health, restarts."""

    episode_timeout_s: float = setting(
        1800.0,
        help="A server holding a task longer than this is taken as stalled: out of rotation, its"
        " work re-queued elsewhere. Generous: one episode of a long workflow may take "
        "minutes.",
        gt=0,
    )
    health_interval_s: float = setting(
        5.0,
        help="Liveness check of every server in rotation: a server whose health check fails (or "
        "does not answer within health_timeout_s) is treated like a stalled one.",
        ge=0.0,
    )
    health_timeout_s: float = setting(
        5.0,
        help="Seconds a server's health check may take (see health_interval_s).",
        gt=0,
    )
    max_restarts: int = setting(
        3,
        help="Restarts of rollout servers that died (their process is gone, or they stayed out "
        "of rotation too long), over the whole run and all servers; local and Ray launchers"
        " only.",
        ge=0,
    )
    replace_after_s: float = setting(
        60.0,
        help="A launcher's server that still runs but has been out of rotation this long is "
        "replaced (stopped, a fresh one started) instead of waited for; one whose process "
        "is gone at once.",
        gt=0,
    )
    no_server_timeout_s: float = setting(
        300.0,
        help="With no server left in rotation for this long, the run fails instead of waiting "
        "forever.",
        gt=0,
    )
    max_failed_episodes: int = setting(
        64,
        help="Episodes failed in a row in the run's own code (its workflow, reward or dataset "
        "items), none accepted in between, after which the run stops with the last error (a "
        "reward or workflow that raises on every item); one now and then is forgotten at the "
        "next accepted group. A rollout server or engine that dies fails no episode: its "
        "work is run again elsewhere.",
        ge=1,
    )


@dataclass
class TrainerSupervision:
    """How the coordinator watches the trainer group: call deadlines, health, restarts."""

    call_timeout_s: float = setting(
        3600.0,
        help="Deadline of each collective call to the ranks (TrainStep, checkpoints, export): a "
        "rank that hangs (rather than dies) fails the call instead of stopping the run for "
        "good.",
        gt=0,
    )
    max_restarts: int = setting(
        3,
        help="Restarts of a failed trainer group (from the latest checkpoint) before the run "
        "fails.",
        ge=0,
    )
    restart_timeout_s: float = setting(
        300.0,
        help="How long a restarted group may take to come back (attach mode: restarted by its "
        "own supervisor, e.g. torchrun) before the run fails.",
        gt=0,
    )
    health_interval_s: float = setting(
        10.0,
        help="During a collective call the ranks' health is checked this often (0: never): a "
        "rank that hangs (frozen, not dead) fails the call within about interval + timeout "
        "instead of call_timeout_s, and the group is restarted.",
        ge=0.0,
    )
    health_timeout_s: float = setting(
        10.0,
        help="Seconds a rank's health check may take (see health_interval_s).",
        gt=0,
    )


@dataclass
class FaultToleranceConfig:
    """What the coordinator does when a server stalls, hangs or dies."""

    rollout: RolloutSupervision = setting(
        factory=RolloutSupervision, help="The rollout servers' supervision."
    )
    trainer: TrainerSupervision = setting(
        factory=TrainerSupervision, help="The trainer group's supervision."
    )


@dataclass
class StalenessConfig:
    """Asynchrony: how far rollouts may run ahead of training."""

    max_staleness: int = setting(
        2,
        help="eta: a rollout is trained at most this many versions after it started; 0 is "
        "synchronous.",
        ge=0,
    )
    batch_size: int = setting(32, help="Prompts (groups) per training step.", ge=1)
    group_size: int = setting(8, help="Samples per prompt.", ge=1)
    lease_ttl_s: float = setting(
        60.0,
        help="Seconds an external producer's lease (AcquireRollout, a gateway session) lasts "
        "since it was taken or last renewed (RenewRollout; the gateway renews while a "
        "session works): an abandoned lease frees its capacity after this long.",
    )


@dataclass
class WeightSyncConfig:
    """How new weights reach the rollout servers."""

    enabled: bool = setting(
        True,
        help="Send each new version to the rollout servers; false keeps their initial weights "
        "(only for debugging the loop: the run cannot learn, and versions advance on the "
        "trainers alone).",
    )
    methods: list[WeightSyncMethod] = setting(
        factory=list,
        help="The methods offered, in this order; each server accepts the first it supports. "
        "Empty: the trainer's order for its device (docs/concepts/weight-sync.md): "
        "shared_memory, distributed, socket, stream, disk on CPU; distributed first on GPU.",
    )
    timeout_s: float = setting(
        600.0,
        help="Seconds one fleet update may take before the step fails.",
        gt=0,
    )
    disk_root: str | None = setting(
        None,
        help="Root for the disk method; None: <output.dir>/weights.",
    )
    keep_versions: int = setting(
        2, help="Versions kept under disk_root (older ones are pruned).", ge=1
    )
    bucket_mb: float = setting(
        64.0,
        help="Parameters are gathered and sent in buckets of this many MiB.",
        gt=0,
    )
    master_addr: str | None = setting(
        None,
        help="Address rollout servers use to reach trainer rank 0's weight group (None: its gRPC"
        " host).",
    )
    backend: Backend = setting(
        "auto",
        help='Backend of the distributed method\'s group: "auto" is nccl on GPU, gloo on CPU.',
    )

    def accepted_methods(self) -> tuple[str, ...]:
        """The methods the run may use: those listed, or every one when none is."""
        return tuple(self.methods or WEIGHT_SYNC_METHODS)


# The checkpoint id a Tinker run's state is saved under every tinker.autosave_steps steps
# (tinker://<run>/weights/autosave to the SDK).
TINKER_AUTOSAVE_ID = "state.autosave"


@dataclass
class TinkerConfig:
    """The Tinker-compatible LoRA training service (python -m areal_grpc.tinker): many
    tenants' LoRA runs on model.source, driven by the official tinker SDK over HTTP or by
    LoraTrainingService over gRPC."""

    host: str = setting("127.0.0.1", help="Interface the HTTP face and the gRPC service bind.")
    port: int = setting(
        0,
        help="Port of the HTTP face the tinker SDK talks to (printed as TINKER "
        "http://host:port); 0: any free port.",
        ge=0,
    )
    grpc_port: int = setting(0, help="Port of LoraTrainingService (gRPC); 0: any free port.", ge=0)
    tenants_file: str | None = setting(
        None,
        help="A JSON object mapping each tenant's name to its API key (keys start with tml-, "
        "as the SDK requires); null: one tenant, 'default', whose key is printed.",
    )
    root: str | None = setting(
        None, help="Where checkpoints are written (and only there); null: <output.dir>/tinker."
    )
    max_runs_per_tenant: int = setting(8, help="Training runs a tenant may hold at once.", ge=1)
    max_queued_per_tenant: int = setting(
        64, help="Calls a tenant may have queued; more are refused (429).", ge=1
    )
    max_adapter_mib_per_tenant: float = setting(
        1024.0,
        help="Trainer memory a tenant's adapters and optimizer states may take (MiB).",
        gt=0.0,
    )
    autosave_steps: int = setting(
        10,
        help="Every this many optim_steps a run's state (adapter and optimizer) is saved as "
        "tinker://<run>/weights/autosave, replacing the last one, so that a run outlives a "
        "crash of the training service up to that step; 0: never.",
        ge=0,
    )
    samplers_per_run: int = setting(
        4, help="Sampler checkpoints of a run kept in memory (the newest).", ge=1
    )
    retry_after_s: float = setting(
        1.0, help="The retry delay a quota refusal names (RetryInfo, Retry-After).", gt=0.0
    )
    rollout_addresses: list[str] = setting(
        factory=list,
        help="Rollout servers (host:port, serving model.source with rollout.max_adapters > 0) "
        "that every sampler checkpoint is loaded on as a named adapter; sample calls go to "
        "them in turn (those with stop strings or prompt log-probs stay here). Empty: the "
        "service samples on its own model.",
    )
    trainer_ranks: int = setting(
        1,
        help="Ranks of the trainer group that trains every run: 1, the service alone; N > 1, "
        "the service and N-1 worker processes, each holding the base model and a replica of "
        "every run, split each forward_backward's datums by token count and sum the "
        "gradients over gloo. A worker that dies or stalls is replaced and the call rerun.",
        ge=1,
    )
    trainer_timeout_s: float = setting(
        300.0,
        help="How long a trainer rank may keep a collective waiting before the group counts it "
        "as stalled and replaces the workers (tinker.trainer_ranks > 1).",
        gt=0.0,
    )
    batch_calls: bool = setting(
        True,
        help="Queued sample and forward-only calls of different runs go through the base model "
        "as one batch, each row with its own adapter, in round-robin order; each call gets "
        "what it gets alone (false: one call at a time).",
    )


@dataclass
class GatewaySettings:
    """The OpenAI-compatible agent gateway (areal-gateway) the coordinator may start."""

    enabled: bool = setting(
        False,
        help="Start the gateway beside the run (data.task external trains on what its sessions "
        "submit).",
    )
    host: str = setting("127.0.0.1", help="Interface the gateway listens on.")
    port: int = setting(
        0,
        help="Port the gateway listens on; 0: any free port (printed as GATEWAY "
        "http://host:port/v1).",
    )
    api_key_env: str = setting(
        "AREAL_GATEWAY_API_KEY",
        help="Environment variable holding the bearer token clients must send (unset: no auth).",
    )
    max_tokens: int = setting(256, help="The max_tokens of requests that give none.", ge=1)
    chat_template: str = setting(
        "",
        help="A Jinja chat template file used instead of the model's own (e.g. one that renders "
        '`tools` for a model whose template does not); "": the model\'s, else the default '
        "one.",
    )
    generate_timeout_s: float = setting(
        1800.0,
        help="Seconds one completion may take at its rollout server before the request fails "
        "(504). As long as fault_tolerance.rollout.episode_timeout_s: on a busy 2-core "
        "machine the agent example's completions took over 300 s.",
    )


@dataclass
class EvalConfig:
    """Evaluation on the task's eval split (greedy)."""

    every_steps: int = setting(
        25,
        help="Greedy held-out evaluation every this many steps (0: never).",
        ge=0,
    )
    max_prompts: int | None = setting(
        None,
        help="Eval prompts per evaluation at most; null: the whole eval split.",
        ge=1,
    )


@dataclass
class CheckpointConfig:
    """Recovery checkpoints and the final export."""

    every_steps: int = setting(
        50, help="A recovery checkpoint every this many steps (0: none).", ge=0
    )
    dir: str | None = setting(None, help="Where checkpoints go; null: <output.dir>/checkpoints.")
    export_hf: bool = setting(True, help="Write a Hugging Face model at the end.")


@dataclass
class OutputConfig:
    """Where metrics and logs go."""

    dir: str = setting(
        "outputs/run",
        help="Metrics (metrics.jsonl), logs, plots, checkpoints and exports go under this "
        "directory.",
    )
    log_level: LogLevel = setting(
        "INFO",
        help="The log level of every process of the run.",
    )
    tensorboard: bool = setting(
        False,
        help="TensorBoard event files under dir/tensorboard: the metrics, and each step's "
        "rollouts samples as text (needs the tensorboard package).",
    )
    wandb: bool = setting(
        False,
        help="Weights & Biases: the metrics (as TensorBoard's train/*, eval/*, against "
        "'step'), and each step's rollouts samples as a table (needs the wandb package: pip "
        "install -e '.[wandb]'). Its files go under dir/wandb, or WANDB_DIR.",
    )
    wandb_project: str | None = setting(
        None, help="The W&B project; null: WANDB_PROJECT, else areal-grpc."
    )
    wandb_name: str | None = setting(
        None, help="The W&B run's name; null: WANDB_NAME, else a name W&B makes up."
    )
    wandb_mode: WandbMode = setting(
        "auto",
        help="offline: W&B keeps the run on disk only (upload it later with wandb sync); "
        "online: it uploads as the run goes (needs a W&B login); auto: WANDB_MODE, else "
        "offline.",
    )
    plot: bool = setting(True, help="Write reward and eval plots (PNG) under dir at the end.")
    progress_bar: bool = setting(True, help="Show a progress bar on a terminal.")
    rollouts_per_step: int = setting(
        2,
        help="Groups of each step's batch whose trajectories are written to "
        "dir/rollouts/step-<step>.jsonl (prompt and completion as text and token ids, reward, "
        "advantage, finish reason, per-token versions and log-probs), shown by python -m "
        "areal_grpc.inspect; 0: none.",
        ge=0,
    )
    rollouts_max_mb: float = setting(
        64.0,
        help="The rollouts directory holds at most this many MiB; later steps are not "
        "written once it is full (a warning says so).",
        gt=0.0,
    )


@dataclass
class RaySettings:
    """ray mode (``launcher.mode: ray``): the cluster and how the servers are placed on it."""

    address: str | None = setting(
        None,
        help='The cluster: host:port of the head\'s GCS, "auto" for the one `ray start` made on '
        "this machine, or ray://host:port; null starts a private Ray instance on this machine "
        "(stopped with the run).",
    )
    nodes: int = setting(
        1,
        help="One placement-group bundle per node; the servers (trainer ranks first, then "
        "rollout servers) are dealt to the bundles in contiguous blocks.",
        ge=1,
    )
    strategy: RayStrategy = setting("PACK", help="The placement group's strategy.")
    start_timeout_s: float = setting(
        300.0,
        help="How long placement and the servers' start may take before the run fails.",
        gt=0,
    )


@dataclass
class SlurmSettings:
    """slurm mode: the job that ``python -m areal_grpc.coordinator.submit`` writes and
    submits (None: the cluster's default)."""

    nodes: int = setting(1, help="Nodes of the job.", ge=1)
    time: str = setting("01:00:00", help="The job's time limit (e.g. 01:00:00, 1-02:00:00).")
    partition: str | None = setting(None, help="The partition; null: the cluster's default.")
    account: str | None = setting(None, help="The account; null: the cluster's default.")
    gres: str | None = setting(None, help="Generic resources per node (e.g. gpu:8); null: none.")


@dataclass
class AttachSettings:
    """attach mode: servers started by someone else, used as they are."""

    rollout_addresses: list[str] = setting(factory=list, help="One host:port per rollout server.")
    trainer_addresses: list[str] = setting(
        factory=list, help="One host:port per trainer rank, in rank order."
    )


@dataclass
class LauncherConfig:
    """Start the mesh here (local), on a Ray cluster (ray), as job steps of the Slurm
    allocation the coordinator runs in (slurm), or use running servers (attach)."""

    mode: LaunchMode = setting(
        "local",
        help="Where the servers run: started here (local), on a Ray cluster (ray), as steps of "
        "the Slurm allocation (slurm), or already running (attach).",
    )
    host: str = setting(
        "127.0.0.1",
        help="Interface the servers and the coordinator listen on, and the address they give "
        "each other.",
    )
    coordinator_port: int = setting(
        0,
        help="Port of the coordinator's own gRPC service (external producers connect here); 0: "
        "any free.",
    )
    rollout_cpus: float = setting(
        1.0,
        help="CPUs each rollout server reserves: Ray's logical resources in ray mode (Ray "
        "schedules by these; a server may use more or less), its job step's CPUs in slurm "
        "mode.",
        ge=0.0,
    )
    rollout_gpus: float = setting(
        0.0,
        help="GPUs each rollout server reserves (see rollout_cpus; its gres in slurm mode).",
        ge=0.0,
    )
    trainer_cpus: float = setting(
        1.0, help="CPUs each trainer rank reserves (see rollout_cpus).", ge=0.0
    )
    trainer_gpus: float = setting(
        0.0, help="GPUs each trainer rank reserves (see rollout_cpus).", ge=0.0
    )
    attach: AttachSettings = setting(
        factory=AttachSettings, help="attach mode: the running servers to use."
    )
    ray: RaySettings = setting(factory=RaySettings, help="ray mode: the cluster and placement.")
    slurm: SlurmSettings = setting(
        factory=SlurmSettings, help="slurm mode: the job the submit command writes."
    )


@dataclass
class SecurityConfig:
    """TLS, mutual TLS and the bearer token of every process of the run (servers and clients).

    All None/False (the default) is plaintext, which the servers accept only on loopback.
    """

    tls_cert: str | None = setting(
        None,
        help="This process's certificate chain (PEM): every server of the run serves with it "
        "and, with mutual_tls, every client presents it.",
    )
    tls_key: str | None = setting(None, help="The private key (PEM) of tls_cert.")
    tls_ca: str | None = setting(
        None,
        help="CA (PEM) that signed the servers' certificates; clients verify servers against it,"
        " and with mutual_tls servers verify clients against it.",
    )
    mutual_tls: bool = setting(
        False,
        help="Servers require, and clients present, certificates signed by tls_ca.",
    )
    auth_token_file: str | None = setting(
        None,
        help="File holding the bearer token every call must carry; None: $AREAL_AUTH_TOKEN if set.",
    )
    allow_plaintext: bool = setting(
        False,
        help="Serve without TLS on a non-loopback launcher.host.",
    )


@dataclass
class RunConfig:
    """A whole run."""

    name: str = setting("builtin", help="The run's name (in its logs, metrics and traces).")
    algorithm: Algorithm = setting(
        "grpo",
        help="A named algorithm: its preset, configs/algorithms/<name>.yaml, is applied "
        "first, then the files and the overrides; --print-config shows the result.",
    )
    total_steps: int = setting(400, help="Training steps (policy versions) of the run.", ge=1)
    model: ModelConfig = setting(factory=ModelConfig, help="The policy.")
    data: DataConfig = setting(factory=DataConfig, help="The prompts.")
    rollout: RolloutConfig = setting(factory=RolloutConfig, help="The rollout servers.")
    trainer: TrainerConfig = setting(
        factory=TrainerConfig,
        help="The trainer ranks and the objective.",
    )
    staleness: StalenessConfig = setting(
        factory=StalenessConfig,
        help="How far rollouts may run ahead of training.",
    )
    weight_sync: WeightSyncConfig = setting(
        factory=WeightSyncConfig,
        help="How new weights reach the rollout servers.",
    )
    eval: EvalConfig = setting(factory=EvalConfig, help="Held-out evaluation.")
    checkpoint: CheckpointConfig = setting(
        factory=CheckpointConfig,
        help="Checkpoints and the final export.",
    )
    output: OutputConfig = setting(factory=OutputConfig, help="Where the run writes.")
    launcher: LauncherConfig = setting(
        factory=LauncherConfig,
        help="Where and how the servers are started.",
    )
    security: SecurityConfig = setting(factory=SecurityConfig, help="TLS and bearer tokens.")
    fault_tolerance: FaultToleranceConfig = setting(
        factory=FaultToleranceConfig,
        help="What the coordinator does when a server stalls, hangs or dies.",
    )
    gateway: GatewaySettings = setting(
        factory=GatewaySettings,
        help="The OpenAI-compatible agent gateway.",
    )
    tinker: TinkerConfig = setting(
        factory=TinkerConfig,
        help="The Tinker-compatible LoRA training service (python -m areal_grpc.tinker).",
    )


# -- loading ---------------------------------------------------------------------------------


# Keys that earlier versions read, and what replaced them (named in the unknown-key error).
REPLACED_KEYS = {
    **{
        f"{owner}.{k}": f"fault_tolerance.{owner}.{k}"
        for owner, cls in (("rollout", RolloutSupervision), ("trainer", TrainerSupervision))
        for k in cls.__dataclass_fields__
    },
    **{f"trainer.{k}": f"trainer.optimizer.{k}" for k in OptimizerSettings.__dataclass_fields__},
    **{f"launcher.ray_{k}": f"launcher.ray.{k}" for k in RaySettings.__dataclass_fields__},
    **{f"launcher.slurm_{k}": f"launcher.slurm.{k}" for k in SlurmSettings.__dataclass_fields__},
    **{f"launcher.{k}": f"launcher.attach.{k}" for k in AttachSettings.__dataclass_fields__},
    "trainer.ppo.behav_imp_weight_cap": "trainer.ppo.rejection.upper (null: rejection.metric=none)",
    "trainer.ppo.behav_imp_weight_mode": "trainer.ppo.rejection.action",
    "rollout.sglang_urls": "rollout.sglang.urls",
    "rollout.vllm.dtype": "rollout.dtype",
    "rollout.sglang.dtype": "rollout.dtype",
}


def _omegaconf_error(exc: OmegaConfBaseException, fallback: str) -> FieldError:
    key = getattr(exc, "full_key", None) or fallback
    first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    choice = re.fullmatch(r"Invalid value (.*), expected one of \[(.*)\]", first_line)
    if choice:
        # A Literal setting's value outside its choices: said as every other rule says it.
        allowed = ", ".join(c.strip().strip("'") for c in choice.group(2).split(","))
        return FieldError(key, f"must be one of {allowed}; got {choice.group(1)}")
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
        raise FieldError(
            override, "an override must look like key=value, e.g. trainer.optimizer.lr=5e-4"
        )
    try:
        # The YAML reading of the value, as on the command line of most tools: 3 -> int,
        # [a,b] -> list, null -> None.
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise FieldError(key, f"cannot parse value {raw!r}: {exc}") from exc
    return key, value


def load_config(
    path: str | Sequence[str] | None,
    overrides: Sequence[str] = (),
    *,
    sections: Sequence[str] | None = None,
) -> RunConfig:
    """The run config: defaults, the named algorithm's preset, then the YAML file at ``path``
    (or each of several files, in order, the last winning), then ``overrides``.

    A path may also be the document itself, a YAML/JSON mapping starting with ``{`` (how a
    launcher hands a server its run config). ``sections``: what :func:`validate_config`
    checks (default: the whole run).
    """
    paths = [] if path is None else [path] if isinstance(path, str) else list(path)
    files = [(_where(p), _read_file(p)) for p in paths]
    parsed = [_parse_override(o) for o in overrides]
    # The algorithm's settings go under everything the user set: find its name first.
    algorithm = "grpo"
    for _, data in files:
        algorithm = str(data.get("algorithm", algorithm))
    for key, value in parsed:
        if key == "algorithm":
            algorithm = str(value)
    cfg = _merge(OmegaConf.structured(RunConfig), algorithm_settings(algorithm), "algorithm")
    for where, data in files:
        cfg = _merge(cfg, _on_off(data, RunConfig), where)
    for key, value in parsed:
        # One override at a time, so an error names the override's key even when OmegaConf
        # does not (e.g. a scalar given for a whole section).
        cfg = _merge(cfg, _on_off(_nested(key, value), RunConfig), key)
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        # e.g. an interpolation "${...}" that does not resolve.
        raise _omegaconf_error(exc, "config") from exc
    if not isinstance(obj, RunConfig):
        raise TypeError(f"expected RunConfig, got {type(obj).__name__}")
    validate_config(obj, sections)
    return obj


def _on_off(data: Any, cls: type) -> Any:
    """``data`` (a section of ``cls``) with YAML's booleans read back as "on" / "off" where
    the setting's choices are those words: YAML 1.1 reads a bare ``off`` as false."""
    if not isinstance(data, dict) or not is_dataclass(cls):
        return data
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for key, value in data.items():
        hint = hints.get(key) if isinstance(key, str) else None
        if hint is None:
            continue
        if isinstance(value, bool) and typing.get_origin(hint) is Literal:
            if {"on", "off"} <= set(get_args(hint)):
                out[key] = "on" if value else "off"
        elif isinstance(hint, type) and is_dataclass(hint):
            out[key] = _on_off(value, hint)
    return out


def _where(path: str) -> str:
    """How errors name a config source: its path, or "config" for an inline document."""
    return "config" if path.lstrip().startswith("{") else path


def _read_file(path: str) -> dict[str, Any]:
    """The mapping a config file (or inline document) holds; FieldError names a bad one."""
    inline = path.lstrip().startswith("{")
    try:
        text = path if inline else Path(path).read_text()
    except OSError as exc:
        raise FieldError(path, f"cannot read the config file: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise FieldError(_where(path), f"not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise FieldError(
            _where(path), f"the top level must be a mapping, got {type(data).__name__}"
        )
    return data


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


def _bounds(f: Any) -> list[str]:
    """A field's declared numeric bounds as text (">= 1", "> 0"), as setting() records them."""
    out = []
    if f.metadata["ge"] is not None:
        out.append(f">= {f.metadata['ge']}")
    if f.metadata["gt"] is not None:
        out.append(f"> {f.metadata['gt']}")
    return out


def describe(prefix: str = "") -> str:
    """Each setting at or under the dotted key ``prefix`` ("": all) with its default, its
    choices and its help text, one paragraph per setting; ValueError for an unknown key."""
    out = []

    def walk(section: Any, path: str) -> None:
        for f in fields(section):
            key, value = f"{path}{f.name}", getattr(section, f.name)
            inside = not prefix or key == prefix or key.startswith(prefix + ".")
            if is_dataclass(value):
                if inside:
                    out.append(f"{key}: {f.metadata['help']}")
                if inside or prefix.startswith(key + "."):
                    walk(value, key + ".")
                continue
            if inside:
                line = f"{key} = {json.dumps(value)}"
                if choices := choices_of(type(section), f.name):
                    line += f"  (one of: {', '.join(choices)})"
                line += "".join(f"  ({b})" for b in _bounds(f))
                help_text = textwrap.fill(
                    f.metadata["help"], 96, initial_indent="    ", subsequent_indent="    "
                )
                out.append(f"{line}\n{help_text}")

    walk(RunConfig(), "")
    if not out:
        raise ValueError(f"no setting {prefix!r}")
    return "\n".join(out) + "\n"


def reference_markdown() -> str:
    """The configuration reference as Markdown: per section its settings, their defaults,
    rules and help text (docs/reference/config.md is this, regenerated by
    ``scripts/gen-docs``)."""

    def rules(owner: type, f: Any) -> str:
        out = []
        if choices := choices_of(owner, f.name):
            out.append("one of " + ", ".join(f"`{c}`" for c in choices))
        return "; ".join([*out, *_bounds(f)])

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [
        "# Configuration reference",
        "",
        "Generated from the fields of `areal_grpc/config.py` by `scripts/gen-docs`; do not edit.",
        "Every setting is a dotted key: in a YAML file given with `--config` (repeatable, the",
        "last wins), or as `key=value` on the command line. `python -m areal_grpc.coordinator",
        "--explain KEY` prints the same for one key or section.",
    ]

    def section(obj: Any, path: str, title: str, doc: str) -> None:
        lines.extend(["", f"## {title}", "", doc, ""])
        lines.extend(["| key | default | rule | meaning |", "|---|---|---|---|"])
        nested = []
        for f in fields(obj):
            value = getattr(obj, f.name)
            key = f"{path}{f.name}"
            if is_dataclass(value):
                nested.append((value, f"{key}.", f"`{key}`", f.metadata["help"]))
                continue
            default = cell(json.dumps(value))
            rule = rules(type(obj), f)
            lines.append(f"| `{key}` | `{default}` | {rule} | {cell(f.metadata['help'])} |")
        for args in nested:
            section(*args)

    run = RunConfig()
    top = [f for f in fields(run) if not is_dataclass(getattr(run, f.name))]
    lines.extend(["", "## The run", "", "| key | default | rule | meaning |", "|---|---|---|---|"])
    for f in top:
        default = cell(json.dumps(getattr(run, f.name)))
        rule = rules(RunConfig, f)
        lines.append(f"| `{f.name}` | `{default}` | {rule} | {cell(f.metadata['help'])} |")
    for f in fields(run):
        value = getattr(run, f.name)
        if is_dataclass(value):
            section(value, f"{f.name}.", f"`{f.name}`", f.metadata["help"])
    return "\n".join(lines) + "\n"


# -- validation ------------------------------------------------------------------------------


def _check_fields(section: Any, prefix: str, *, nested: bool = True) -> None:
    """Every field of ``section`` (and, if ``nested``, of its subsections) keeps the rules it
    declares (see :func:`setting`): one of its choices (a list: each element), its bounds."""
    for f in fields(section):
        value, key = getattr(section, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            if nested:
                _check_fields(value, f"{key}.")
            continue
        choices = choices_of(type(section), f.name)
        for i, item in enumerate(value) if isinstance(value, list) else [(None, value)]:
            if choices and item not in choices:
                where = key if i is None else f"{key}[{i}]"
                raise FieldError(where, f"must be one of {', '.join(choices)}; got {item!r}")
        if value is None:
            continue
        if f.metadata.get("ge") is not None:
            _at_least(key, value, f.metadata["ge"])
        if f.metadata.get("gt") is not None and not value > f.metadata["gt"]:
            raise FieldError(key, f"must be > {f.metadata['gt']}, got {value}")


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


def _validate_run(cfg: RunConfig) -> None:
    if not cfg.name:
        raise FieldError("name", "must not be empty")


def _validate_model(cfg: RunConfig) -> None:
    if not cfg.model.source:
        raise FieldError("model.source", "must not be empty")
    lora = cfg.model.lora
    if lora.rank:
        if not 0.0 <= lora.dropout < 1.0:
            raise FieldError("model.lora.dropout", f"must be in [0, 1), got {lora.dropout}")
        if not lora.target_modules or not all(lora.target_modules):
            raise FieldError("model.lora.target_modules", "must name at least one module")


def _validate_data(cfg: RunConfig) -> None:
    if not cfg.data.task:
        raise FieldError("data.task", "must not be empty")
    if cfg.data.eval_path is not None and cfg.data.path is None:
        raise FieldError("data.eval_path", "needs data.path (the train items)")
    if cfg.data.task == EXTERNAL_TASK and cfg.data.path is not None:
        raise FieldError("data.path", "data.task=external has no items of its own")
    if cfg.data.task == EXTERNAL_TASK:
        return
    if cfg.data.path is None and cfg.data.task not in TASKS:
        known = ", ".join(sorted(TASKS))
        raise FieldError(
            "data.task", f"{cfg.data.task!r} is not built in ({known}); its items go in data.path"
        )
    if cfg.rollout.reward == "task":
        # The same lookup the reward makes on every episode, so that what loads also scores.
        try:
            reward_fn_for_task(cfg.data.task)
        except ValueError as exc:
            others = ", ".join(sorted(n for n in REWARD_FNS if n != "task"))
            raise FieldError(
                "rollout.reward",
                f"'task' (the default) scores by data.task, and {exc}. Set rollout.reward to "
                f"one of {others} or an import path 'pkg.mod:name'",
            ) from None


def _validate_rollout(cfg: RunConfig) -> None:
    r = cfg.rollout
    for name in ("workflow", "reward"):
        if not getattr(r, name):
            raise FieldError(f"rollout.{name}", "must not be empty")
    if not 0.0 < r.sampling.top_p <= 1.0:
        raise FieldError("rollout.sampling.top_p", f"must be in (0, 1], got {r.sampling.top_p}")
    # Attach mode starts no rollout servers, so it hands out no SGLang URLs either.
    urls = r.sglang.urls
    if (
        cfg.launcher.mode != "attach"
        and r.engine == "sglang"
        and urls
        and len(urls) != r.num_servers
    ):
        raise FieldError(
            "rollout.sglang.urls",
            f"engine sglang attaches one SGLang server per rollout server (rollout.num_servers = "
            f"{r.num_servers}), got {len(urls)} URL(s); empty: each launches its own",
        )
    v = r.vllm
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
    if not 0.0 <= t.optimizer.min_lr_ratio <= 1.0:
        raise FieldError(
            "trainer.optimizer.min_lr_ratio",
            f"must be in [0, 1], got {t.optimizer.min_lr_ratio}",
        )
    p = t.ppo
    if p.c_clip is not None and not p.c_clip > 1.0:
        raise FieldError("trainer.ppo.c_clip", f"must be > 1 when set, got {p.c_clip}")
    _validate_rejection(p.rejection)
    for name, norm in (("reward_norm", p.reward_norm), ("adv_norm", p.adv_norm)):
        if norm.mean_leave1out and norm.mean_level != "group":
            raise FieldError(
                f"trainer.ppo.{name}.mean_leave1out",
                f"needs mean_level group (the other members of the group), got {norm.mean_level}",
            )
    if p.overlong_cache > p.overlong_max_len:
        raise FieldError(
            "trainer.ppo.overlong_cache",
            f"{p.overlong_cache} exceeds overlong_max_len {p.overlong_max_len}",
        )


def _validate_rejection(r: RejectionSettings) -> None:
    key = "trainer.ppo.rejection"
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
    if not 0 < g.generate_timeout_s < float("inf"):
        raise FieldError("gateway.generate_timeout_s", f"must be > 0, got {g.generate_timeout_s}")


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
    if (
        cfg.rollout.engine == "sglang"
        and cfg.model.lora.rank > 0
        and set(cfg.weight_sync.accepted_methods()) <= {"distributed"}
    ):
        raise FieldError(
            "weight_sync.methods",
            "SGLang takes LoRA adapters from disk or stream updates only, not distributed ones",
        )
    if len(set(w.methods)) != len(w.methods):
        raise FieldError("weight_sync.methods", f"lists a method twice: {w.methods}")
    if w.master_addr is not None and not w.master_addr:
        raise FieldError("weight_sync.master_addr", "must not be empty (leave it unset instead)")


def _validate_eval(cfg: RunConfig) -> None:
    if cfg.data.task == EXTERNAL_TASK and cfg.eval.every_steps:
        raise FieldError(
            "eval.every_steps",
            "data.task=external has no held-out items to evaluate: set eval.every_steps=0",
        )


def _validate_output(cfg: RunConfig) -> None:
    if not cfg.output.dir:
        raise FieldError("output.dir", "must not be empty")


def _validate_launcher(cfg: RunConfig) -> None:
    r, t = cfg.rollout, cfg.trainer
    la = cfg.launcher
    if not la.host:
        raise FieldError("launcher.host", "must not be empty")
    if not 0 <= la.coordinator_port < 65536:
        raise FieldError(
            "launcher.coordinator_port", f"must be in 0-65535, got {la.coordinator_port}"
        )
    for key in ("rollout_addresses", "trainer_addresses"):
        for i, addr in enumerate(getattr(la.attach, key)):
            _address(f"launcher.attach.{key}[{i}]", addr)
    if not re.fullmatch(r"(\d+-)?\d+(:\d{1,2}){0,2}", la.slurm.time):
        raise FieldError(
            "launcher.slurm.time",
            f"must be a Slurm time limit like 01:00:00, got {la.slurm.time!r}",
        )
    if la.mode == "ray" and la.ray.nodes > r.num_servers + t.ranks:
        raise FieldError(
            "launcher.ray.nodes",
            f"{la.ray.nodes} bundles for {r.num_servers + t.ranks} servers would leave "
            "a bundle empty",
        )
    if la.ray.address is not None and not la.ray.address:
        raise FieldError("launcher.ray.address", "must not be empty (leave it unset instead)")
    if la.mode == "attach":
        if len(la.attach.rollout_addresses) != r.num_servers:
            raise FieldError(
                "launcher.attach.rollout_addresses",
                f"attach mode needs one address per rollout server (rollout.num_servers = "
                f"{r.num_servers}), got {len(la.attach.rollout_addresses)}",
            )
        if len(la.attach.trainer_addresses) != t.ranks:
            raise FieldError(
                "launcher.attach.trainer_addresses",
                f"attach mode needs one address per trainer rank (trainer.ranks = {t.ranks}), "
                f"got {len(la.attach.trainer_addresses)}",
            )


def _validate_tinker(cfg: RunConfig) -> None:
    for key in ("port", "grpc_port"):
        if getattr(cfg.tinker, key) > 65535:
            raise FieldError(f"tinker.{key}", f"must be in 0-65535, got {getattr(cfg.tinker, key)}")
    if not cfg.tinker.host:
        raise FieldError("tinker.host", "must not be empty")


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
    "checkpoint": lambda cfg: None,
    "output": _validate_output,
    "security": lambda cfg: _validate_security(cfg.security),
    "fault_tolerance": lambda cfg: None,
    "launcher": _validate_launcher,
    "gateway": _validate_gateway,
    "tinker": _validate_tinker,
}


def validate_config(cfg: RunConfig, sections: Sequence[str] | None = None) -> None:
    """Checks ranges, choices and cross-field rules of ``sections`` (default: all, the whole
    run); raises FieldError naming the first bad key.

    A server checks only the sections it uses: a trainer on another node need not see the
    coordinator's data files.
    """
    for name in sections if sections is not None else SECTION_CHECKS:
        if name == "run":
            _check_fields(cfg, "", nested=False)
        else:
            _check_fields(getattr(cfg, name), f"{name}.")
        SECTION_CHECKS[name](cfg)


def _files_exist(section: str, obj: Any, keys: Sequence[str]) -> None:
    for key in keys:
        value = getattr(obj, key)
        if value is not None and not Path(value).is_file():
            raise FieldError(f"{section}.{key}", f"no such file: {value!r}")


def _preflight_security(cfg: RunConfig) -> None:
    sec = cfg.security
    _files_exist("security", sec, ("tls_cert", "tls_key", "tls_ca", "auth_token_file"))
    if sec.auth_token_file is not None and not Path(sec.auth_token_file).read_text().strip():
        raise FieldError("security.auth_token_file", f"{sec.auth_token_file!r} is empty")


def _preflight_gateway(cfg: RunConfig) -> None:
    if cfg.gateway.chat_template:
        read_chat_template(cfg.gateway.chat_template)


def _preflight_output(cfg: RunConfig) -> None:
    if cfg.output.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise FieldError(
            "output.tensorboard", "needs the tensorboard package (pip install tensorboard)"
        )
    if cfg.output.wandb and importlib.util.find_spec("wandb") is None:
        raise FieldError("output.wandb", "needs the wandb package (pip install -e '.[wandb]')")


def _preflight_tinker(cfg: RunConfig) -> None:
    path = cfg.tinker.tenants_file
    if path is not None:
        read_tenants(path)


# What a section names outside the config (files, packages), checked where the process that
# uses it launches: a config is valid on a machine that lacks them (--print-config, a submit
# host, a test), and a trainer on another node need not see the coordinator's data files.
PREFLIGHT_CHECKS: dict[str, Callable[[RunConfig], None]] = {
    "data": lambda cfg: _files_exist("data", cfg.data, ("path", "eval_path")),
    "gateway": _preflight_gateway,
    "output": _preflight_output,
    "security": _preflight_security,
    "tinker": _preflight_tinker,
}


def preflight(cfg: RunConfig, sections: Sequence[str] | None = None) -> None:
    """Checks that the files and packages ``sections`` name (default: the whole run's) are
    here; raises FieldError naming the first missing one."""
    for name in sections if sections is not None else SECTION_CHECKS:
        if name in PREFLIGHT_CHECKS:
            PREFLIGHT_CHECKS[name](cfg)


def read_tenants(path: str) -> dict[str, str]:
    """``tinker.tenants_file``: tenant name -> API key, checked (FieldError naming it)."""
    key = "tinker.tenants_file"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise FieldError(key, f"{path!r} cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict) or not data:
        raise FieldError(key, f"{path!r} must hold a JSON object of tenant name -> API key")
    for name, api_key in data.items():
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}", name):
            raise FieldError(key, f"tenant name {name!r}: letters, digits, ._- (at most 64)")
        if not isinstance(api_key, str) or not api_key.startswith("tml-") or len(api_key) < 20:
            raise FieldError(
                key, f"tenant {name!r}: the key must be a string starting tml- (20+ characters)"
            )
    if len(set(data.values())) != len(data):
        raise FieldError(key, "two tenants share a key")
    return dict(data)
