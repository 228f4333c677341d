"""A multi-tenant LoRA training engine: one frozen base model, many named adapters.

This is the compute core of a Tinker-compatible training service. Every training run owns one
peft LoRA adapter on a single shared :class:`peft.PeftModel` (one copy of the base weights),
its own ``torch.optim.AdamW`` holding only that adapter's parameters, and any number of frozen
sampler snapshots (further peft adapters that never train).

Isolation between runs rests on three things, each checked by the unit tests:

* before every forward pass the engine activates exactly one adapter (``set_adapter``) and
  sets ``requires_grad`` itself on every adapter it manages: only the run being trained
  requires gradients, so autograd never writes another run's ``.grad``;
* peft's LoRA layers only compute the active adapter, so another run's weights never enter
  the graph (and a snapshot or the base model is what it claims to be when sampling);
* a run's optimizer is built over that run's parameters only, so its ``step`` touches
  nothing else.

The engine is not thread-safe: one worker thread calls it (the gRPC servicer's).

Data are token-native and aligned as in Tinker: position ``i`` of ``input_tokens`` predicts
``target_tokens[i]``, and every per-token list (weights, logprobs, advantages) has one value
per input position. Losses are summed over all tokens of all datums, never averaged.

Calls that compute no gradient (sampling, forward-only passes) can run together, one batch
with a different adapter per row (peft's ``adapter_names``): :meth:`LoraEngine.sample_batch`
and :meth:`LoraEngine.forward_batch`. Each call's rows are computed as when it runs alone,
up to float rounding of a padded, wider batch: sampling keeps one generator per sequence
(seeded ``seed + i``, as alone), and temperature, top-p and top-k apply per call.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import logging
import math
import secrets
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from areal_grpc.errors import FieldError, PreconditionError
from areal_grpc.model import load_model, load_tokenizer
from areal_grpc.named_adapters import rows_adapters
from areal_grpc.sampling import MIN_TEMPERATURE

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "LORA_ALPHA",
    "LOSS_CONFIG_DEFAULTS",
    "LOSS_FIELDS",
    "AdamParams",
    "AdapterSpec",
    "Datum",
    "ForwardJob",
    "ForwardOutput",
    "LoraEngine",
    "SampleJob",
    "SampleOutput",
    "SampledSequence",
    "UnknownIdError",
    "read_saved_spec",
]

log = logging.getLogger(__name__)

# LoRA's alpha is fixed (the update is scaled by LORA_ALPHA / rank), as in Tinker, so a
# learning rate does not need retuning when the rank changes.
LORA_ALPHA = 32.0

# The config keys each loss accepts, with their defaults.
LOSS_CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.05},
}

# The per-token Datum fields each loss needs (target_tokens is always needed).
LOSS_FIELDS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
}

_PER_TOKEN_FLOATS = ("weights", "logprobs", "advantages")

# Files of a saved state directory.
_ADAPTER_FILE = "adapter_model.safetensors"
_PEFT_CONFIG_FILE = "adapter_config.json"
_STATE_FILE = "lora_state.json"
_OPTIMIZER_FILE = "optimizer.pt"
_STATE_FORMAT = 1

# Module-name parts that mark a decoder block's attention and MLP submodules.
_ATTN_PARTS = ("self_attn", "attn", "attention", "self_attention")
_MLP_PARTS = ("mlp", "feed_forward", "ffn")


class UnknownIdError(LookupError):
    """A run id or sampler id that the engine does not hold."""


@dataclass
class AdapterSpec:
    """What a training run asks for: the LoRA rank and which linear layers it adapts.

    ``train_unembed`` adds a LoRA on the output projection (``lm_head``). With tied input and
    output embeddings (the built-in models, SmolLM2) the adapter changes the output projection
    only; the input embedding, which shares the frozen base weight, is not adapted.
    ``seed`` seeds the adapter's init (LoRA A; B starts at zero); None uses the engine's seed.
    """

    rank: int = 32
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = False
    seed: int | None = None


@dataclass
class Datum:
    """One training sequence: ``input_tokens[i]`` predicts ``target_tokens[i]``."""

    input_tokens: list[int]
    target_tokens: list[int]
    weights: list[float] | None = None
    logprobs: list[float] | None = None
    advantages: list[float] | None = None


@dataclass
class AdamParams:
    """AdamW hyperparameters of one optim_step (decoupled weight decay, as torch.optim.AdamW).

    ``grad_clip_norm`` > 0 clips the run's gradients to that global L2 norm first.
    """

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class SampledSequence:
    """One sampled completion; ``stop_reason`` is ``"stop"`` or ``"length"``."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str


@dataclass
class SampleJob:
    """One sampling call (the arguments of :meth:`LoraEngine.sample`), for a batch of them."""

    sampler_id: str | None
    prompt: Sequence[int]
    num_samples: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: Sequence[int] | None = None
    stop: Sequence[str] = ()
    prompt_logprobs: bool = False


# The completions and, when asked for, the prompt's log-probs.
SampleOutput = tuple[list[SampledSequence], list[float] | None]


@dataclass
class ForwardJob:
    """One forward-only call (:meth:`LoraEngine.forward_backward` with ``forward_only``)."""

    run_id: str
    data: Sequence[Datum]
    loss_fn: str
    config: Mapping[str, float] = field(default_factory=dict)


# Each datum's log-probs per position, and the metrics.
ForwardOutput = tuple[list[list[float]], dict[str, float]]


@dataclass(eq=False)
class _Adapter:
    """A peft adapter the engine manages: its internal peft name and its live parameters."""

    internal: str
    spec: AdapterSpec
    # peft checkpoint key (adapter name removed) -> the live parameter, in module order.
    params: dict[str, torch.nn.Parameter]


@dataclass(eq=False)
class _Run(_Adapter):
    optimizer: torch.optim.AdamW | None = None
    steps: int = 0
    snapshots: set[str] = field(default_factory=set)


@dataclass(eq=False)
class _Snapshot(_Adapter):
    run_id: str = ""


