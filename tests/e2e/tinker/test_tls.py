"""The Tinker-compatible service under the run's TLS: HTTPS for the SDK, TLS for its gRPC hop."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import tinker

from areal_grpc.launch import stop_children
from tests.support.tinker import sft_steps, start_tinker

MODEL = "builtin:tiny"
KEY = "tml-tls-0123456789abcdefgh"


def test_the_sdk_trains_over_https_and_nothing_answers_in_plaintext(
    pki: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """With security.tls_* the face serves HTTPS with the run's certificate (and the gRPC
    service behind it TLS): the unchanged SDK, trusting the run's CA, trains a run; plain
    HTTP and a client that does not trust the CA get no answer."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    child = start_tinker(
        tmp_path,
        {"tls": KEY},
        MODEL,
        f"security.tls_cert={pki['server_cert']}",
        f"security.tls_key={pki['server_key']}",
        f"security.tls_ca={pki['ca']}",
        name="tinker-tls",
    )
    try:
        url = f"https://{child.address}"
        # Printed just after LISTENING, which start_child waits for.
        log = tmp_path / "logs" / "tinker-tls.log"
        deadline = time.monotonic() + 30
        while f"TINKER {url}" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert f"TINKER {url}" in log.read_text()
        # Plain HTTP to the same port: the TLS handshake fails it, no answer comes.
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://{child.address}/api/v1/healthz", timeout=10)
        # A client that does not trust the run's CA is refused by the handshake.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/api/v1/healthz", timeout=10)
        monkeypatch.setenv("SSL_CERT_FILE", pki["ca"])
        tc = (
            tinker.ServiceClient(base_url=url, api_key=KEY)
            .create_lora_training_client(base_model=MODEL, rank=4, seed=1)
            .result()
        )
        losses = sft_steps(tc, 5)
        assert losses[-1] < losses[0]
    finally:
        stop_children([child])
