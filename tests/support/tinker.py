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


# The sequence the tests teach a run (every id is in the built-in models' vocabulary).
SEQ = [5, 6, 7, 8, 9, 10, 11, 12]


def sft_datum(seq: list[int] = SEQ) -> types.Datum:
    """``seq`` as one SFT datum: each token predicts the next, every target weighted 1."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
    )


def sft_steps(
    tc: tinker.TrainingClient,
    n: int,
    lr: float = 3e-3,
    data: list[types.Datum] | None = None,
) -> list[float]:
    """``n`` cross_entropy steps on ``data`` (default: SEQ alone); each step's summed loss."""
    data = data if data is not None else [sft_datum()]
    losses = []
    for _ in range(n):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


def greedy(sampler: tinker.SamplingClient, prompt: list[int], n: int = 5) -> list[int]:
    """The ``n`` tokens ``sampler`` decodes greedily after ``prompt`` (each with a log-prob)."""
    result = sampler.sample(
        prompt=types.ModelInput.from_ints(prompt),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=n, temperature=0.0, stop=[]),
    ).result()
    assert len(result.sequences[0].logprobs) == n
    return list(result.sequences[0].tokens)
