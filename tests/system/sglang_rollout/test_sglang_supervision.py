"""An SGLang server that stops answering (its scheduler frozen with SIGSTOP) is the engine's
death, named once; calls under way stop waiting, later calls are UNAVAILABLE, and closing the
engine leaves none of SGLang's processes behind. (Killed processes, through a whole run:
test_sglang_run.py.)"""

from __future__ import annotations

import concurrent.futures
import signal
import time

import grpc
import psutil
import pytest

from tests.support.engine_contract import PROMPT
from tests.support.sglang import start_sglang_server


def sglang_processes(pid: int) -> list[psutil.Process]:
    """An SGLang server's process and its children (scheduler, detokenizer, ...)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def test_a_frozen_scheduler_is_the_engines_death_and_nothing_is_left_behind(sglang_installed):
    server = start_sglang_server()
    try:
        assert server.engine.process is not None
        procs = sglang_processes(server.engine.process.pid)
        [scheduler] = [p for p in procs if "scheduler" in p.name()]
        assert server.greedy(PROMPT, 4).output_ids
        scheduler.send_signal(signal.SIGSTOP)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(server.greedy, PROMPT, 8)
            # Two /health checks of health_timeout_s (10 s) each, a second apart.
            deadline = time.monotonic() + 90
            while not server.deaths and time.monotonic() < deadline:
                time.sleep(0.2)
            assert server.deaths and "did not answer /health" in server.deaths[0], server.deaths
            with pytest.raises(grpc.RpcError) as info:
                waiting.result(timeout=30)
        death = f"the sglang engine died: {server.deaths[0]}"
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert death in (info.value.details() or "")
        with pytest.raises(grpc.RpcError) as later:
            server.greedy(PROMPT, 4)
        assert later.value.code() == grpc.StatusCode.UNAVAILABLE
        assert death in (later.value.details() or "")
        assert len(server.deaths) == 1
    finally:
        server.close()
    deadline = time.monotonic() + 30
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs):
        assert time.monotonic() < deadline, [p for p in procs if p.is_running()]
        time.sleep(0.2)