@dataclass(eq=False)
class _SamplePlan:
    """A checked sampling call and its sequences so far."""

    job: SampleJob
    ids: torch.Tensor  # the prompt, on the engine's device
    adapter: _Adapter | None
    stops: set[int]
    greedy: bool
    scale: float  # logits are divided by it (1 when greedy)
    generators: list[torch.Generator]  # one per sequence (none when greedy)
    tokens: list[list[int]]
    logprobs: list[list[float]]
    reasons: list[str | None]
    prompt_lp: list[float] | None = None

    def finished(self, row: int) -> bool:
        return self.reasons[row] is not None or len(self.tokens[row]) >= self.job.max_tokens

    def all_finished(self) -> bool:
        return all(self.finished(row) for row in range(self.job.num_samples))

    def output(self) -> SampleOutput:
        sequences = [
            SampledSequence(tokens, lps, reason or "length")
            for tokens, lps, reason in zip(self.tokens, self.logprobs, self.reasons, strict=True)
        ]
        return sequences, self.prompt_lp


@dataclass
class _Prepared:
    """A validated datum as tensors on the engine's device."""

    inputs: torch.Tensor
    targets: torch.Tensor
    fields: dict[str, torch.Tensor]


def read_saved_spec(directory: Path) -> AdapterSpec:
    """The AdapterSpec a :meth:`LoraEngine.save_state` directory was saved from.

    A servicer restoring a run creates it with this spec, then calls ``load_state``.
    """
    meta = _read_state_meta(Path(directory))
    return AdapterSpec(**meta["spec"])


