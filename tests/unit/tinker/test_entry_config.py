"""``python -m areal_grpc.tinker``'s config: its own default model under the user's keys, and
no plaintext beyond loopback by accident."""

from __future__ import annotations

from pathlib import Path

import pytest
from areal_servers.lora_training.__main__ import model_names

from areal_grpc.config import load_config
from areal_grpc.errors import FieldError
from areal_grpc.tinker.__main__ import DEFAULT_OUTPUT_DIR, DEFAULT_SOURCE, config_from_args


def test_the_service_defaults_to_smollm2_and_the_users_model_wins(tmp_path: Path):
    assert config_from_args([]).model.source == DEFAULT_SOURCE
    assert config_from_args(["model.source=builtin:micro"]).model.source == "builtin:micro"
    run = tmp_path / "run.yaml"
    run.write_text("model:\n  source: builtin:tiny\n")
    assert config_from_args(["--config", str(run)]).model.source == "builtin:tiny"
    assert model_names(DEFAULT_SOURCE)[0] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_the_service_writes_apart_from_a_default_training_run_unless_told_otherwise(
    tmp_path: Path,
):
    # A training run and the service started with defaults must not share logs/.
    assert config_from_args([]).output.dir == DEFAULT_OUTPUT_DIR
    assert load_config(None, []).output.dir != DEFAULT_OUTPUT_DIR
    assert config_from_args([f"output.dir={tmp_path}"]).output.dir == str(tmp_path)
    run = tmp_path / "run.yaml"
    run.write_text(f"output:\n  dir: {tmp_path / 'mine'}\n")
    assert config_from_args(["--config", str(run)]).output.dir == str(tmp_path / "mine")


def test_plaintext_beyond_loopback_is_refused_unless_allowed():
    with pytest.raises(FieldError) as err:
        config_from_args(["tinker.host=0.0.0.0"])
    assert err.value.field == "tinker.host"
    allowed = config_from_args(["tinker.host=0.0.0.0", "security.allow_plaintext=true"])
    assert allowed.tinker.host == "0.0.0.0"


def test_tls_serves_beyond_loopback(pki: dict[str, str]):
    tls = [
        f"security.{k}={pki[v]}"
        for k, v in (("tls_cert", "server_cert"), ("tls_key", "server_key"), ("tls_ca", "ca"))
    ]
    assert config_from_args(["tinker.host=0.0.0.0", *tls]).tinker.host == "0.0.0.0"


def test_a_missing_tenants_file_is_named_at_launch(tmp_path: Path):
    with pytest.raises(FieldError) as err:
        config_from_args([f"tinker.tenants_file={tmp_path / 'none.json'}"])
    assert err.value.field == "tinker.tenants_file"
