"""Prompt data from JSONL / Parquet files (datasets library) and the arithmetic generator."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from areal_clients.rollout import item_struct
from google.protobuf import json_format

from areal_grpc.config import load_config, preflight
from areal_grpc.coordinator.dataloader import load_items
from areal_grpc.data import MIX, arithmetic_items, load_file, write_arithmetic
from areal_grpc.errors import FieldError
from areal_grpc.rewards import gsm8k_reward
from servers.rollout.workflows import ChatSettings


def _value(question: str) -> int:
    """The answer of a generated question, worked out independently of the generator."""
    numbers = [int(n) for n in re.findall(r"\d+", question)]
    if "gives away" in question:
        return numbers[0] - numbers[1]
    return numbers[0] + numbers[1]


def test_the_arithmetic_set_is_seeded_disjoint_correct_and_mixed_as_asked() -> None:
    train, test = arithmetic_items(400, 100, seed=3)
    assert (train, test) == arithmetic_items(400, 100, seed=3)
    assert arithmetic_items(400, 100, seed=4)[1] != test
    assert len(train) == 400 and len(test) == 100
    assert not {i["question"] for i in test} & {i["question"] for i in train}
    assert len({i["question"] for i in test}) == 100
    for item in train + test:
        value = _value(item["question"])
        assert item["answer"].endswith(f"#### {value}"), item
        # The gsm8k reward scores a reply ending in the number, and only the right number.
        assert gsm8k_reward("", f"The answer is {value}.", [], [], item) == 1.0
        assert gsm8k_reward("", f"The answer is {value + 1}.", [], [], item) == 0.0
    kinds = Counter(i["kind"] for i in test)
    assert kinds == {k: int(100 * w / sum(MIX.values())) for k, w in MIX.items()}
    two_digit = [i for i in test if i["kind"] == "add_2_2"]
    assert all(len(re.findall(r"\b\d{2}\b", i["question"])) == 2 for i in two_digit)
    assert any("How many" in i["question"] for i in test)


def test_the_ordered_sums_put_the_two_digit_number_first_and_the_others_either_one() -> None:
    train, _ = arithmetic_items(200, 0, seed=1, mix={"add_2_1_ordered": 1.0, "add_2_1": 1.0})

    def firsts(kind: str) -> set[int]:
        return {len(re.findall(r"\d+", i["question"])[0]) for i in train if i["kind"] == kind}

    assert firsts("add_2_1_ordered") == {2}
    assert firsts("add_2_1") == {1, 2}


def test_an_unknown_kind_or_an_impossible_count_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown kinds"):
        arithmetic_items(10, 10, mix={"add_9_9": 1.0})
    # 1-digit sums have 100 distinct questions: 150 held-out ones cannot exist.
    with pytest.raises(ValueError, match="fewer than"):
        arithmetic_items(10, 150, mix={"add_1_1": 1.0})


def test_jsonl_and_parquet_files_load_the_same_items(tmp_path: Path) -> None:
    train_path, _ = write_arithmetic(tmp_path / "arith", n_train=50, n_test=10, seed=1)
    from_jsonl = load_file(train_path)
    rows = [json.loads(line) for line in train_path.read_text().splitlines()]
    assert from_jsonl == rows
    import datasets

    parquet = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    assert load_file(parquet) == rows


@pytest.mark.parametrize(
    ("name", "content", "why"),
    [
        ("items.csv", "a,b\n", "use a .jsonl"),
        ("missing.jsonl", None, "does not exist"),
        ("empty.jsonl", "", "cannot be read|holds no items"),
        ("broken.jsonl", '{"question": \n', "cannot be read"),
    ],
)
def test_bad_data_files_are_field_errors(tmp_path: Path, name, content, why) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(FieldError, match=why) as info:
        load_file(path, "data.eval_path")
    assert info.value.field == "data.eval_path"


def test_a_run_reads_train_and_held_out_files_through_its_config(tmp_path: Path) -> None:
    train_path, test_path = write_arithmetic(tmp_path, n_train=40, n_test=8, seed=2)
    cfg = load_config(None, ["data.task=gsm8k", f"data.path={train_path}"])
    # One file: its first 10% is held out.
    assert [i["question"] for i in load_items(cfg, "eval")] == [
        i["question"] for i in load_file(train_path)[:4]
    ]
    assert len(load_items(cfg, "train")) == 36
    cfg = load_config(
        None, ["data.task=gsm8k", f"data.path={train_path}", f"data.eval_path={test_path}"]
    )
    train, held_out = load_items(cfg, "train"), load_items(cfg, "eval")
    assert len(train) == 40 and len(held_out) == 8
    assert all(i["task"] == "gsm8k" for i in train + held_out)
    assert len({i["id"] for i in train + held_out}) == 48
    missing = load_config(None, [f"data.path={train_path}", f"data.eval_path={tmp_path / 'nope'}"])
    with pytest.raises(FieldError) as info:
        preflight(missing)  # files are checked where the run launches
    assert info.value.field == "data.eval_path"


def test_the_generator_command_writes_both_splits(tmp_path: Path) -> None:
    out = tmp_path / "arith"
    args = ["arith", "--out", str(out), "--train", "20", "--test", "8"]
    done = subprocess.run(
        [sys.executable, "-m", "areal_grpc.data", *args, "--mix", "add_2_2=1,word=1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    test = load_file(out / "test.jsonl")
    assert len(load_file(out / "train.jsonl")) == 20 and len(test) == 8
    assert {i["kind"] for i in test} == {"add_2_2", "word"}


# --- verl's Parquet shape -------------------------------------------------------------------

# Rows as verl's GSM8K preprocessing writes them (a chat prompt, the answer under reward_model).
VERL_ROWS = [
    ("Natalia sold 48 clips in April and half as many in May. How many in all?", "72"),
    ("Weng earns $12 an hour. She worked 50 minutes. How much did she earn?", "10"),
    ("Betty has half of the $100 she needs, her parents give $15, grandparents twice that.", "5"),
    ("James writes a 3-page letter to 2 friends twice a week. Pages a year?", "624"),
]
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def _verl_rows() -> list[dict]:
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": "train", "index": i},
        }
        for i, (question, truth) in enumerate(VERL_ROWS)
    ]


def test_a_verl_parquet_file_loads_as_it_is(tmp_path: Path) -> None:
    import datasets

    path = tmp_path / "gsm8k-train.parquet"
    datasets.Dataset.from_list(_verl_rows()).to_parquet(str(path))
    cfg = load_config(
        None,
        ["data.task=gsm8k", f"data.path={path}", f"data.eval_path={path}", "rollout.reward=task"],
    )
    items = load_items(cfg, "train")
    assert len(items) == len(VERL_ROWS)
    for i, (item, (question, truth)) in enumerate(zip(items, VERL_ROWS, strict=True)):
        content = f"{question} {INSTRUCTION}"
        assert item["messages"] == [{"role": "user", "content": content}]
        assert item["prompt"] == content  # the plain text, for a model without a chat template
        assert item["answer"] == truth
        # verl's own columns stay, for a reward of one's own.
        assert item["reward_model"] == {"style": "rule", "ground_truth": truth}
        assert item["data_source"] == "openai/gsm8k" and item["ability"] == "math"
        assert item["extra_info"] == {"split": "train", "index": i}
        # What the rollout server receives: the chat is the item's messages, and the task's
        # reward (gsm8k) scores the final number against the ground truth.
        received = json_format.MessageToDict(item_struct(item))
        assert ChatSettings("on").messages(received, None) == item["messages"]
        assert gsm8k_reward("", f"... so the answer is #### {truth}", [], [], received) == 1.0
        assert gsm8k_reward("", f"#### {int(truth) + 1}", [], [], received) == 0.0


def test_a_verl_ground_truth_given_as_a_number_is_its_text(tmp_path: Path) -> None:
    import datasets

    rows = _verl_rows()[:3]
    for row in rows:
        row["reward_model"]["ground_truth"] = int(row["reward_model"]["ground_truth"])
    path = tmp_path / "numeric.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    assert [i["answer"] for i in load_file(path)] == ["72", "10", "5"]


def test_a_verl_parquet_file_without_a_prompt_is_a_field_error(tmp_path: Path) -> None:
    import datasets

    rows = [{k: v for k, v in row.items() if k != "prompt"} for row in _verl_rows()]
    path = tmp_path / "no-prompt.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    cfg = load_config(None, ["data.task=gsm8k", f"data.path={path}"])
    with pytest.raises(FieldError, match=r"row 0 is in verl.s shape .* has no prompt") as info:
        load_items(cfg, "train")
    assert info.value.field == "data.path"
    broken = _verl_rows()
    broken[2]["prompt"] = [{"role": "user", "content": None}]
    path = tmp_path / "bad-message.parquet"
    datasets.Dataset.from_list(broken).to_parquet(str(path))
    with pytest.raises(FieldError, match=r"row 2: prompt\[0\] needs role and content") as info:
        load_file(path, "data.eval_path")
    assert info.value.field == "data.eval_path"
