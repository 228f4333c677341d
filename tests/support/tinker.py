"""``python -m areal_grpc.tinker`` started for a test, with the tenants it serves."""

from __future__ import annotations

import json
from pathlib import Path

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
