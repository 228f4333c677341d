"""Which float precision runs where: bf16 on hardware with fast bf16 units, fp32 elsewhere.

A CPU's bf16 matrix units (AMX-BF16, AVX512-BF16) run a bf16 matmul several times faster than
fp32; a CPU without them emulates bf16 and is slower at it than at fp32. So "auto" is decided
by the hardware, and the choice comes with the reason, for the run to print at start.

The CPU is read from ``/proc/cpuinfo`` (torch's own probes elsewhere): the coordinator prints
the choice without importing torch, which would take it seconds of both cores at start.
"""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = ["bf16_compute", "bf16_units", "choose_dtype", "cpu_flags"]

CPUINFO = Path("/proc/cpuinfo")
# The CPU flags that make bf16 fast, by the name a user knows them by (best first).
BF16_FLAGS = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"))


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU feature flags (Linux's names); torch's probes where there is no
    /proc/cpuinfo."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        import torch

        probes = {"amx_bf16": "_is_amx_tile_supported", "avx512_bf16": "_is_avx512_bf16_supported"}
        return frozenset(
            flag for flag, probe in probes.items() if getattr(torch.cpu, probe, lambda: False)()
        )
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def bf16_units(device_type: str) -> str | None:
    """What makes bf16 fast on this machine's ``device_type`` ("cuda" or "cpu"), or None."""
    if device_type == "cuda":
        import torch

        if torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False):
            return "CUDA bf16"
        return None
    flags = cpu_flags()
    return next((name for flag, name in BF16_FLAGS if flag in flags), None)


def choose_dtype(setting: str, device_type: str) -> tuple[str, str]:
    """The dtype name a precision ``setting`` means on ``device_type``, and why."""
    if setting != "auto":
        return setting, "as set"
    units = bf16_units(device_type)
    if units is not None:
        return "bfloat16", f"auto: this {device_type.upper()} has {units}"
    return "float32", f"auto: this {device_type.upper()} has no fast bf16 units"


def bf16_compute(setting: str, weights_dtype: str, device_type: str) -> tuple[bool, str]:
    """Whether a trainer computes in bf16 under a ``trainer.mixed_precision`` ``setting``
    ("auto", "on", "off") with ``weights_dtype`` weights on ``device_type``, and why."""
    if setting != "auto":
        return setting == "on", "as set"
    if weights_dtype != "float32":
        return False, f"auto: {weights_dtype} weights are for exactness checks"
    units = bf16_units(device_type)
    if units is None:
        return False, f"auto: this {device_type.upper()} has no fast bf16 units"
    return True, f"auto: this {device_type.upper()} has {units}"
