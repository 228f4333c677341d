"""Named LoRA adapters on one in-process base model, and rows of one batch each computing its
own adapter.

An inference engine that serves many adapters at once holds one copy of the base weights and,
per adapter, a peft LoRA layer pair on each linear layer the adapter adapts. A batch row names
the adapter it computes, and each adapter's update is added to its own rows only, as peft's
mixed-adapter forward (``adapter_names``) computes it (:class:`RowAdapters`,
:func:`rows_adapters`); :func:`check_adapter`, :func:`add_adapter` and :func:`remove_adapter`
validate, install and drop an adapter's tensors.

Adapters are added to the model's own modules (a plain linear layer is wrapped in peft's LoRA
layer; one wrapped already, e.g. by the run's own LoRA, gains another adapter), so the model's
state dict keys of the base weights stay what they were and a full weight update goes on
working.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from arealgrpc.v1 import rollout_pb2

from areal_grpc.chunks import iter_chunks
from areal_grpc.errors import FieldError
from areal_grpc.tensor_codec import tensor_label

__all__ = [
    "BASE_ROWS",
    "NAME_PATTERN",
    "CheckedAdapter",
    "RowAdapters",
    "adapter_requests",
    "add_adapter",
    "check_adapter",
    "check_adapter_name",
    "check_adapter_shapes",
    "peft_tensors",
    "remove_adapter",
    "rows_adapters",
]

# The name peft's mixed-adapter forward reads as "no adapter" for a row.
BASE_ROWS = "__base__"

# Names a caller may give an adapter (and nothing peft or the engines use themselves).
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

# "<module>.lora_A.weight", with peft's saved prefix or not.
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<part>lora_[AB])\.weight$")


def check_adapter_name(name: str, field: str = "name") -> None:
    """FieldError unless ``name`` is a name a caller may give an adapter."""
    if not NAME_PATTERN.fullmatch(name):
        raise FieldError(
            field,
            f"{name!r} is not 1 to 64 letters, digits, '.', '_' or '-' starting with a letter "
            "or digit",
        )


@dataclass(frozen=True)
class CheckedAdapter:
    """An adapter's tensors matched to the base model: (A, B) per module name, in the model's
    dtype and on its device."""

    rank: int
    alpha: float
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        """Bytes its tensors take."""
        return sum(t.numel() * t.element_size() for pair in self.modules.values() for t in pair)


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (or ``model`` itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _linear(module: torch.nn.Module) -> torch.nn.Linear | None:
    """The linear layer ``module`` is, or wraps as a peft LoRA layer; None otherwise."""
    from peft.tuners.lora import LoraLayer

    if isinstance(module, LoraLayer):
        module = module.get_base_layer()
    return module if isinstance(module, torch.nn.Linear) else None


def check_adapter(
    model: torch.nn.Module,
    tensors: Mapping[str, torch.Tensor],
    rank: int,
    alpha: float,
    *,
    where: str = "header",
) -> CheckedAdapter:
    """Matches an adapter's tensors (peft's saved names) to ``model``'s linear layers; the
    result holds copies in the model's dtype, on its device. Errors as
    :func:`check_adapter_shapes`."""
    base = _base(model)
    weight = next(base.parameters())

    def dims(module_name: str) -> tuple[int, int] | None:
        try:
            linear = _linear(base.get_submodule(module_name))
        except AttributeError:
            return None
        return None if linear is None else (linear.in_features, linear.out_features)

    return check_adapter_shapes(
        tensors, rank, alpha, dims, dtype=weight.dtype, device=weight.device, where=where
    )


def check_adapter_shapes(
    tensors: Mapping[str, torch.Tensor],
    rank: int,
    alpha: float,
    dims: Callable[[str], tuple[int, int] | None],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    where: str = "header",
) -> CheckedAdapter:
    """Matches an adapter's tensors (peft's saved names) to a model's linear layers, whose
    (in_features, out_features) ``dims`` gives by module name (None: no such linear layer).
    The result holds copies (in ``dtype``, None: as given, on ``device``).

    FieldError naming the field for a rank or alpha out of range (``<where>.rank``), a tensor
    whose name is no LoRA weight, names no linear layer of the model, has the wrong shape or
    holds inf or NaN (``tensor["..."]``), and a layer given only one of its A and B.
    """
    if rank < 1:
        raise FieldError(f"{where}.rank", f"must be >= 1, got {rank}")
    if not alpha > 0 or alpha == float("inf"):
        raise FieldError(f"{where}.alpha", f"must be > 0 and finite, got {alpha}")
    if not tensors:
        raise FieldError("tensors", "an adapter needs at least one layer's lora_A and lora_B")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    names: dict[str, str] = {}
    for name, tensor in tensors.items():
        label = tensor_label(name)
        match = _KEY.match(name)
        if match is None:
            raise FieldError(
                label, "not a LoRA weight '<module>.lora_A.weight' or '<module>.lora_B.weight'"
            )
        module_name, part = match["module"], match["part"]
        shape = dims(module_name)
        if shape is None:
            raise FieldError(label, f"the model has no linear layer {module_name!r}")
        fan_in, fan_out = shape
        want = (rank, fan_in) if part == "lora_A" else (fan_out, rank)
        if tuple(tensor.shape) != want:
            raise FieldError(
                f"{label}.shape",
                f"{list(tensor.shape)} does not fit {module_name} ({fan_in} -> {fan_out}) at "
                f"rank {rank}: needs {list(want)}",
            )
        if not tensor.is_floating_point():
            raise FieldError(f"{label}.dtype", f"must be a floating type, got {tensor.dtype}")
        if not bool(torch.isfinite(tensor).all()):
            raise FieldError(f"{label}.data", "holds inf or NaN")
        if module_name in parts and part in parts[module_name]:
            raise FieldError(label, f"{module_name} is given {part} twice")
        parts.setdefault(module_name, {})[part] = tensor
        names[module_name] = name
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module_name, pair in sorted(parts.items()):
        missing = {"lora_A", "lora_B"} - set(pair)
        if missing:
            # Named as the caller names the tensor it gave (with peft's prefix or not).
            given = next(iter(pair))
            absent = names[module_name].replace(f".{given}.", f".{missing.pop()}.")
            raise FieldError(tensor_label(absent), f"missing: {module_name} has only {given}")
        a, b = (
            pair[p].detach().to(device=device, dtype=dtype or pair[p].dtype, copy=True)
            for p in ("lora_A", "lora_B")
        )
        modules[module_name] = (a, b)
    return CheckedAdapter(rank=rank, alpha=float(alpha), modules=modules)


def peft_tensors(adapter: CheckedAdapter) -> dict[str, torch.Tensor]:
    """The adapter's tensors by peft's saved names ("base_model.model.<module>.lora_A.weight"),
    as an adapter_model.safetensors file holds them."""
    out: dict[str, torch.Tensor] = {}
    for module_name, (a, b) in adapter.modules.items():
        out[f"base_model.model.{module_name}.lora_A.weight"] = a.contiguous()
        out[f"base_model.model.{module_name}.lora_B.weight"] = b.contiguous()
    return out


def add_adapter(model: torch.nn.Module, internal: str, adapter: CheckedAdapter) -> None:
    """Installs ``adapter`` in ``model`` under the peft adapter name ``internal`` (frozen).

    Changes the model: call it between forward passes, never during one.
    """
    from peft import LoraConfig
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    base = _base(model)
    config = LoraConfig(
        r=adapter.rank,
        lora_alpha=adapter.alpha,
        lora_dropout=0.0,
        target_modules=sorted(adapter.modules),
        inference_mode=True,
    )
    for module_name, (a, b) in adapter.modules.items():
        parent_name, _, child = module_name.rpartition(".")
        parent = base.get_submodule(parent_name) if parent_name else base
        layer = getattr(parent, child)
        if isinstance(layer, LoraLayer):
            active = list(layer.active_adapters)
            layer.update_layer(internal, adapter.rank, adapter.alpha, config)
            # Adding an adapter must not change what the layer computes without row names.
            layer.set_adapter(active)
        else:
            wrapped = LoraLinear(layer, internal, config, r=adapter.rank, lora_alpha=adapter.alpha)
            # The wrapper computes nothing of its own adapters without row names.
            wrapped.set_adapter([])
            setattr(parent, child, wrapped)
            layer = wrapped
        with torch.no_grad():
            layer.lora_A[internal].weight.copy_(a)
            layer.lora_B[internal].weight.copy_(b)
    for param in base.parameters():
        param.requires_grad_(False)


def remove_adapter(model: torch.nn.Module, internal: str) -> None:
    """Drops the peft adapter ``internal`` from every layer that has it (between forwards)."""
    from peft.tuners.lora import LoraLayer

    for module in _base(model).modules():
        if isinstance(module, LoraLayer) and internal in module.lora_A:
            active = [n for n in module.active_adapters if n != internal]
            module.delete_adapter(internal)
            module.set_adapter(active)
    for param in _base(model).parameters():
        param.requires_grad_(False)


class RowAdapters:
    """Hooks on a model's LoRA layers that make row i of every forward pass compute adapter
    ``names[i]`` (:data:`BASE_ROWS`: none; ``names`` None: the layers compute as they would
    without the hooks). An engine installs them once, and again when its LoRA layers change.

    The arithmetic is peft's mixed-adapter batch (``adapter_names``): each layer computes its
    base output for every row, then for each adapter the update of that adapter's rows,
    ``B(A(x[rows])) * scaling``, added to those rows. What differs is the bookkeeping: peft
    rebuilds each adapter's row list in Python and indexes with it at every layer (an eighth
    of a SmolLM2 decoding step for 8 rows of 4 adapters), and is told the names through hooks
    registered anew at each call; here the row indices are built once per pass, as tensors,
    and the hooks stay. Rows that all compute one adapter are one update of the whole batch,
    as peft computes a single active adapter.
    """

    def __init__(self) -> None:
        self._names: list[str] | None = None
        # (adapter, its rows; None: every row), built at the pass's first layer.
        self._plan: list[tuple[str, torch.Tensor | None]] | None = None
        self._layers: list[Any] = []
        # Each layer's own disabled flag, kept while row names are set.
        self._enabled: list[bool] = []
        self._handles: list[Any] = []

    @property
    def names(self) -> list[str] | None:
        """Each row's adapter in the next forward passes (None: no row names)."""
        return self._names

    @names.setter
    def names(self, names: Sequence[str] | None) -> None:
        self._plan = None
        # With row names a layer's own forward computes its base output alone (the hook adds
        # the adapters' updates); without, it computes what it did before.
        if names is not None and self._names is None:
            self._enabled = [layer._disable_adapters for layer in self._layers]
            for layer in self._layers:
                layer._disable_adapters = True
        elif names is None and self._names is not None:
            for layer, disabled in zip(self._layers, self._enabled, strict=True):
                layer._disable_adapters = disabled
        self._names = None if names is None else list(names)

    def install(self, model: torch.nn.Module) -> None:
        """Hooks every LoRA layer ``model`` has now (and no longer the ones it had before)."""
        from peft.tuners.lora import LoraLayer

        self.remove()
        self._layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
        for layer in self._layers:
            if getattr(layer, "merged_adapters", None):
                raise ValueError("row adapters need unmerged LoRA layers")
            # peft's own switch (enable_adapters) also flips the adapters' requires_grad,
            # which would touch a training run's parameters: the flag under it is set instead.
            if not isinstance(getattr(layer, "_disable_adapters", None), bool):
                raise RuntimeError(
                    f"this peft's {type(layer).__name__} has no _disable_adapters flag, "
                    "which row adapters set (peft 0.21 has it)"
                )
        self._handles = [
            layer.register_forward_hook(self._add_updates, with_kwargs=True)
            for layer in self._layers
        ]

    def remove(self) -> None:
        """Removes the hooks (the layers compute their active adapters again)."""
        self.names = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._layers = []

    def _rows(self, device: torch.device) -> list[tuple[str, torch.Tensor | None]]:
        if self._plan is None:
            assert self._names is not None
            rows: dict[str, list[int]] = {}
            for i, name in enumerate(self._names):
                rows.setdefault(name, []).append(i)
            everyone = len(self._names)
            self._plan = [
                (name, None if len(ix) == everyone else torch.tensor(ix, device=device))
                for name, ix in rows.items()
                if name != BASE_ROWS
            ]
        return self._plan

    def _add_updates(
        self,
        layer: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: torch.Tensor,
    ) -> torch.Tensor | None:
        if self._names is None:
            return None
        x = args[0] if args else next(iter(kwargs.values()))
        if x.shape[0] != len(self._names):
            raise ValueError(f"{len(self._names)} row adapters for a batch of {x.shape[0]} rows")
        for name, ix in self._rows(x.device):
            if name not in layer.lora_A:
                continue  # this adapter leaves the layer as it is
            if name in getattr(layer, "lora_variant", {}):
                raise ValueError(f"adapter {name!r} is a LoRA variant (DoRA...): not supported")
            lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
            rows = x if ix is None else x.index_select(0, ix)
            # peft's own update; dropout is the identity at inference.
            update = lora_b(lora_a(rows.to(lora_a.weight.dtype))) * layer.scaling[name]
            update = update.to(output.dtype)
            if ix is None:
                output = output + update
            else:
                output.index_add_(0, ix, update)
        return output


@contextlib.contextmanager
def rows_adapters(model: torch.nn.Module, names: Sequence[str] | None) -> Iterator[None]:
    """Within it, row i of every forward pass of ``model`` computes the peft adapter
    ``names[i]`` (:data:`BASE_ROWS`: none); None changes nothing (see :class:`RowAdapters`)."""
    if names is None:
        yield
        return
    rows = RowAdapters()
    rows.install(model)
    rows.names = list(names)
    try:
        yield
    finally:
        rows.remove()


def adapter_requests(
    name: str, tensors: Mapping[str, torch.Tensor], rank: int, alpha: float
) -> Iterator[rollout_pb2.LoadAdapterRequest]:
    """A ``RolloutService.LoadAdapter`` stream: the header, then ``tensors`` (peft's saved
    names) as chunks of 1 MiB at most."""
    yield rollout_pb2.LoadAdapterRequest(
        header=rollout_pb2.AdapterHeader(
            name=name, rank=rank, alpha=alpha, tensor_count=len(tensors)
        )
    )
    for chunk in iter_chunks(tensors):
        yield rollout_pb2.LoadAdapterRequest(chunk=chunk)
