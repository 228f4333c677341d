"""The run's ``areal-gateway`` process (``gateway.enabled``): started beside the coordinator
and restarted on the same address when it dies, so an agent's base URL stays valid.

A restarted gateway starts with no sessions: the dead one's leases expire at the coordinator
as any abandoned lease does, and a client that names one of its sessions gets 404 for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

from areal_grpc.config import RunConfig
from areal_grpc.launch import (
    Child,
    LaunchError,
    child_env,
    python_module_argv,
    start_child,
    stop_children,
)
from areal_grpc.server_config import config_argv

log = logging.getLogger(__name__)

__all__ = ["GatewayProcess"]


class GatewayProcess:
    """Starts the gateway, restarts it when it exits, stops it with the run."""

    def __init__(
        self,
        cfg: RunConfig,
        coordinator: str,
        log_dir: Path,
        started: Callable[[Child], None] = lambda child: None,
    ) -> None:
        self.cfg = cfg
        self.coordinator = coordinator
        self.log_dir = log_dir
        # Called with each started process (the first and every restart).
        self.started = started
        self.child: Child | None = None
        self.restarts = 0
        self._watch: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        """The ``/v1`` base URL clients use."""
        assert self.child is not None
        tls = self.cfg.security.tls_cert and self.cfg.security.tls_key
        return f"{'https' if tls else 'http'}://{self.child.address}/v1"

    def _start(self, port: int) -> Child:
        cfg = dataclasses.replace(
            self.cfg, gateway=dataclasses.replace(self.cfg.gateway, port=port)
        )
        argv = python_module_argv("areal_clients.gateway", "--coordinator", self.coordinator)
        return start_child(
            "gateway", [*argv, *config_argv(cfg)], log_dir=self.log_dir, env=child_env()
        )

    async def start(self, poll_s: float = 1.0) -> None:
        """Starts the gateway (on ``gateway.port``), prints GATEWAY, then watches it."""
        self.child = await asyncio.to_thread(self._start, self.cfg.gateway.port)
        self.started(self.child)
        print(f"GATEWAY {self.url}", flush=True)
        self._watch = asyncio.get_running_loop().create_task(self._supervise(poll_s))

    async def _supervise(self, poll_s: float) -> None:
        assert self.child is not None
        port = int(self.child.address.rsplit(":", 1)[1])
        failures = 0
        while True:
            await asyncio.sleep(poll_s)
            if self.child.alive():
                continue
            code = self.child.process.returncode
            try:
                self.child = await asyncio.to_thread(self._start, port)
            except LaunchError as exc:
                # The port may still be held for a moment; keep trying, more slowly.
                failures += 1
                log.warning("gateway restart %d failed: %s", failures, exc)
                await asyncio.sleep(min(30.0, poll_s * 2**failures))
                continue
            failures = 0
            self.restarts += 1
            self.started(self.child)
            print(f"gateway exited (code {code}): restarted at {self.url}", flush=True)

    async def stop(self) -> None:
        """Stops watching, then stops the gateway."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        if self.child is not None:
            await asyncio.to_thread(stop_children, [self.child])
