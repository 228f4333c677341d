"""A rollout server checks the run's workflow and reward when it starts: a wrong import path
in ``rollout.workflow`` / ``rollout.reward`` is refused naming the setting, instead of failing
every episode of the run."""

from __future__ import annotations

import pytest
from areal_servers.rollout.build import check_run_workflow

from areal_grpc.config import load_config
from areal_grpc.errors import FieldError


@pytest.mark.parametrize(
    "override, field, words",
    [
        ("rollout.reward=examples.custom_reward:nope", "rollout.reward", "no attribute 'nope'"),
        ("rollout.reward=no_such_module:fn", "rollout.reward", "cannot import module"),
        ("rollout.reward=nope", "rollout.reward", "unknown reward function 'nope'"),
        ("rollout.workflow=no_such_module:Flow", "rollout.workflow", "cannot import module"),
        ("rollout.workflow=nope", "rollout.workflow", "unknown workflow 'nope'"),
        ("rollout.workflow_params={max_turns: 0}", "rollout.workflow_params.max_turns", ">= 1"),
    ],
)
def test_a_bad_workflow_setting_is_refused_naming_it(override, field, words, monkeypatch):
    from tests.support.paths import ROOT

    monkeypatch.syspath_prepend(str(ROOT))
    overrides = [override]
    if "max_turns" in override:
        overrides.append("rollout.workflow=multi_turn")
    with pytest.raises(FieldError) as err:
        check_run_workflow(load_config(None, overrides))
    assert err.value.field == field
    assert words in str(err.value)


def test_the_examples_and_the_defaults_pass(monkeypatch):
    from tests.support.paths import ROOT

    monkeypatch.syspath_prepend(str(ROOT))
    check_run_workflow(load_config(None, []))
    check_run_workflow(load_config(None, ["rollout.reward=examples.custom_reward:partial_credit"]))
    check_run_workflow(
        load_config(
            None,
            [
                "rollout.workflow=examples.custom_workflow:InstructionWorkflow",
                "rollout.workflow_params.instruction=repeat",
            ],
        )
    )
