"""A whole run under mutual TLS and a bearer token, and what the run's servers refuse.

One ``security`` section secures every process: the children the launcher starts (their
servers, and trainer rank 0's calls to the rollout servers when weights move), the
coordinator's own server, and every channel the coordinator opens. A client without the CA's
certificate, or without the token, gets nothing from any of them.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
import httpx
import pytest
from arealgrpc.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

from areal_grpc.cli import run_channel_options, run_server_options
from areal_grpc.config import load_config, preflight
from areal_grpc.coordinator.launcher import start_mesh
from areal_grpc.coordinator.metrics import read_jsonl
from areal_grpc.coordinator.pool import WorkPool
from areal_grpc.coordinator.service import CoordinatorServicer
from areal_grpc.errors import FieldError
from areal_grpc.launch import health_status
from areal_grpc.security import ClientTls
from areal_grpc.server import (
    ChannelOptions,
    set_default_channel_options,
    start_server,
    sync_channel,
)
from tests.support.pki import TOKEN

pytestmark = pytest.mark.slow

# A tiny run: the built-in echo task, a few steps, no eval, checkpoint or export.
SMALL_RUN = [
    "data.task=echo",
    "staleness.batch_size=2",
    "staleness.group_size=2",
    "staleness.max_staleness=1",
    "eval.every_steps=0",
    "checkpoint.every_steps=0",
    "checkpoint.export_hf=false",
    "output.plot=false",
    "output.tensorboard=false",
    "output.progress_bar=false",
]


def security_overrides(pki: dict[str, str]) -> list[str]:
    return [
        f"security.tls_cert={pki['server_cert']}",
        f"security.tls_key={pki['server_key']}",
        f"security.tls_ca={pki['ca']}",
        "security.mutual_tls=true",
        f"security.auth_token_file={pki['token']}",
    ]


def test_a_whole_run_under_mutual_tls_and_a_token_trains(pki, tmp_path, coordinator_command):
    out = tmp_path / "run"
    steps = 3
    code, log = coordinator_command.run(
        out,
        f"total_steps={steps}",
        "trainer.ranks=2",
        # The weights take the SOCKET side channel, inside the run's mutual TLS.
        "weight_sync.methods=[socket]",
        *SMALL_RUN,
        *security_overrides(pki),
        timeout=240,
        unset_env=["AREAL_AUTH_TOKEN"],  # the token comes from the config's file only
    )
    assert code == 0
    assert f"done: {steps} steps, version {steps}" in log
    assert "mesh stopped cleanly" in log
    # No method outside TLS was allowed, so no warning that weights go in the clear.
    assert "not encrypted" not in log
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    # Every step trained and was followed by a weight sync to the rollout server (the version
    # advances only when the fleet update succeeded), by the one method allowed.
    assert [r["version"] for r in train] == list(range(1, steps + 1))
    assert all(r["sequences"] == 4 for r in train)
    # Inside TLS: the server's side channel said so for every update.
    received = [
        line
        for line in (out / "logs" / "rollout-0.log").read_text().splitlines()
        if "socket update to version" in line
    ]
    assert len(received) == steps and all(line.endswith("(TLS)") for line in received), received


def _expect_refused(address: str, opts: ChannelOptions, rpc: str) -> grpc.StatusCode:
    """The status a client with ``opts`` gets for one status call of ``rpc``'s service."""
    calls = {
        "rollout": lambda ch: rollout_pb2_grpc.RolloutServiceStub(ch).GetRolloutStatus(
            rollout_pb2.GetRolloutStatusRequest(), timeout=10
        ),
        "trainer": lambda ch: trainer_pb2_grpc.TrainerServiceStub(ch).GetTrainerStatus(
            trainer_pb2.GetTrainerStatusRequest(), timeout=10
        ),
        "coordinator": lambda ch: coordinator_pb2_grpc.CoordinatorServiceStub(
            ch
        ).GetCoordinatorStatus(coordinator_pb2.GetCoordinatorStatusRequest(), timeout=10),
    }
    with sync_channel(address, opts) as ch:
        try:
            calls[rpc](ch)
        except grpc.RpcError as err:
            return err.code()  # type: ignore[attr-defined]
    return grpc.StatusCode.OK


def _clients(pki: dict[str, str]) -> dict[str, ChannelOptions]:
    ca, cert, key = pki["ca"], pki["server_cert"], pki["server_key"]
    return {
        "plaintext": ChannelOptions(),
        "tls_no_client_cert": ChannelOptions(tls=ClientTls(ca), auth_token=TOKEN),
        "stranger_cert": ChannelOptions(
            tls=ClientTls(ca, pki["stranger_cert"], pki["stranger_key"]), auth_token=TOKEN
        ),
        "mtls_no_token": ChannelOptions(tls=ClientTls(ca, cert, key)),
        "mtls_wrong_token": ChannelOptions(tls=ClientTls(ca, cert, key), auth_token="nope"),
        "authorised": ChannelOptions(tls=ClientTls(ca, cert, key), auth_token=TOKEN),
    }


EXPECTED = {
    "plaintext": grpc.StatusCode.UNAVAILABLE,
    "tls_no_client_cert": grpc.StatusCode.UNAVAILABLE,
    "stranger_cert": grpc.StatusCode.UNAVAILABLE,
    "mtls_no_token": grpc.StatusCode.UNAUTHENTICATED,
    "mtls_wrong_token": grpc.StatusCode.PERMISSION_DENIED,
    "authorised": grpc.StatusCode.OK,
}


