"""Built-in tasks (deterministic splits, Struct-safe items) and reward functions."""

from __future__ import annotations

import pytest
from google.protobuf import json_format, struct_pb2

from areal_grpc import rewards, tasks
from areal_grpc.model import load_tokenizer


def test_first3_is_deterministic_by_seed_and_eval_is_held_out():
    a, b = tasks.load_task("first3", seed=3), tasks.load_task("first3", seed=3)
    assert a == b
    other = tasks.load_task("first3", seed=4)
    assert [i["prompt"] for i in a.eval] != [i["prompt"] for i in other.eval]
    train_prompts = {i["prompt"] for i in a.train}
    eval_prompts = {i["prompt"] for i in a.eval}
    assert len(eval_prompts) == 200
    assert len(train_prompts) + len(eval_prompts) == 26**3
    assert not train_prompts & eval_prompts
    for item in a.eval[:20]:
        assert item["prompt"][3] == "=" and item["answer"] == item["prompt"][0]


def test_echo_covers_all_36_prompts():
    splits = tasks.load_task("echo", seed=0)
    assert sorted(i["answer"] for i in splits.train) == sorted(i["answer"] for i in splits.eval)
    assert len(splits.eval) == 36
    assert all(i["prompt"] == i["answer"] + "=" for i in splits.eval)


def test_items_round_trip_through_protobuf_struct():
    item = tasks.task_dataset("first3", "train", seed=0)[0]
    struct = struct_pb2.Struct()
    struct.update(item)
    assert json_format.MessageToDict(struct) == item


def test_task_dataset_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown task"):
        tasks.task_dataset("nope")
    with pytest.raises(ValueError, match="unknown split"):
        tasks.task_dataset("echo", "test")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so she has 5 + 7 = 12 apples.\n#### 12", "12"),
        ("The answer is 1,234.", "1234"),
        ("x = \\boxed{3/4} done, step 9", "3/4"),
        ("first 3 then -2.50", "-2.50"),
        ("no digits here", None),
    ],
)
def test_extract_final_number(text, expected):
    assert rewards.extract_final_number(text) == expected


def test_gsm8k_reward_compares_numerically():
    item = {"question": "q", "answer": "Natalia sold 48/2 = 24 clips.\n#### 72"}
    assert rewards.gsm8k_reward("q", "She sold 72.0 clips in all", [], [], item) == 1.0
    assert rewards.gsm8k_reward("q", "the answer is 72", [], [], {"answer": "72"}) == 1.0
    assert rewards.gsm8k_reward("q", "#### 0.75", [], [], {"answer": "3/4"}) == 1.0
    assert rewards.gsm8k_reward("q", "the answer is 71", [], [], item) == 0.0
    assert rewards.gsm8k_reward("q", "I do not know", [], [], item) == 0.0


def test_builtin_task_reward_reads_first_generated_character():
    tok = load_tokenizer("builtin:tiny")
    item = tasks.task_dataset("first3", "eval", seed=0)[0]
    right = [*tok.encode(item["answer"], add_special_tokens=False), tok.eos_token_id]
    text = tok.decode(right, skip_special_tokens=True)
    assert rewards.task_reward(item["prompt"], text, [], right, item) == 1.0
    assert rewards.task_reward(item["prompt"], "", [], [tok.eos_token_id], item) == 0.0
    wrong = "z" if item["answer"] != "z" else "y"
    assert rewards.task_reward(item["prompt"], wrong, [], [], item) == 0.0


def test_reward_registry_by_short_name_and_import_path():
    assert rewards.get_reward_fn("gsm8k") is rewards.gsm8k_reward
    assert rewards.get_reward_fn("areal_grpc.rewards:first_char_reward") is (
        rewards.first_char_reward
    )
    with pytest.raises(ValueError, match="unknown reward function"):
        rewards.get_reward_fn("nope")
    with pytest.raises(ValueError, match="no attribute"):
        rewards.get_reward_fn("areal_grpc.rewards:missing")
    with pytest.raises(ValueError, match="cannot import"):
        rewards.get_reward_fn("no_such_module_xyz:fn")
