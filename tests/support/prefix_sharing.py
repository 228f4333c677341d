"""Batches whose rows share prefixes, as the trainer gets them: GRPO groups (completions of one
prompt), rows that share nothing, and agent sessions (conversations that extend and fork)."""

from __future__ import annotations

import random

import torch


def batch_of(rows: list[list[int]], prompts: list[int], groups: list[int]) -> dict:
    """A right-padded batch of token rows (``prompts``: each row's untrained lead)."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    attn = torch.zeros(len(rows), width, dtype=torch.bool)
    loss = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (row, p) in enumerate(zip(rows, prompts, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = True
        loss[i, p : len(row)] = True
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": loss,
        "group_index": torch.tensor(groups),
        "rewards": torch.tensor([float(i % 2) for i in range(len(rows))]),
        "logprobs": torch.zeros(len(rows), width),
        "versions": torch.where(loss, 0, -1),
    }


def grpo_groups(seed: int) -> dict:
    """3 groups of 4 completions of one prompt each; some completions equal, some sharing
    their first tokens, lengths 1-7."""
    rng = random.Random(seed)
    rows, prompts, groups = [], [], []
    for g in range(3):
        prompt = [rng.randrange(3, 380) for _ in range(rng.randrange(4, 9))]
        first: list[int] = []
        for k in range(4):
            if k == 1:
                completion = list(first)  # the same completion twice
            elif k == 2:
                completion = first[:2] + [rng.randrange(3, 380) for _ in range(3)]  # a fork
            else:
                completion = [rng.randrange(3, 380) for _ in range(rng.randrange(1, 8))]
            first = first or completion
            rows.append(prompt + completion)
            prompts.append(len(prompt))
            groups.append(g)
    return batch_of(rows, prompts, groups)


def unshared(seed: int) -> dict:
    """6 rows of random tokens, each its own group: nothing to share."""
    rng = random.Random(seed)
    rows = [[rng.randrange(3, 380) for _ in range(rng.randrange(3, 12))] for _ in range(6)]
    return batch_of(rows, [2] * 6, list(range(6)))


def sessions(seed: int) -> dict:
    """Two agent sessions (one group each) as the gateway records them: a conversation, the
    same conversation one turn further (it extends the first), and a fork after turn 1."""
    rng = random.Random(seed)

    def turn(n: int) -> list[int]:
        return [rng.randrange(3, 380) for _ in range(n)]

    rows, prompts, groups = [], [], []
    for g in range(2):
        system, user1, reply1 = turn(6), turn(4), turn(5)
        user2, reply2 = turn(3), turn(4)
        other_user2, other_reply2 = turn(2), turn(6)
        first = system + user1
        rows += [
            first + reply1,
            first + reply1 + user2 + reply2,
            first + reply1 + other_user2 + other_reply2,
        ]
        prompts += [len(first)] * 3
        groups += [g] * 3
    return batch_of(rows, prompts, groups)
