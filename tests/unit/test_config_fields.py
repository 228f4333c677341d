"""Every run setting explains itself: help text on the field, and a ``Literal`` type for every
string that takes one of a fixed set of values, which validation enforces by name."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import Field, fields, is_dataclass
from typing import Any

import pytest

from areal_grpc.config import RunConfig, choices_of, load_config, reference_markdown
from areal_grpc.errors import FieldError
from tests.support.paths import ROOT

# String settings that take free text (names, paths, addresses, import paths, model
# sources): each new string setting must be put here or declare its choices.
FREE_TEXT = {
    "name",
    "model.source",
    "model.lora.target_modules",
    "data.task",
    "data.path",
    "data.eval_path",
    "rollout.sglang.urls",
    "rollout.sglang.python",
    "rollout.sglang.attention_backend",
    "rollout.sglang.extra_args",
    "rollout.sglang.weights_dir",
    "rollout.workflow",
    "rollout.reward",
    "rollout.system_prompt",
    "rollout.workflow_params",
    "output.wandb_project",
    "output.wandb_name",
    "weight_sync.disk_root",
    "weight_sync.master_addr",
    "checkpoint.dir",
    "output.dir",
    "launcher.host",
    "launcher.attach.rollout_addresses",
    "launcher.attach.trainer_addresses",
    "launcher.ray.address",
    "launcher.slurm.time",
    "launcher.slurm.partition",
    "launcher.slurm.account",
    "tinker.host",
    "tinker.tenants_file",
    "tinker.root",
    "tinker.rollout_addresses",
    "launcher.slurm.gres",
    "security.tls_cert",
    "security.tls_key",
    "security.tls_ca",
    "security.auth_token_file",
    "gateway.host",
    "gateway.api_key_env",
    "gateway.chat_template",
}


def settings(section: Any = None, prefix: str = "") -> Iterator[tuple[str, Field, Any]]:
    """(dotted key, field, default value) of every setting, sections included."""
    section = RunConfig() if section is None else section
    for f in fields(section):
        value = getattr(section, f.name)
        yield prefix + f.name, f, value
        if is_dataclass(value):
            yield from settings(value, f"{prefix}{f.name}.")


def owners(section: Any = None, prefix: str = "") -> Iterator[tuple[str, type]]:
    """(dotted key, the config class declaring it) of every leaf setting."""
    section = RunConfig() if section is None else section
    for f in fields(section):
        value = getattr(section, f.name)
        if is_dataclass(value):
            yield from owners(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, type(section)


OWNER = dict(owners())
LEAVES = [(k, f, v) for k, f, v in settings() if not is_dataclass(v)]
CHOICES = {k: choices_of(OWNER[k], f.name) for k, f, _ in LEAVES}
WITH_CHOICES = [(k, f, v) for k, f, v in LEAVES if CHOICES[k]]


def test_every_setting_and_section_has_help_text():
    missing = [key for key, f, _ in settings() if len(f.metadata.get("help", "").strip()) < 10]
    assert not missing, f"settings without help text: {missing}"


def test_every_string_setting_declares_its_choices_or_is_free_text():
    undeclared = [
        key
        for key, f, _ in LEAVES
        if "str" in str(f.type) and not CHOICES[key] and key not in FREE_TEXT
    ]
    assert not undeclared, f"string settings with no choices and no FREE_TEXT entry: {undeclared}"
    # And nothing listed as free text has since been given a choice set (or gone away).
    free = {key for key, _, _ in LEAVES} - {key for key, _, _ in WITH_CHOICES}
    assert not FREE_TEXT - free, FREE_TEXT - free


@pytest.mark.parametrize("key, f, default", WITH_CHOICES, ids=[k for k, _, _ in WITH_CHOICES])
def test_a_value_outside_the_choices_is_refused_by_name(key: str, f: Field, default: Any):
    choices = CHOICES[key]
    if isinstance(default, list):
        assert all(item in choices for item in default)
        override, named = f"{key}=[bogus]", f"{key}[0]"
    else:
        assert default in choices, f"{key}'s default {default!r} is not one of its choices"
        override, named = f"{key}=bogus", key
    with pytest.raises(FieldError) as err:
        load_config(None, [override])
    assert err.value.field == named
    assert "must be one of" in str(err.value) and choices[0] in str(err.value)


def test_explain_prints_a_sections_settings_with_defaults_choices_and_help(capsys):
    from areal_grpc.coordinator.__main__ import main

    assert main(["--explain", "trainer.ppo.rejection"]) == 0
    out = capsys.readouterr().out
    rejection = [k for k, _, _ in settings() if k.startswith("trainer.ppo.rejection.")]
    for key in rejection:
        assert f"\n{key} = " in out
    assert 'trainer.ppo.rejection.metric = "ratio"  (one of: ratio, kl_k1' in out
    # Only that section: nothing of its parent or siblings.
    assert "trainer.ppo.eps_clip" not in out and "trainer.optimizer.lr" not in out
    # A leaf alone, and an unknown key refused with status 2.
    assert main(["--explain", "staleness.max_staleness"]) == 0
    assert capsys.readouterr().out.startswith("staleness.max_staleness = 2  (>= 0)\n    eta:")
    assert main(["--explain", "staleness.max_stale"]) == 2
    assert "no setting 'staleness.max_stale'" in capsys.readouterr().err


WITH_BOUNDS = [
    (k, f, v)
    for k, f, v in LEAVES
    if f.metadata.get("ge") is not None or f.metadata.get("gt") is not None
]


@pytest.mark.parametrize("key, f, default", WITH_BOUNDS, ids=[k for k, _, _ in WITH_BOUNDS])
def test_a_number_below_its_declared_bound_is_refused_by_name(key: str, f: Field, default: Any):
    ge, gt = f.metadata.get("ge"), f.metadata.get("gt")
    bad = ge - 1 if ge is not None else gt  # "above gt": gt itself is out
    if "int" in str(f.type) and "float" not in str(f.type):
        bad = int(bad)
    load_config(None, [])  # the default itself keeps the rule
    with pytest.raises(FieldError) as err:
        load_config(None, [f"{key}={bad}"])
    assert err.value.field == key, err.value
    assert ">" in str(err.value)


def test_the_committed_config_reference_is_what_the_fields_generate():
    """docs/reference/config.md is regenerated by scripts/gen-docs; a field changed without
    regenerating it fails here."""
    committed = (ROOT / "docs" / "reference" / "config.md").read_text()
    assert committed == reference_markdown(), "run ./scripts/gen-docs"
    for key, _, _ in LEAVES:
        assert f"| `{key}` |" in committed
