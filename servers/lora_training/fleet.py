"""The rollout fleet a Tinker-compatible service samples on (``tinker.rollout_addresses``).

Each sampler checkpoint is loaded on every rollout server of the fleet as a named adapter
(``RolloutService.LoadAdapter``), and a ``sample`` call naming it goes to the next server in
turn as a ``Generate`` naming that adapter, so sampling runs on the fleet's engines (hf or
vLLM, many adapters on one base model, rows of different tenants in one batch) instead of on
the training service's own model. The fleet's servers must serve the service's base model.

Calls are blocking: the service makes them from worker threads.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence

import grpc
import torch
from areal_servers.lora_training.engine import SampledSequence, SampleOutput
from arealgrpc.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

from areal_grpc.named_adapters import adapter_requests
from areal_grpc.server import sync_channel

__all__ = ["SamplerFleet", "adapter_name"]

log = logging.getLogger(__name__)

# Generate and LoadAdapter answer within this on a fleet that is up.
CALL_TIMEOUT_S = 600.0
# Every sampler's adapter name starts with this (and nothing else this service loads).
PREFIX = "tinker-"


def adapter_name(sampler_key: str) -> str:
    """The fleet's adapter name of a sampler (its key holds the tenant and the checkpoint's
    path, which are no valid adapter name and are nobody else's business)."""
    return PREFIX + hashlib.sha256(sampler_key.encode()).hexdigest()[:40]


class SamplerFleet:
    """Rollout servers that hold the samplers as named adapters and sample them."""

    def __init__(
        self,
        addresses: Sequence[str],
        channel: Callable[[str], grpc.Channel] = sync_channel,
    ) -> None:
        """Talks to ``addresses`` (host:port each) over channels ``channel`` opens (the
        process's TLS and token by default)."""
        if not addresses:
            raise ValueError("tinker.rollout_addresses: name at least one rollout server")
        self.addresses = list(addresses)
        self._channels = [channel(a) for a in self.addresses]
        self._stubs = [rollout_pb2_grpc.RolloutServiceStub(c) for c in self._channels]
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def forget_stale(self) -> list[str]:
        """Removes every sampler adapter a previous service left on the fleet (its runs and
        samplers died with it); returns their names. Other adapters stay."""
        gone = []
        for stub in self._stubs:
            status = stub.GetRolloutStatus(
                rollout_pb2.GetRolloutStatusRequest(), timeout=CALL_TIMEOUT_S
            )
            for name in status.adapters:
                if name.startswith(PREFIX):
                    stub.RemoveAdapter(
                        rollout_pb2.RemoveAdapterRequest(name=name), timeout=CALL_TIMEOUT_S
                    )
                    gone.append(name)
        return gone

    def load(
        self, sampler_key: str, tensors: Mapping[str, torch.Tensor], rank: int, alpha: float
    ) -> None:
        """Loads the sampler's adapter on every server (a failure on any raises its error)."""
        name = adapter_name(sampler_key)
        for stub in self._stubs:
            stub.LoadAdapter(adapter_requests(name, tensors, rank, alpha), timeout=CALL_TIMEOUT_S)

    def remove(self, sampler_key: str) -> None:
        """Removes the sampler's adapter from every server (one a server lacks is fine)."""
        name = adapter_name(sampler_key)
        for address, stub in zip(self.addresses, self._stubs, strict=True):
            try:
                stub.RemoveAdapter(
                    rollout_pb2.RemoveAdapterRequest(name=name), timeout=CALL_TIMEOUT_S
                )
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                    log.warning("removing sampler %s from %s failed: %s", name, address, exc)

    def sample(
        self,
        sampler_key: str | None,
        prompt: Sequence[int],
        *,
        num_samples: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> SampleOutput:
        """``num_samples`` completions of ``prompt`` by the sampler (None: the base model) on
        the next server, as :meth:`LoraEngine.sample` returns them (no prompt log-probs)."""
        with self._lock:
            stub = self._stubs[next(self._turn) % len(self._stubs)]
        sampling = common_pb2.SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=max(top_k, 0),
            max_new_tokens=max_tokens,
            # The stop tokens are exactly the caller's (its EOS among them unless it ignores it).
            stop_token_ids=list(stop_token_ids),
            ignore_eos=True,
            n_samples=num_samples,
            seed=seed,
        )
        reply = stub.Generate(
            rollout_pb2.GenerateRequest(
                input_ids=list(prompt),
                sampling=sampling,
                adapter=adapter_name(sampler_key) if sampler_key else "",
            ),
            timeout=CALL_TIMEOUT_S,
        )
        sequences = [
            SampledSequence(
                list(c.output_ids),
                list(c.output_logprobs),
                "stop" if c.finish_reason == common_pb2.FINISH_REASON_STOP else "length",
            )
            for c in reply.completions
        ]
        return sequences, None

    def close(self) -> None:
        """Closes the channels."""
        for channel in self._channels:
            channel.close()