def _read_state_meta(directory: Path) -> dict[str, Any]:
    path = directory / _STATE_FILE
    if not path.is_file():
        raise ValueError(f"directory: {directory} holds no saved LoRA state ({_STATE_FILE})")
    try:
        meta = json.loads(path.read_text())
        spec = meta["spec"]
        AdapterSpec(**spec)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"directory: {path} is not a valid LoRA state file: {exc}") from exc
    if meta.get("format") != _STATE_FORMAT:
        raise ValueError(f"directory: {path} has format {meta.get('format')!r}")
    return meta


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(name, f"expected a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise FieldError(name, f"must be finite, got {number}")
    return number


def _clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().clone()


def _clone_state(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """A copy of one parameter's optimizer state (its tensors cloned); None stays None."""
    if state is None:
        return None
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


class LoraEngine:
    """Many LoRA training runs over one frozen base model (see the module docstring).

    ``model_source`` is anything :func:`areal_grpc.model.load_model` reads (``builtin:micro``,
    a checkpoint directory, a named model). ``max_batch_tokens`` bounds the padded tokens of
    one forward pass; a forward_backward over more data runs several and sums them.
    """

    def __init__(
        self,
        model_source: str,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        max_batch_tokens: int = 4096,
    ) -> None:
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens: must be >= 1, got {max_batch_tokens}")
        self.base_model: str = model_source
        self.device = torch.device(device)
        self.dtype = dtype
        # Log-probs, losses and norms: float32 at least, float64 in a float64 engine.
        self.math_dtype = torch.promote_types(dtype, torch.float32)
        self.seed = seed
        self.max_batch_tokens = max_batch_tokens
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(model_source)
        model = load_model(model_source, seed=seed, dtype=dtype)
        model.requires_grad_(False)
        self._base: PreTrainedModel = model.to(self.device).eval()
        self._peft: PeftModel | None = None
        self.vocab_size: int = int(self._base.config.vocab_size)
        # The longest sequence (prompt + completion) the model is built for.
        self.max_context_length: int = int(
            getattr(self._base.config, "max_position_embeddings", None) or 2048
        )
        eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = getattr(self._base.config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        self.eos_token_id: int | None = eos
        self._targets = self._find_targets(self._base)
        # transformers renamed ``past_key_values`` to ``cache`` (argument and output field).
        renamed = "cache" in inspect.signature(type(self._base).forward).parameters
        self._cache_arg = "cache" if renamed else "past_key_values"
        self._cache_field = self._cache_arg
        self._runs: dict[str, _Run] = {}
        self._snapshots: dict[str, _Snapshot] = {}
        self._names = itertools.count()

    # ------------------------------------------------------------------ adapters

    @staticmethod
    def _find_targets(model: torch.nn.Module) -> dict[str, list[str]]:
        """The base model's linear layers by group: attn, mlp, unembed (full module names)."""
        groups: dict[str, list[str]] = {"attn": [], "mlp": [], "unembed": []}
        output = model.get_output_embeddings()  # type: ignore[operator]
        for name, module in model.named_modules():
            if output is not None and module is output:
                groups["unembed"].append(name)
                continue
            if not isinstance(module, torch.nn.Linear):
                continue
            parts = name.split(".")[:-1]
            if any(part in _ATTN_PARTS for part in parts):
                groups["attn"].append(name)
            elif any(part in _MLP_PARTS for part in parts):
                groups["mlp"].append(name)
        return groups

    def target_modules(self, spec: AdapterSpec) -> list[str]:
        """The base model's module names a LoRA with ``spec`` adapts (ValueError if none)."""
        self._check_spec(spec)
        names: list[str] = []
        for group, wanted in (
            ("attn", spec.train_attn),
            ("mlp", spec.train_mlp),
            ("unembed", spec.train_unembed),
        ):
            if not wanted:
                continue
            if not self._targets[group]:
                raise ValueError(f"spec.train_{group}: the model has no {group} linear layers")
            names += self._targets[group]
        if not names:
            raise ValueError("spec: train_attn, train_mlp and train_unembed are all false")
        return names

    @staticmethod
    def _check_spec(spec: AdapterSpec) -> None:
        if not isinstance(spec, AdapterSpec):
            raise ValueError(f"spec: expected an AdapterSpec, got {type(spec).__name__}")
        if not _is_int(spec.rank) or spec.rank < 1:
            raise ValueError(f"spec.rank: must be an integer >= 1, got {spec.rank!r}")
        for name in ("train_attn", "train_mlp", "train_unembed"):
            if not isinstance(getattr(spec, name), bool):
                raise ValueError(f"spec.{name}: must be a bool")
        if spec.seed is not None and not _is_int(spec.seed):
            raise ValueError(f"spec.seed: must be an integer or None, got {spec.seed!r}")

    def _lora_config(self, spec: AdapterSpec) -> LoraConfig:
        from peft import LoraConfig

        return LoraConfig(
            r=spec.rank,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=self.target_modules(spec),
            bias="none",
            task_type="CAUSAL_LM",
        )

    def _add_peft_adapter(self, spec: AdapterSpec, prefix: str) -> tuple[str, dict[str, Any]]:
        """Adds a freshly initialised peft adapter; returns its internal name and params."""
        from peft import get_peft_model

        config = self._lora_config(spec)
        internal = f"{prefix}_{next(self._names)}"
        seed = self.seed if spec.seed is None else spec.seed
        with warnings.catch_warnings():
            # Tied lm_head (we never merge), transformers' deprecations seen through peft.
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            warnings.filterwarnings("ignore", category=FutureWarning)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                if self._peft is None:
                    self._peft = get_peft_model(self._base, config, adapter_name=internal)  # type: ignore[assignment]
                else:
                    self._peft.add_adapter(internal, config)
        assert self._peft is not None
        self._peft.eval()
        marker = f".{internal}."
        params = {}
        for name, param in self._peft.named_parameters():
            if marker in name:
                param.requires_grad_(False)
                params[name.replace(marker, ".")] = param
        return internal, params

    def _remove_peft_adapter(self, internal: str) -> None:
        assert self._peft is not None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*was active which is now deleted.*")
            self._peft.delete_adapter(internal)

    def _run(self, run_id: str) -> _Run:
        run = self._runs.get(run_id)
        if run is None:
            raise UnknownIdError(f"unknown run {run_id!r}")
        return run

    @property
    def run_ids(self) -> list[str]:
        """The training runs the engine holds."""
        return sorted(self._runs)

    @property
    def sampler_ids(self) -> list[str]:
        """The sampler snapshots the engine holds."""
        return sorted(self._snapshots)

    def create(self, run_id: str, spec: AdapterSpec) -> int:
        """Adds run ``run_id``'s adapter (B = 0, so it computes the base model at first).

        Returns the adapter's trainable parameter count. ValueError on a duplicate run id or
        a bad spec.
        """
        if not isinstance(run_id, str) or not run_id:
            raise ValueError("run_id: must be a non-empty string")
        if run_id in self._runs:
            raise ValueError(f"run_id: run {run_id!r} already exists")
        self.target_modules(spec)  # validates the spec
        spec = AdapterSpec(**asdict(spec))
        internal, params = self._add_peft_adapter(spec, "run")
        optimizer = torch.optim.AdamW(list(params.values()), lr=AdamParams().learning_rate)
        self._runs[run_id] = _Run(internal, spec, params, optimizer)
        return sum(p.numel() for p in params.values())

    def delete(self, run_id: str) -> None:
        """Frees run ``run_id``'s adapter, its optimizer and its sampler snapshots."""
        run = self._run(run_id)
        for sampler_id in sorted(run.snapshots):
            self.delete_snapshot(sampler_id)
        self._remove_peft_adapter(run.internal)
        run.optimizer = None
        run.params.clear()
        del self._runs[run_id]

    def parameters(self, run_id: str) -> dict[str, torch.nn.Parameter]:
        """Run ``run_id``'s live adapter parameters by peft checkpoint key (do not mutate)."""
        return dict(self._run(run_id).params)

    def optimizer(self, run_id: str) -> torch.optim.AdamW:
        """Run ``run_id``'s optimizer (introspection; the engine steps it)."""
        optimizer = self._run(run_id).optimizer
        assert optimizer is not None
        return optimizer

    def steps(self, run_id: str) -> int:
        """How many optim_steps run ``run_id`` has taken (restored by load_state)."""
        return self._run(run_id).steps

    def adapter_bytes(self, run_id: str) -> int:
        """Memory of run ``run_id``'s adapter: parameters, pending gradients, optimizer state."""
        run = self._run(run_id)
        total = 0
        for param in run.params.values():
            total += param.numel() * param.element_size()
            if param.grad is not None:
                total += param.grad.numel() * param.grad.element_size()
        if run.optimizer is not None:
            for state in run.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        total += value.numel() * value.element_size()
        return total

    # ------------------------------------------------------------------ activation

    def _set_trainable(self, trained: _Adapter | None) -> None:
        """Only ``trained``'s parameters require gradients (none when it is None)."""
        for adapter in itertools.chain(self._runs.values(), self._snapshots.values()):
            flag = adapter is trained
            for param in adapter.params.values():
                if param.requires_grad != flag:
                    param.requires_grad_(flag)

    @contextlib.contextmanager
    def _use(self, adapter: _Adapter | None, *, train: bool) -> Iterator[torch.nn.Module]:
        """The model computing ``adapter`` alone (the base model when None)."""
        if adapter is None:
            self._set_trainable(None)
            peft = self._peft
            if peft is None or not peft.peft_config:
                yield self._base
                return
            active = peft.active_adapter
            if not isinstance(active, str) or active not in peft.peft_config:
                # disable_adapter() looks up the active adapter's config (none after deletes).
                peft.set_adapter(next(iter(peft.peft_config)))
            try:
                with peft.disable_adapter():
                    yield peft
            finally:
                self._set_trainable(None)
            return
        assert self._peft is not None
        self._peft.set_adapter(adapter.internal)
        self._set_trainable(adapter if train else None)
        yield self._peft

    # ------------------------------------------------------------------ training

    def check_data(
        self, data: Sequence[Datum], loss_fn: str, config: Mapping[str, float] | None
    ) -> dict[str, float]:
        """Checks a forward_backward's arguments; returns the loss config with its defaults.

        The one check of training data: the service calls it before queuing a call (so a bad
        datum is refused at once), and :meth:`forward_backward` calls it again before any
        gradient changes. It reads no adapter state, so any thread may call it. A problem
        raises :class:`FieldError` (a ValueError) naming the field, e.g.
        ``data[1].weights`` or ``config.beta``.
        """
        if loss_fn not in LOSS_CONFIG_DEFAULTS:
            known = ", ".join(sorted(LOSS_CONFIG_DEFAULTS))
            raise FieldError("loss_fn", f"unknown loss {loss_fn!r}; known: {known}")
        cfg = self._check_config(loss_fn, config or {})
        if isinstance(data, (str, bytes)) or not isinstance(data, Sequence) or not data:
            raise FieldError("data", "need at least one Datum")
        for index, datum in enumerate(data):
            self._check_datum(f"data[{index}]", datum, loss_fn)
        return cfg

    @staticmethod
    def _check_config(loss_fn: str, config: Mapping[str, float]) -> dict[str, float]:
        defaults = LOSS_CONFIG_DEFAULTS[loss_fn]
        cfg = dict(defaults)
        for key, value in config.items():
            if key not in defaults:
                allowed = ", ".join(sorted(defaults)) or "none"
                why = f"unknown key {key!r} for loss {loss_fn!r} (accepted: {allowed})"
                raise FieldError(f"config.{key}", why)
            cfg[key] = _finite(f"config.{key}", value)
        if "clip_low_threshold" in cfg:
            low, high = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
            if not 0.0 <= low <= high:
                raise FieldError(
                    "config.clip_low_threshold",
                    f"need 0 <= clip_low_threshold <= clip_high_threshold, got {low} and {high}",
                )
        if cfg.get("beta", 0.0) < 0.0:
            raise FieldError("config.beta", f"must be >= 0, got {cfg['beta']}")
        return cfg

    def _check_datum(self, where: str, datum: Datum, loss_fn: str) -> None:
        if not isinstance(datum, Datum):
            raise FieldError(where, f"expected a Datum, got {type(datum).__name__}")
        self._check_tokens(f"{where}.input_tokens", datum.input_tokens)
        length = len(datum.input_tokens)
        if length == 0:
            raise FieldError(f"{where}.input_tokens", "empty")
        if length > self.max_context_length:
            raise FieldError(
                f"{where}.input_tokens",
                f"{length} tokens; the model takes at most {self.max_context_length}",
            )
        self._check_tokens(f"{where}.target_tokens", datum.target_tokens)
        if len(datum.target_tokens) != length:
            raise FieldError(
                f"{where}.target_tokens", f"{len(datum.target_tokens)} values for {length} tokens"
            )
        needed = LOSS_FIELDS[loss_fn]
        for name in _PER_TOKEN_FLOATS:
            values = getattr(datum, name)
            key = f"{where}.{name}"
            if values is None:
                if name in needed:
                    raise FieldError(key, f"required by loss {loss_fn!r}")
                continue
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
                raise FieldError(key, "expected a list of numbers")
            if len(values) != length:
                raise FieldError(key, f"{len(values)} values for {length} tokens")
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
                raise FieldError(key, "expected a list of numbers")
            if not all(math.isfinite(v) for v in values):
                raise FieldError(key, "values must be finite")

    def _prepare(self, data: Sequence[Datum], loss_fn: str) -> list[_Prepared]:
        """Checked data (:meth:`check_data`) as tensors on the engine's device."""
        needed = LOSS_FIELDS[loss_fn]
        return [
            _Prepared(
                torch.tensor(list(d.input_tokens), dtype=torch.long, device=self.device),
                torch.tensor(list(d.target_tokens), dtype=torch.long, device=self.device),
                {
                    name: torch.tensor(getattr(d, name), dtype=self.math_dtype, device=self.device)
                    for name in needed
                },
            )
            for d in data
        ]

    def _check_tokens(self, where: str, tokens: object) -> None:
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
            raise FieldError(where, "expected a list of token ids")
        if not all(_is_int(t) for t in tokens):
            raise FieldError(where, "token ids must be integers")
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise FieldError(where, f"token id {bad} out of the vocabulary [0, {self.vocab_size})")

    def _token_tensor(self, where: str, tokens: object) -> torch.Tensor:
        self._check_tokens(where, tokens)
        return torch.tensor(list(tokens), dtype=torch.long)  # type: ignore[call-overload]

    def _micro_batches(self, prepared: list[_Prepared]) -> Iterator[list[_Prepared]]:
        batch: list[_Prepared] = []
        longest = 0
        for item in prepared:
            length = item.inputs.numel()
            if batch and (len(batch) + 1) * max(longest, length) > self.max_batch_tokens:
                yield batch
                batch, longest = [], 0
            batch.append(item)
            longest = max(longest, length)
        if batch:
            yield batch

    def _token_logprobs(
        self,
        model: torch.nn.Module,
        batch: list[_Prepared],
        adapter_names: list[str] | None = None,
    ) -> torch.Tensor:
        """log_softmax(logits)[target] of every real token of ``batch``, flattened in order.

        ``adapter_names``: one peft adapter per row (a mixed batch; no gradients)."""
        lengths = [item.inputs.numel() for item in batch]
        width = max(lengths)
        ids = torch.zeros(len(batch), width, dtype=torch.long, device=self.device)
        targets = torch.zeros_like(ids)
        mask = torch.zeros(len(batch), width, dtype=torch.bool, device=self.device)
        for row, item in enumerate(batch):
            ids[row, : lengths[row]] = item.inputs
            targets[row, : lengths[row]] = item.targets
            mask[row, : lengths[row]] = True
        with self._rows_use(adapter_names):
            logits = model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits
        logits = logits[mask].to(self.math_dtype)
        picked = logits.gather(-1, targets[mask].unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)

    @staticmethod
    def _loss(
        loss_fn: str, lp: torch.Tensor, fields: Mapping[str, torch.Tensor], cfg: Mapping[str, float]
    ) -> torch.Tensor:
        """The summed per-token loss (see the module docstring for the formulas)."""
        if loss_fn == "cross_entropy":
            return -(lp * fields["weights"]).sum()
        old, adv = fields["logprobs"], fields["advantages"]
        if loss_fn == "dro":
            return -(lp * adv - 0.5 * cfg["beta"] * (lp - old) ** 2).sum()
        ratio = torch.exp(lp - old)
        if loss_fn == "importance_sampling":
            return -(ratio * adv).sum()
        clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        if loss_fn == "ppo":
            return -torch.minimum(ratio * adv, clipped * adv).sum()
        if loss_fn == "cispo":
            return -(clipped.detach() * lp * adv).sum()
        raise AssertionError(loss_fn)

    def forward_backward(
        self,
        run_id: str,
        data: Sequence[Datum],
        loss_fn: str,
        config: Mapping[str, float],
        *,
        forward_only: bool = False,
    ) -> tuple[list[list[float]], dict[str, float]]:
        """The loss of ``data`` under run ``run_id``'s adapter; its gradients accumulate.

        Losses (lp: this pass's log-probability of the target, q: ``logprobs``,
        A: ``advantages``, r = exp(lp - q), all summed over every token of every datum):
        cross_entropy -sum(lp * weights); importance_sampling -sum(r * A); ppo
        -sum(min(r * A, clamp(r, low, high) * A)); cispo -sum(sg(clamp(r, low, high)) * lp * A);
        dro -sum(lp * A - beta / 2 * (lp - q)^2).

        Everything is validated before any gradient changes (ValueError names the field).
        Returns each datum's lp per position and ``{"loss:sum", "tokens:sum"}``.
        ``forward_only`` leaves gradients untouched.
        """
        run = self._run(run_id)
        cfg = self.check_data(data, loss_fn, config)
        prepared = self._prepare(data, loss_fn)
        total = 0.0
        tokens = 0
        logprobs: list[list[float]] = []
        grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()
        with self._use(run, train=not forward_only) as model, grad_mode:
            for batch in self._micro_batches(prepared):
                lp = self._token_logprobs(model, batch)
                fields = {
                    name: torch.cat([item.fields[name] for item in batch])
                    for name in batch[0].fields
                }
                loss = self._loss(loss_fn, lp, fields, cfg)
                if not forward_only:
                    loss.backward()
                total += float(loss.detach())
                flat = lp.detach().cpu().tolist()
                start = 0
                for item in batch:
                    end = start + item.inputs.numel()
                    logprobs.append(flat[start:end])
                    start = end
                tokens += lp.numel()
        return logprobs, {"loss:sum": total, "tokens:sum": float(tokens)}

    def forward_batch(self, jobs: Sequence[ForwardJob]) -> list[ForwardOutput | Exception]:
        """Several forward-only calls, of any runs, in one batch (no gradient changes).

        Returns each call's result as ``forward_backward(..., forward_only=True)`` would (up
        to float rounding), or the exception it alone raised: a bad call fails by itself.
        Should the batch fail, each call is run alone.
        """
        outputs: list[ForwardOutput | Exception] = []
        checked: dict[int, tuple[_Run, dict[str, float], list[_Prepared]]] = {}
        for index, job in enumerate(jobs):
            try:
                run = self._run(job.run_id)
                cfg = self.check_data(job.data, job.loss_fn, job.config)
                checked[index] = (run, cfg, self._prepare(job.data, job.loss_fn))
                outputs.append(RuntimeError("not run"))
            except Exception as exc:
                outputs.append(exc)
        if len(checked) > 1:
            try:
                results = self._forward_mixed([jobs[i] for i in checked], list(checked.values()))
            except Exception:
                log.warning("a batch of %d forward calls failed; running each alone", len(checked))
            else:
                for index, result in zip(checked, results, strict=True):
                    outputs[index] = result
                return outputs
        for index in checked:
            job = jobs[index]
            try:
                outputs[index] = self.forward_backward(
                    job.run_id, job.data, job.loss_fn, job.config, forward_only=True
                )
            except Exception as exc:
                outputs[index] = exc
        return outputs

    def _forward_mixed(
        self,
        jobs: list[ForwardJob],
        checked: list[tuple[_Run, dict[str, float], list[_Prepared]]],
    ) -> list[ForwardOutput]:
        """Every checked call's datums in shared micro-batches, each row with its run's
        adapter; then each call's loss over its own tokens."""
        items = [item for _, _, prepared in checked for item in prepared]
        owners = [run for run, _, prepared in checked for _ in prepared]
        per_item: list[torch.Tensor] = []
        with self._use_mixed(owners) as (model, names), torch.no_grad():
            start = 0
            for batch in self._micro_batches(items):
                rows = None if names is None else names[start : start + len(batch)]
                lp = self._token_logprobs(model, batch, rows)
                per_item.extend(lp.split([item.inputs.numel() for item in batch]))
                start += len(batch)
        results: list[ForwardOutput] = []
        offset = 0
        for job, (_, cfg, prepared) in zip(jobs, checked, strict=True):
            mine = per_item[offset : offset + len(prepared)]
            offset += len(prepared)
            lp = torch.cat(mine)
            fields = {
                name: torch.cat([item.fields[name] for item in prepared])
                for name in prepared[0].fields
            }
            loss = self._loss(job.loss_fn, lp, fields, cfg)
            metrics = {"loss:sum": float(loss), "tokens:sum": float(lp.numel())}
            results.append(([t.cpu().tolist() for t in mine], metrics))
        return results

    @staticmethod
    def _check_adam(adam: AdamParams) -> None:
        if not isinstance(adam, AdamParams):
            raise ValueError(f"adam: expected AdamParams, got {type(adam).__name__}")
        for name in ("learning_rate", "eps", "weight_decay", "grad_clip_norm"):
            if _finite(f"adam.{name}", getattr(adam, name)) < 0:
                raise ValueError(f"adam.{name}: must be >= 0, got {getattr(adam, name)}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= _finite(f"adam.{name}", getattr(adam, name)) < 1.0:
                raise ValueError(f"adam.{name}: must be in [0, 1), got {getattr(adam, name)}")

    def optim_step(self, run_id: str, adam: AdamParams) -> dict[str, float]:
        """One AdamW step on run ``run_id``'s adapter with its accumulated gradients.

        Clips to ``grad_clip_norm`` first when > 0; zeroes the gradients after. A step whose
        gradient norm is not finite is skipped (gradients dropped, weights and optimizer state
        unchanged) and reported as ``skipped:sum`` 1. A step that would make a weight
        non-finite (``eps`` 0 over a zero gradient) or overflows (a huge ``learning_rate``) is
        undone and refused with a :class:`FieldError` naming ``adam``: nothing changes,
        gradients included.
        """
        run = self._run(run_id)
        self._check_adam(adam)
        optimizer = run.optimizer
        assert optimizer is not None
        params = list(run.params.values())
        grads = [p.grad for p in params if p.grad is not None]
        norm = 0.0
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g.to(self.math_dtype)) for g in grads])
            norm = float(torch.linalg.vector_norm(norms))
        skipped = not math.isfinite(norm)
        if not skipped:
            before = [
                (p.detach().clone(), _clone(p.grad), _clone_state(optimizer.state.get(p)))
                for p in params
            ]
            # As torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when < 1.
            coef = adam.grad_clip_norm / (norm + 1e-6)
            if adam.grad_clip_norm > 0 and coef < 1.0:
                for grad in grads:
                    grad.mul_(coef)
            for group in optimizer.param_groups:
                group["lr"] = adam.learning_rate
                group["betas"] = (adam.beta1, adam.beta2)
                group["eps"] = adam.eps
                group["weight_decay"] = adam.weight_decay
            try:
                optimizer.step()
                finite = all(bool(torch.isfinite(p).all()) for p in params)
            except RuntimeError as exc:
                # A setting so large that a scalar of the step overflows the weights' dtype.
                if "overflow" not in str(exc):
                    raise
                finite = False
            if not finite:
                # Non-finite weights would spoil every later call of the run: undo the step.
                with torch.no_grad():
                    for p, (weights, grad, state) in zip(params, before, strict=True):
                        p.copy_(weights)
                        p.grad = grad
                        if state is None:
                            optimizer.state.pop(p, None)
                        else:
                            optimizer.state[p] = state
                raise FieldError(
                    "adam",
                    f"the step would make the adapter's weights non-finite (learning_rate "
                    f"{adam.learning_rate}, eps {adam.eps}); nothing changed",
                )
            run.steps += 1
        optimizer.zero_grad(set_to_none=True)
        return {
            "grad_norm:mean": norm,
            "learning_rate:mean": float(adam.learning_rate),
            "skipped:sum": float(skipped),
        }

    # ------------------------------------------------------------------ snapshots

    def snapshot(self, run_id: str, sampler_id: str) -> None:
        """A frozen copy of run ``run_id``'s adapter, sampled as ``sampler_id``.

        Training continues on the live adapter; the snapshot never changes. Taking a snapshot
        under an id this run already used replaces it; an id of another run's is a ValueError.
        """
        run = self._run(run_id)
        if not isinstance(sampler_id, str) or not sampler_id:
            raise ValueError("sampler_id: must be a non-empty string")
        existing = self._snapshots.get(sampler_id)
        if existing is not None and existing.run_id != run_id:
            raise ValueError(f"sampler_id: {sampler_id!r} belongs to another run")
        internal, params = self._add_peft_adapter(run.spec, "snap")
        with torch.no_grad():
            for key, param in params.items():
                param.copy_(run.params[key])
        if existing is not None:
            self.delete_snapshot(sampler_id)
        self._snapshots[sampler_id] = _Snapshot(internal, run.spec, params, run_id)
        run.snapshots.add(sampler_id)

    def snapshot_adapter(self, sampler_id: str) -> tuple[dict[str, torch.Tensor], int, float]:
        """Sampler snapshot ``sampler_id`` as another engine loads it: its tensors by peft's
        saved names (copies on the CPU), its rank and its alpha."""
        snap = self._snapshots.get(sampler_id)
        if snap is None:
            raise UnknownIdError(f"unknown sampler {sampler_id!r}")
        tensors = {k: p.detach().to("cpu", copy=True) for k, p in snap.params.items()}
        return tensors, snap.spec.rank, LORA_ALPHA

    def delete_snapshot(self, sampler_id: str) -> None:
        """Frees sampler snapshot ``sampler_id``."""
        snap = self._snapshots.pop(sampler_id, None)
        if snap is None:
            raise UnknownIdError(f"unknown sampler {sampler_id!r}")
        self._remove_peft_adapter(snap.internal)
        owner = self._runs.get(snap.run_id)
        if owner is not None:
            owner.snapshots.discard(sampler_id)

    # ------------------------------------------------------------------ sampling

    def _check_sampling(
        self,
        prompt: Sequence[int],
        num_samples: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int | None,
        stop_token_ids: Sequence[int] | None,
        stop: Sequence[str],
    ) -> torch.Tensor:
        ids = self._token_tensor("prompt", prompt)
        if ids.numel() == 0:
            raise ValueError("prompt: empty")
        if not _is_int(num_samples) or num_samples < 1:
            raise ValueError(f"num_samples: must be an integer >= 1, got {num_samples!r}")
        if not _is_int(max_tokens) or max_tokens < 0:
            raise ValueError(f"max_tokens: must be an integer >= 0, got {max_tokens!r}")
        if _finite("temperature", temperature) < 0:
            raise ValueError(f"temperature: must be >= 0, got {temperature}")
        if 0 < temperature < MIN_TEMPERATURE:
            # logits / T overflows to inf and the sampling distribution becomes NaN.
            raise ValueError(f"temperature: must be 0 (greedy) or >= {MIN_TEMPERATURE}")
        if not 0.0 < _finite("top_p", top_p) <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {top_p}")
        if not _is_int(top_k) or top_k < -1:
            raise ValueError(f"top_k: must be -1 (off) or >= 0, got {top_k!r}")
        if seed is not None and not _is_int(seed):
            raise ValueError(f"seed: must be an integer or None, got {seed!r}")
        if stop_token_ids is not None:
            self._token_tensor("stop_token_ids", stop_token_ids)
        if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop: must be a list of non-empty strings")
        return ids

    def _hits_stop(self, tokens: list[int], stop: Sequence[str]) -> bool:
        """Whether the decoded ``tokens`` contain one of the ``stop`` strings."""
        if not stop:
            return False
        text = self.tokenizer.decode(tokens)
        return any(s in text for s in stop)

    @staticmethod
    def _truncate(probs: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
        """``probs`` [N, V] with the tokens outside top-k / top-p set to zero."""
        if 0 < top_k < probs.shape[-1]:
            kth = torch.topk(probs, top_k, dim=-1).values[:, -1:]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if top_p < 1.0:
            ordered, order = probs.sort(dim=-1, descending=True)
            before = ordered.cumsum(dim=-1) - ordered
            keep_sorted = before < top_p * probs.sum(dim=-1, keepdim=True)
            keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        return probs

    def sample(
        self,
        sampler_id: str | None,
        prompt: Sequence[int],
        *,
        num_samples: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        stop: Sequence[str] = (),
        prompt_logprobs: bool = False,
    ) -> SampleOutput:
        """``num_samples`` completions of ``prompt`` from a snapshot (None: the base model).

        Each returned logprob is log_softmax(logits / temperature) of the sampled token, taken
        before top-p / top-k truncation; ``temperature`` 0 is greedy, with logprobs at
        temperature 1. With ``seed``, sample i draws from a generator seeded ``seed + i``, so a
        call repeated with the same arguments returns the same completions.
        ``stop_token_ids`` None stops at EOS, [] at no token; a stop token or the token that
        completes a ``stop`` string is the last one returned (stop_reason "stop"); otherwise
        the completion has ``max_tokens`` tokens (stop_reason "length").
        ``prompt_logprobs``: one value per prompt token (same temperature rule), nan first.
        """
        job = SampleJob(
            sampler_id,
            prompt,
            num_samples,
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            stop_token_ids,
            stop,
            prompt_logprobs,
        )
        return self._sample_alone(job)

    def _sample_alone(self, job: SampleJob) -> SampleOutput:
        plan = self._plan(job)
        with self._use(plan.adapter, train=False) as model, torch.no_grad():
            self._generate(model, [plan], None)
        return plan.output()

    def sample_batch(self, jobs: Sequence[SampleJob]) -> list[SampleOutput | Exception]:
        """Several sampling calls, of any snapshots or the base model, in one batch.

        Returns each call's result as :meth:`sample` would (the same completions for the same
        seed, log-probs up to float rounding), or the exception it alone raised: a bad call
        fails by itself. Should the batch fail, each call is run alone.
        """
        outputs: list[SampleOutput | Exception] = []
        plans: dict[int, _SamplePlan] = {}
        for index, job in enumerate(jobs):
            try:
                plans[index] = self._plan(job)
                outputs.append(RuntimeError("not run"))
            except Exception as exc:
                outputs.append(exc)
        if len(plans) > 1:
            try:
                adapters = [plan.adapter for plan in plans.values()]
                with self._use_mixed(adapters) as (model, names), torch.no_grad():
                    self._generate(model, list(plans.values()), names)
            except Exception:
                log.warning("a batch of %d sampling calls failed; running each alone", len(plans))
            else:
                for index, plan in plans.items():
                    outputs[index] = plan.output()
                return outputs
        for index in plans:
            try:
                outputs[index] = self._sample_alone(jobs[index])
            except Exception as exc:
                outputs[index] = exc
        return outputs

    def _plan(self, job: SampleJob) -> _SamplePlan:
        """A checked sampling call with its generators (ValueError names a bad field)."""
        ids = self._check_sampling(
            job.prompt,
            job.num_samples,
            job.max_tokens,
            job.temperature,
            job.top_p,
            job.top_k,
            job.seed,
            job.stop_token_ids,
            job.stop,
        )
        adapter: _Adapter | None = None
        if job.sampler_id is not None:
            adapter = self._snapshots.get(job.sampler_id)
            if adapter is None:
                raise UnknownIdError(f"unknown sampler {job.sampler_id!r}")
        if job.stop_token_ids is None:
            stops = {self.eos_token_id} if self.eos_token_id is not None else set()
        else:
            stops = set(job.stop_token_ids)
        greedy = job.temperature == 0
        base_seed = secrets.randbits(62) if job.seed is None else job.seed
        generators = []
        if not greedy:
            for i in range(job.num_samples):
                generator = torch.Generator(device=self.device)
                generator.manual_seed((base_seed + i) % 2**64)
                generators.append(generator)
        n = job.num_samples
        return _SamplePlan(
            job=job,
            ids=ids.to(self.device),
            adapter=adapter,
            stops=stops,
            greedy=greedy,
            scale=1.0 if greedy else float(job.temperature),
            generators=generators,
            tokens=[[] for _ in range(n)],
            logprobs=[[] for _ in range(n)],
            reasons=[None] * n,
        )

    @contextlib.contextmanager
    def _use_mixed(
        self, adapters: Sequence[_Adapter | None]
    ) -> Iterator[tuple[torch.nn.Module, list[str] | None]]:
        """The model computing ``adapters[i]`` for the i-th group of rows, and the adapter
        name per group (None when one adapter serves all: the plain path, as alone)."""
        if len(set(adapters)) == 1:
            with self._use(adapters[0], train=False) as model:
                yield model, None
            return
        assert self._peft is not None  # two distinct adapters exist
        self._set_trainable(None)
        yield self._peft, [a.internal if a is not None else "__base__" for a in adapters]

    @contextlib.contextmanager
    def _rows_use(self, names: list[str] | None) -> Iterator[None]:
        """Within it, row i of every forward pass computes adapter ``names[i]`` ("__base__":
        none); None changes nothing (:func:`areal_grpc.named_adapters.rows_adapters`)."""
        if names is None:
            yield
            return
        assert self._peft is not None
        with rows_adapters(self._peft, names):
            yield

    def _generate(
        self, model: torch.nn.Module, plans: list[_SamplePlan], names: list[str] | None
    ) -> None:
        """Samples every plan's sequences in one batch (``names``: each plan's adapter).

        Prompts of unequal length are left-padded, with an attention mask and position ids
        that start at each prompt's first token, so a row sees what it would see alone.
        """
        counts = [plan.job.num_samples for plan in plans]
        rows = sum(counts)
        width = max(plan.ids.numel() for plan in plans)
        ids = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        slices = []
        start = 0
        for plan, count in zip(plans, counts, strict=True):
            length = plan.ids.numel()
            ids[start : start + count, width - length :] = plan.ids
            mask[start : start + count, width - length :] = 1
            slices.append(slice(start, start + count))
            start += count
        rows_names = None
        if names is not None:
            rows_names = [n for n, c in zip(names, counts, strict=True) for _ in range(c)]
        for index, plan in enumerate(plans):
            if plan.job.prompt_logprobs:
                name = None if names is None else names[index]
                self._prompt_logprobs(model, plan, name)
        with self._rows_use(rows_names):
            self._decode(model, plans, ids, mask, slices)

    def _decode(
        self,
        model: torch.nn.Module,
        plans: list[_SamplePlan],
        ids: torch.Tensor,
        mask: torch.Tensor,
        slices: list[slice],
    ) -> None:
        """The prompt pass and the decoding steps of :meth:`_generate`."""
        rows = ids.shape[0]
        padded = not bool(mask.all())
        shape: dict[str, torch.Tensor] = {}
        if padded:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            shape = {"attention_mask": mask, "position_ids": positions}
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **shape)
        steps = max(plan.job.max_tokens for plan in plans)
        for step in range(steps):
            logits = out.logits[:, -1].to(self.math_dtype)
            chosen = torch.cat(
                [self._choose(plan, logits[sl]) for plan, sl in zip(plans, slices, strict=True)]
            )
            if all(plan.all_finished() for plan in plans) or step == steps - 1:
                break
            if padded:
                mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
                shape = {"attention_mask": mask, "position_ids": shape["position_ids"][:, -1:] + 1}
            cache = getattr(out, self._cache_field, None)
            out = model(
                input_ids=chosen.unsqueeze(-1),
                use_cache=True,
                **{self._cache_arg: cache},
                **shape,
            )

    def _prompt_logprobs(self, model: torch.nn.Module, plan: _SamplePlan, name: str | None) -> None:
        # A pass of its own, so the completions do not depend on this option.
        with self._rows_use(None if name is None else [name]):
            logits = model(input_ids=plan.ids.unsqueeze(0), use_cache=False).logits[0, :-1]
        first = torch.log_softmax(logits.to(self.math_dtype) / plan.scale, dim=-1)
        picked = first.gather(-1, plan.ids[1:].unsqueeze(-1)).squeeze(-1)
        plan.prompt_lp = [math.nan, *picked.cpu().tolist()]

    def _choose(self, plan: _SamplePlan, logits: torch.Tensor) -> torch.Tensor:
        """The next token of each of ``plan``'s rows (``logits`` [rows, V]); records it.

        Every row draws from its own generator at every step, finished or not, as alone."""
        if not bool(torch.isfinite(logits).all()):
            # Weights trained far off (finite, yet overflowing activations): the call fails
            # alone, with a reason, instead of in torch.multinomial.
            raise PreconditionError(
                "the model gives non-finite logits (its adapter's weights overflow): "
                "it cannot be sampled"
            )
        logp = torch.log_softmax(logits / plan.scale, dim=-1)
        if plan.greedy:
            chosen = logits.argmax(dim=-1)
        else:
            probs = self._truncate(logp.exp(), plan.job.top_p, plan.job.top_k)
            chosen = torch.cat(
                [
                    torch.multinomial(probs[i], 1, generator=generator)
                    for i, generator in enumerate(plan.generators)
                ]
            )
        chosen_lp = logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        chosen_list = chosen.cpu().tolist()
        lp_list = chosen_lp.cpu().tolist()
        for i in range(plan.job.num_samples):
            if plan.finished(i):
                continue
            plan.tokens[i].append(chosen_list[i])
            plan.logprobs[i].append(lp_list[i])
            if chosen_list[i] in plan.stops or self._hits_stop(plan.tokens[i], plan.job.stop):
                plan.reasons[i] = "stop"
        return chosen

    # ------------------------------------------------------------------ state

    def save_state(self, run_id: str, directory: Path, *, optimizer: bool) -> int:
        """Writes run ``run_id``'s adapter (and, with ``optimizer``, its AdamW state and step).

        ``directory`` must exist (the caller creates it). The adapter is a peft checkpoint
        (adapter_model.safetensors + adapter_config.json); lora_state.json holds the spec and
        step; optimizer.pt the optimizer's state_dict. Pending (un-stepped) gradients are not
        saved. Returns the bytes written.
        """
        run = self._run(run_id)
        directory = Path(directory)
        if not directory.is_dir():
            raise ValueError(f"directory: {directory} does not exist")
        tensors = {key: p.detach().cpu().contiguous().clone() for key, p in run.params.items()}
        written = [directory / _ADAPTER_FILE, directory / _PEFT_CONFIG_FILE]
        save_file(tensors, str(written[0]))
        config = self._lora_config(run.spec).to_dict()
        config["base_model_name_or_path"] = self.base_model
        config["target_modules"] = sorted(config["target_modules"])
        written[1].write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
        meta = {
            "format": _STATE_FORMAT,
            "spec": asdict(run.spec),
            "lora_alpha": LORA_ALPHA,
            "base_model": self.base_model,
            "step": run.steps,
            "optimizer": optimizer,
        }
        written.append(directory / _STATE_FILE)
        written[-1].write_text(json.dumps(meta, indent=2))
        if optimizer:
            assert run.optimizer is not None
            written.append(directory / _OPTIMIZER_FILE)
            torch.save(
                {"param_names": list(run.params), "state_dict": run.optimizer.state_dict()},
                written[-1],
            )
        else:
            (directory / _OPTIMIZER_FILE).unlink(missing_ok=True)
        return sum(path.stat().st_size for path in written)

    def load_state(self, run_id: str, directory: Path, *, optimizer: bool) -> None:
        """Restores run ``run_id`` from a :meth:`save_state` directory.

        The run must have the saved adapter's shape (create it with :func:`read_saved_spec`).
        With ``optimizer`` the AdamW state and step are restored too (ValueError when the
        directory has none), so training continues bit-exactly as if never saved; without,
        the optimizer starts fresh at step 0. Pending gradients are dropped. Everything is
        read and checked before the run changes.
        """
        run = self._run(run_id)
        directory = Path(directory)
        meta = _read_state_meta(directory)
        saved = AdapterSpec(**meta["spec"])
        for name in ("rank", "train_attn", "train_mlp", "train_unembed"):
            if getattr(saved, name) != getattr(run.spec, name):
                raise ValueError(
                    f"spec.{name}: the saved adapter has {getattr(saved, name)!r}, "
                    f"run {run_id!r} has {getattr(run.spec, name)!r}"
                )
        adapter_file = directory / _ADAPTER_FILE
        if not adapter_file.is_file():
            raise ValueError(f"directory: {directory} has no {_ADAPTER_FILE}")
        tensors = load_file(str(adapter_file))
        if set(tensors) != set(run.params):
            missing = sorted(set(run.params) - set(tensors))[:3]
            extra = sorted(set(tensors) - set(run.params))[:3]
            raise ValueError(
                f"directory: {adapter_file} does not match run {run_id!r} "
                f"(missing {missing}, unexpected {extra})"
            )
        for key, param in run.params.items():
            if tensors[key].shape != param.shape:
                raise ValueError(
                    f"directory: {key} has shape {tuple(tensors[key].shape)}, "
                    f"expected {tuple(param.shape)}"
                )
        params = list(run.params.values())
        new_optimizer = torch.optim.AdamW(params, lr=AdamParams().learning_rate)
        steps = 0
        if optimizer:
            opt_file = directory / _OPTIMIZER_FILE
            if not meta.get("optimizer") or not opt_file.is_file():
                raise ValueError(f"directory: {directory} was saved without optimizer state")
            blob = torch.load(opt_file, map_location="cpu", weights_only=True)
            if blob.get("param_names") != list(run.params):
                raise ValueError(f"directory: {opt_file} names other parameters")
            # A throwaway optimizer over detached copies checks the state loads cleanly
            # before the run's own parameters change.
            probe = [torch.nn.Parameter(p.detach().clone()) for p in params]
            torch.optim.AdamW(probe).load_state_dict(blob["state_dict"])
            steps = int(meta.get("step", 0))
        with torch.no_grad():
            for key, param in run.params.items():
                param.copy_(tensors[key].to(device=param.device, dtype=param.dtype))
                param.grad = None
        if optimizer:
            new_optimizer.load_state_dict(blob["state_dict"])
        run.optimizer = new_optimizer
        run.steps = steps