def test_the_launched_servers_refuse_clients_without_certificate_or_token(pki, tmp_path):
    cfg = load_config(
        None,
        [
            "trainer.ranks=1",
            *SMALL_RUN,
            *security_overrides(pki),
            f"output.dir={tmp_path / 'run'}",
        ],
    )
    # The test process probes health like the coordinator does: with the run's credentials.
    previous = set_default_channel_options(run_channel_options(cfg.security))
    try:
        mesh = start_mesh(cfg, tmp_path / "logs")
    finally:
        set_default_channel_options(previous)
    try:
        targets = [(a, "rollout") for a in mesh.rollout_addresses] + [
            (a, "trainer") for a in mesh.trainer_addresses
        ]
        for address, rpc in targets:
            got = {name: _expect_refused(address, o, rpc) for name, o in _clients(pki).items()}
            assert got == EXPECTED, (rpc, got)
            # Health stays open to any client that completes the TLS handshake, never to
            # plaintext.
            assert health_status(address) == "UNREACHABLE"
    finally:
        assert set(mesh.stop().values()) == {0}


def test_the_coordinator_server_uses_the_run_security(pki):
    cfg = load_config(None, security_overrides(pki))

    async def body() -> dict[str, grpc.StatusCode]:
        servicer = CoordinatorServicer(WorkPool(batch_size=2, max_staleness=1))
        running = await start_server(
            [servicer.as_service()],
            run_server_options(cfg.security, "127.0.0.1", 0),
        )
        try:
            return {
                name: await asyncio.to_thread(_expect_refused, running.address, o, "coordinator")
                for name, o in _clients(pki).items()
            }
        finally:
            await running.stop(0)

    assert asyncio.run(body()) == EXPECTED


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("security.tls_cert={cert}", "security.tls_key"),
        ("security.tls_key={key}", "security.tls_cert"),
        ("security.tls_ca={ca}", "security.tls_cert"),
        ("security.mutual_tls=true", "security.mutual_tls"),
        ("security.auth_token_file={missing}", "security.auth_token_file"),
        (
            "security.tls_cert={cert},security.tls_key={key},security.tls_ca={missing}",
            "security.tls_ca",
        ),
    ],
)
def test_incomplete_security_config_names_the_key(pki, tmp_path, override, key):
    files = {"cert": pki["server_cert"], "key": pki["server_key"], "ca": pki["ca"]}
    text = override.format(**files, missing=tmp_path / "missing.pem")
    with pytest.raises(FieldError) as info:
        # Rules between keys fail at load; a missing file at launch (preflight).
        preflight(load_config(None, text.split(",")))
    assert info.value.field == key


def test_tls_without_the_ca_names_the_key(pki):
    with pytest.raises(FieldError) as info:
        load_config(
            None,
            [f"security.tls_cert={pki['server_cert']}", f"security.tls_key={pki['server_key']}"],
        )
    assert info.value.field == "security.tls_ca"


def test_an_empty_token_file_names_the_key(tmp_path: Path):
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(FieldError) as info:
        preflight(load_config(None, [f"security.auth_token_file={empty}"]))
    assert info.value.field == "security.auth_token_file"


def test_the_gateway_of_a_secured_run_serves_https_to_the_run_token_only(
    pki, tmp_path, coordinator_command
):
    """``gateway.enabled`` under the run's security: the gateway serves HTTPS with the run's
    certificate, takes the run's token as its bearer key (401 without, 403 wrong), reaches the
    rollout server over mutual TLS with the token, and refuses plaintext."""
    proc = coordinator_command.start(
        tmp_path / "run",
        "total_steps=1000",
        *SMALL_RUN,
        *security_overrides(pki),
        "gateway.enabled=true",
        unset_env=["AREAL_AUTH_TOKEN", "AREAL_GATEWAY_API_KEY"],
    )
    try:
        coordinator_command.address(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        while line and not line.startswith("GATEWAY"):
            line = proc.stdout.readline()
        assert line.startswith("GATEWAY https://127.0.0.1:"), line
        base = line.split()[1]
        with httpx.Client(verify=pki["ca"], timeout=60) as https:
            assert https.get(f"{base}/models").status_code == 401
            wrong = https.get(f"{base}/models", headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 403
            auth = {"Authorization": f"Bearer {TOKEN}"}
            assert https.get(f"{base}/models", headers=auth).json()["data"]
            reply = https.post(
                f"{base}/chat/completions",
                headers=auth,
                json={
                    "model": "m",
                    "messages": [{"role": "user", "content": "a="}],
                    "max_tokens": 3,
                },
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["role"] == "assistant"
        # Plaintext to the HTTPS port gets no answer.
        with pytest.raises(httpx.HTTPError):
            httpx.get(base.replace("https://", "http://") + "/models", timeout=10)
        # An unknown CA: the certificate is not trusted.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{base}/models", verify=pki["stranger_cert"], timeout=10)
    finally:
        proc.send_signal(signal.SIGINT)
        coordinator_command.finish(proc, timeout=120)
    assert proc.returncode == 130
