"""Shared data for the trainer tests: random trajectories near the initial policy."""

from __future__ import annotations

import pytest
import torch
from areal_servers.trainer.algorithm import token_logprobs

from areal_grpc.model import load_model

MODEL = "builtin:micro"


def random_batch(
    n_groups: int = 4, group_size: int = 2, seed: int = 0, length: int | None = None
) -> dict[str, torch.Tensor]:
    """Random prompts + completions with behaviour log-probs near the initial policy's.

    ``length``: every row that long, with a 3-token prompt (equal tokens per row).
    """
    gen = torch.Generator().manual_seed(seed)
    rows = n_groups * group_size
    lengths = torch.randint(6, 14, (rows,), generator=gen)
    prompts = torch.randint(2, 5, (rows,), generator=gen)
    if length is not None:
        lengths, prompts = torch.full((rows,), length), torch.full((rows,), 3)
    s = int(lengths.max())
    ids = torch.zeros(rows, s, dtype=torch.int64)
    attn = torch.zeros(rows, s, dtype=torch.bool)
    loss = torch.zeros(rows, s, dtype=torch.bool)
    for i in range(rows):
        n = int(lengths[i])
        ids[i, :n] = torch.randint(3, 384, (n,), generator=gen)
        attn[i, :n] = True
        loss[i, int(prompts[i]) : n] = True
    model = load_model(MODEL)
    with torch.no_grad():
        logp, _ = token_logprobs(model(input_ids=ids, attention_mask=attn).logits, ids)
    behave = (logp + 0.05 * torch.randn(rows, s, generator=gen)).clamp(max=0) * loss
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": loss,
        "logprobs": behave.float(),
        "versions": torch.where(loss, 0, -1),
        "rewards": torch.randint(0, 2, (rows,), generator=gen).float(),
        "group_index": torch.arange(n_groups).repeat_interleave(group_size),
    }


@pytest.fixture
def make_batch():
    """``make_batch(n_groups=4, group_size=2, seed=0)`` -> a padded trajectory batch."""
    return random_batch
