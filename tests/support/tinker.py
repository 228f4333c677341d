"""``python -m areal_grpc.tinker`` started for a test, with the tenants it serves."""

from __future__ import annotations

import json
from pathlib import Path

import tinker
from tinker import types

from areal_grpc.launch import Child, python_module_argv, start_child


def start_tinker(
    out: Path, tenants: dict[str, str], model: str, *overrides: str, name: str = "tinker"
) -> Child:
    """The service on ``model`` with ``tenants`` (name -> API key) in ``out``: its run
    directory ``out/run``, its log ``out/logs/<name>.log``; ``overrides`` are config keys."""
    tenants_file = out / "tenants.json"
    tenants_file.write_text(json.dumps(tenants))
    return start_child(
        name,
        python_module_argv(
            "areal_grpc.tinker",
            f"model.source={model}",
            f"output.dir={out / 'run'}",
            f"tinker.tenants_file={tenants_file}",
            *overrides,
        ),
        log_dir=out / "logs",
    )


def greedy(sampler: tinker.SamplingClient, prompt: list[int], n: int = 5) -> list[int]:
    """The ``n`` tokens ``sampler`` decodes greedily after ``prompt`` (each with a log-prob)."""
    result = sampler.sample(
        prompt=types.ModelInput.from_ints(prompt),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=n, temperature=0.0, stop=[]),
    ).result()
    assert len(result.sequences[0].logprobs) == n
    return list(result.sequences[0].tokens)
