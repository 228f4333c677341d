"""The "write your own" guides (docs/guides/custom-*.md) run as written.

Each test takes the command from the fenced bash block after its ``<!-- tested: ... -->``
marker in the guide, runs it (its own output directory, a few steps, as any ``key=value``
added after a run's overrides wins), and checks what the guide says the user will see:
the custom reward's values in the rollouts, the custom dataset's items in the batches, the
custom workflow's prompts. The code the guides show is checked to be the examples' own.
"""

from __future__ import annotations

import itertools
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from areal_grpc.config import RolloutSupervision
from areal_grpc.coordinator.metrics import read_jsonl
from areal_grpc.data import load_file
from areal_grpc.model import load_tokenizer
from tests.support.coordinator import trained_groups
from tests.support.paths import ROOT

pytestmark = pytest.mark.slow

GUIDES = ROOT / "docs" / "guides"
COMMAND = ["python", "-m", "areal_grpc.coordinator"]
# A short run of what the guide shows; the guide's own settings stay as written.
SHORT = ("total_steps=3", "output.plot=false", "eval.every_steps=0", "checkpoint.export_hf=false")


def guide_command(guide: str, test: str) -> list[str]:
    """The overrides of the coordinator command in the bash block the test is marked on."""
    text = (GUIDES / guide).read_text()
    marker = f"<!-- tested: tests/e2e/test_guides.py::{test} -->\n```bash\n"
    assert marker in text, f"{guide} has no bash block marked for {test}"
    block = text.split(marker, 1)[1].split("\n```", 1)[0]
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[:3] == COMMAND, argv
    # The run writes to the test's directory instead of the guide's.
    return [a for a in argv[3:] if not a.startswith("output.dir=")]


def python_blocks(guide: str) -> Iterator[str]:
    """The Python code blocks of a guide."""
    yield from re.findall(r"```python\n(.*?)```", (GUIDES / guide).read_text(), re.S)


def run_guide(
    coordinator_command: Any, monkeypatch: pytest.MonkeyPatch, out: Path, overrides: list[str]
) -> None:
    # From the repository root, as the guides say: `examples` is importable from there.
    monkeypatch.chdir(ROOT)
    code, log = coordinator_command.run(out, *overrides, *SHORT)
    assert code == 0, log
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]


def samples(out: Path) -> list[dict[str, Any]]:
    """Every sample the run wrote to rollouts/ (each step's first groups)."""
    found = [
        rec for path in sorted((out / "rollouts").glob("step-*.jsonl")) for rec in read_jsonl(path)
    ]
    assert found, "the run wrote no rollouts"
    return found


def decode(ids: list[int]) -> str:
    return load_tokenizer("builtin:micro").decode(ids, skip_special_tokens=True)


def test_custom_reward_guide(tmp_path, coordinator_command, monkeypatch) -> None:
    from examples.custom_reward import RIGHT, RIGHT_KIND, WRONG, partial_credit

    source = (ROOT / "examples" / "custom_reward.py").read_text()
    assert all(block in source for block in python_blocks("custom-reward.md"))
    overrides = guide_command("custom-reward.md", "test_custom_reward_guide")
    assert "rollout.reward=examples.custom_reward:partial_credit" in overrides
    out = tmp_path / "run"
    run_guide(coordinator_command, monkeypatch, out, overrides)

    seen = set()
    for s in samples(out):
        prompt, completion = decode(s["prompt_ids"]), decode(s["completion_ids"])
        # The echo task: "x=" -> "x".
        item = {"prompt": prompt, "answer": prompt[0]}
        expected = partial_credit(prompt, completion, s["prompt_ids"], s["completion_ids"], item)
        assert s["reward"] == pytest.approx(expected), (prompt, completion)
        seen.add(s["reward"])
    assert seen <= {RIGHT, RIGHT_KIND, WRONG}
    # The partial credit the built-in rewards never give shows up in what was trained.
    assert RIGHT_KIND in seen


