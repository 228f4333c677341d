"""The gateway served in this process (uvicorn in a thread) over an in-process
CoordinatorService without a rollout server: what an agent gets when no capacity is left
(tests/e2e/test_gateway.py drives it over a rollout server process)."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.support.gateway import (
    BATCH,
    MODEL,
    client,
    gateway_run,
    serve_gateway,
    start_mesh,
)


def test_a_full_staleness_budget_is_429_with_retry_after(tmp_path: Path) -> None:
    """No rollout server and no capacity left: sessions get 429 + Retry-After, sessionless
    completions 503."""
    m = start_mesh(None)
    gw = serve_gateway(gateway_run(), m.address)
    try:
        for _ in range(BATCH):
            assert httpx.post(f"{gw.url}/rl/sessions", json={}, timeout=10).status_code == 200
        full = httpx.post(f"{gw.url}/rl/sessions", json={}, timeout=10)
        assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
        assert full.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.InternalServerError) as err:
            client(gw).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}]
            )
        assert err.value.status_code == 503
    finally:
        gw.stop()
        m.stop()
