"""What a rollout server serves, built from the run config: its engine, RolloutService and
WeightSyncService.

Kept apart from the entry point (``__main__``) so that ``areal-rollout --help`` and a bad
setting answer at once: this module imports torch and the engines.
"""

from __future__ import annotations

import torch
from areal_servers.rollout.engine import InferenceEngine
from areal_servers.rollout.hf_engine import HFEngine
from areal_servers.rollout.receive.base import ReceiverConfig
from areal_servers.rollout.service import RolloutServiceConfig, RolloutServicer
from areal_servers.rollout.weight_sync import build_weight_sync_service
from areal_servers.rollout.workflows import build_workflow, get_accept_filter
from arealgrpc.v1 import rollout_pb2, rollout_pb2_grpc

from areal_grpc.config import RunConfig
from areal_grpc.errors import FieldError
from areal_grpc.model import load_tokenizer
from areal_grpc.security import ServerTls
from areal_grpc.server import Service, service
from areal_grpc.server_config import max_new_tokens, weights_root
from areal_grpc.tensor_codec import MiB

__all__ = [
    "check_run_workflow",
    "create_engine",
    "create_rollout_servicer",
    "rollout_services",
]

# The run's settings that episode requests carry, by the name a request's error gives them.
_RUN_SETTINGS = {
    "task.workflow": "rollout.workflow",
    "task.workflow_params.reward_fn": "rollout.reward",
    "task.workflow_params.chat_template": "rollout.chat_template",
    "task.workflow_params.system_prompt": "rollout.system_prompt",
}


def create_engine(run: RunConfig, sglang_url: str = "") -> InferenceEngine:
    """The engine the run config asks for."""
    r = run.rollout
    if r.engine == "vllm":
        from areal_servers.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(
            run.model.source,
            r.vllm,
            seed=run.model.seed,
            dtype=r.dtype,
            lora=run.model.lora,
            max_adapters=r.max_adapters,
            max_adapter_bytes=int(r.max_adapter_mib * MiB),
        )
    if r.engine == "sglang":
        from areal_servers.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(
            run.model.source,
            r.sglang,
            url=sglang_url,
            seed=run.model.seed,
            dtype=r.dtype,
            lora=run.model.lora,
        )
    return HFEngine(run.model, run.rollout)


def check_run_workflow(run: RunConfig) -> None:
    """Builds the run's own workflow once, with the parameters the coordinator sends.

    A wrong ``rollout.workflow`` or ``rollout.reward`` (a typo in an import path, a module not
    on the server's path) then stops the server at start with a FieldError naming the
    setting, instead of failing every episode of the run with the same error.
    """
    params = dict(run.rollout.workflow_params)
    params.update(reward_fn=run.rollout.reward, chat_template=run.rollout.chat_template)
    if run.rollout.system_prompt is not None:
        params["system_prompt"] = run.rollout.system_prompt
    try:
        get_accept_filter(str(params.pop("accept", "all")))
        build_workflow(run.rollout.workflow, params)
    except FieldError as exc:
        field = _RUN_SETTINGS.get(exc.field) or exc.field.replace(
            "task.workflow_params.", "rollout.workflow_params.", 1
        )
        raise FieldError(field, exc.description) from exc


def create_rollout_servicer(run: RunConfig, engine: InferenceEngine) -> RolloutServicer:
    """The RolloutService handlers over ``engine``, with the run config's defaults."""
    config = RolloutServiceConfig(
        default_workflow=run.rollout.workflow,
        default_workflow_params=dict(run.rollout.workflow_params),
        default_max_new_tokens=max_new_tokens(run),
    )
    return RolloutServicer(engine, load_tokenizer(run.model.source), config)


async def rollout_services(
    run: RunConfig,
    engine: InferenceEngine,
    host: str = "127.0.0.1",
    tls: ServerTls | None = None,
) -> list[Service]:
    """RolloutService and WeightSyncService over ``engine`` (started first if it must be);
    ``host``: the interface the server binds, where SOCKET listeners bind too; ``tls``: the
    server's own TLS, which its SOCKET side channel speaks too."""
    rollout = create_rollout_servicer(run, engine)
    # The sglang engine launches or attaches to its server and waits until it is healthy.
    await engine.start()
    ws = ReceiverConfig(
        disk_root=weights_root(run),
        methods=run.weight_sync.accepted_methods(),
        socket_host=host,
        socket_tls=tls,
    )
    return [
        service(rollout, rollout_pb2_grpc.add_RolloutServiceServicer_to_server, rollout_pb2),
        build_weight_sync_service(engine, ws),
    ]


async def serve_run(
    run: RunConfig, sglang_url: str, host: str, tls: ServerTls | None = None
) -> list[Service]:
    """The services of a rollout server for ``run`` (its engine made and started) on
    ``host``, with the server's ``tls``."""
    check_run_workflow(run)
    torch.set_num_threads(run.rollout.torch_threads)
    return await rollout_services(run, create_engine(run, sglang_url), host, tls)
