"""A stand-in for SGLang's kernel package on CPUs (``sglang-kernel-cpu`` has no wheel).

SGLang's torch-native CPU path calls one function of it, :func:`assign_req_to_token_pool_cpu`,
implemented here in torch. SGLang also imports many other names and submodules at module level
(quantisation, attention and communication kernels for other backends); each is a
:class:`Missing` function that raises NotImplementedError naming itself if it is ever called.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

import torch

__version__ = "0.0.0+areal-grpc-stand-in"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_len: int,
) -> None:
    """Writes each request's new KV-cache slots into its row of the request-to-token table.

    Request ``i`` takes the next ``end_offset[i] - start_offset[i]`` entries of
    ``out_cache_loc`` (the slots of all requests, concatenated in order) and stores them at
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``: what SGLang's Triton
    kernel ``assign_req_to_token_pool`` does on a GPU. ``max_len`` (the table's width) bounds
    the offsets.
    """
    taken = 0
    rows = req_pool_indices.tolist()
    for row, start, end in zip(rows, start_offset.tolist(), end_offset.tolist(), strict=True):
        count = end - start
        if count <= 0:
            continue
        if end > max_len:
            raise ValueError(f"request row {row}: slots up to {end} exceed the table's {max_len}")
        req_to_token[row, start:end] = out_cache_loc[taken : taken + count].to(req_to_token.dtype)
        taken += count


class Missing:
    """A kernel the stand-in does not have: calling it raises NotImplementedError; its
    attributes (constants SGLang reads at import, e.g. ``scalar_types.uint4b8``) are more of
    the same."""

    def __init__(self, name: str) -> None:
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{self.__name__}: SGLang's CPU kernel package is not installed; this stand-in "
            "serves its torch-native path only"
        )

    def __getattr__(self, name: str) -> Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{self.__name__}.{name}")

    def __repr__(self) -> str:
        return f"<missing kernel {self.__name__}>"


def _missing_names(module: str) -> Any:
    def __getattr__(name: str) -> Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{module}.{name}")

    return __getattr__


__getattr__ = _missing_names(__name__)


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import sgl_kernel.<anything>`` give a module of :class:`Missing` names."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not fullname.startswith(f"{__name__}."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _missing_names(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.insert(0, _Submodules())