def test_custom_dataset_guide(tmp_path, coordinator_command, monkeypatch) -> None:
    assert all(
        line in (ROOT / "examples" / "custom_dataset.jsonl").read_text().splitlines()
        for block in re.findall(
            r"```json\n(.*?)```", (GUIDES / "custom-dataset.md").read_text(), re.S
        )
        for line in block.splitlines()
    )
    overrides = guide_command("custom-dataset.md", "test_custom_dataset_guide")
    assert "data.path=examples/custom_dataset.jsonl" in overrides
    out = tmp_path / "run"
    run_guide(coordinator_command, monkeypatch, out, overrides)

    items = {i["id"]: i for i in load_file(ROOT / "examples" / "custom_dataset.jsonl")}
    held_out = set(itertools.islice(items, len(items) // 10))
    assert held_out == {f"last-{i:03d}" for i in range(8)}  # what the guide says
    trained = [g["item_id"] for g in trained_groups(out)]
    # Every group trained is an item of the file, and none of the held-out ones.
    assert trained and set(trained) <= set(items) - held_out
    # The samples are the file's prompts, scored against its answers.
    by_prompt = {i["prompt"]: i for i in items.values()}
    for s in samples(out):
        item = by_prompt[decode(s["prompt_ids"])]
        completion = decode(s["completion_ids"])
        assert s["reward"] == (1.0 if completion.startswith(item["answer"]) else 0.0)


def test_custom_workflow_guide(tmp_path, coordinator_command, monkeypatch) -> None:
    source = (ROOT / "examples" / "custom_workflow.py").read_text()
    assert all(block in source for block in python_blocks("custom-workflow.md"))
    overrides = guide_command("custom-workflow.md", "test_custom_workflow_guide")
    assert "rollout.workflow_params.instruction=repeat" in overrides
    out = tmp_path / "run"
    run_guide(coordinator_command, monkeypatch, out, overrides)

    for s in samples(out):
        prompt, completion = decode(s["prompt_ids"]), decode(s["completion_ids"])
        # The workflow's prompt, scored by the run's reward (the echo task's first_char).
        assert re.fullmatch(r"repeat [0-9a-z]=", prompt), prompt
        assert s["reward"] == (1.0 if completion.startswith(prompt[-2]) else 0.0)


def test_a_wrong_reward_path_stops_the_run_at_start_naming_the_setting(
    tmp_path, coordinator_command, monkeypatch
) -> None:
    monkeypatch.chdir(ROOT)
    code, log = coordinator_command.run(
        tmp_path / "run",
        "data.task=echo",
        "rollout.reward=examples.custom_reward:partial_credt",
        *SHORT,
        timeout=120,
    )
    assert code != 0
    assert "rollout.reward: module 'examples.custom_reward' has no attribute 'partial_credt'" in log
    # Not a single episode ran with it.
    assert "failed on" not in log


def test_a_reward_that_raises_on_every_sample_stops_the_run_naming_the_error(
    tmp_path, coordinator_command, monkeypatch
) -> None:
    bound = RolloutSupervision().max_failed_episodes

    module = tmp_path / "mods" / "broken_reward.py"
    module.parent.mkdir()
    module.write_text(
        "def score(prompt, completion, prompt_ids, completion_ids, item):\n"
        "    return item['no_such_key']\n"
    )
    monkeypatch.chdir(ROOT)
    code, log = coordinator_command.run(
        tmp_path / "run",
        "data.task=echo",
        "rollout.reward=broken_reward:score",
        *SHORT,
        env={"PYTHONPATH": str(module.parent)},
        timeout=180,
    )
    assert code == 1, log
    assert f"error: {bound} episodes in a row failed in the run's own code" in log
    assert "and none was accepted" in log
    assert "KeyError: 'no_such_key'" in log
    # It stopped there instead of going through the dataset: no step was trained.
    assert not [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
