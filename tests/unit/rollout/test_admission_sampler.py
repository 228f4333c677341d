"""The hf engine's two pure pieces: who joins the batch (admission) and how a step's tokens
are drawn (sampler). No model, no threads, no sockets."""

from __future__ import annotations

import math
from collections import deque

import torch
from areal_servers.rollout.admission import admit, fits
from areal_servers.rollout.engine import SamplingConfig
from areal_servers.rollout.sampler import sample


def test_admission_is_first_come_first_served_within_rows_and_kv_budget():
    # Each request is its KV slot count.
    pending = deque([5, 6, 2, 2])
    # Room for 5: 2 rows x 5 = 10 <= 12; then 6 would make 3 rows x 6 = 18 > 12, and the
    # small ones behind it wait their turn (no overtaking).
    assert admit(pending, [5], max_running=8, budget=12, slots=int) == [5]
    assert list(pending) == [6, 2, 2]
    # No budget: only the row limit.
    assert admit(pending, [5, 5], max_running=4, budget=None, slots=int) == [6, 2]
    assert list(pending) == [2]
    # A lone row always fits (one that never could is refused when it arrives).
    assert fits([], 100, budget=10, slots=int)
    assert not fits([3], 9, budget=17, slots=int) and fits([3], 8, budget=16, slots=int)


def test_greedy_rows_take_the_argmax_with_its_untempered_logprob_and_top_alternatives():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    params = [SamplingConfig(temperature=0.0, top_logprobs=2), SamplingConfig(temperature=0.0)]
    out = sample(logits, params, torch.Generator().manual_seed(0), [None, None])
    assert out.tokens == [1, 0] and not out.fell_back
    want = torch.log_softmax(logits, dim=-1)
    assert out.logprobs == [float(want[0, 1]), float(want[1, 0])]
    [(ids, lps)] = out.top[0]
    assert ids == [1, 2] and lps == [float(want[0, 1]), float(want[0, 2])]
    assert out.top[1] == []


def test_a_row_with_non_finite_logits_falls_back_to_its_argmax():
    logits = torch.tensor([[float("nan"), 1.0, 5.0], [0.0, 0.0, 0.0]])
    params = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=1.0)]
    out = sample(logits, params, torch.Generator().manual_seed(0), [None, None])
    assert out.fell_back and out.tokens[0] == 2
    assert 0 <= out.tokens[1] < 3 and abs(out.logprobs[1] - math.log(1 / 3)) < 1e-6


def test_a_seeded_row_draws_the_same_token_whatever_shares_its_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=gen)
    cfg = SamplingConfig(temperature=1.0, top_k=10, top_p=0.9)

    def seeded() -> torch.Generator:
        return torch.Generator().manual_seed(123)

    alone = sample(logits[1:2], [cfg], torch.Generator().manual_seed(5), [seeded()])
    shared = sample(logits, [cfg] * 3, torch.Generator().manual_seed(9), [None, seeded(), None])
    assert shared.tokens[1] == alone.tokens[0]
    # Truncation: the token is among the row's 10 most likely.
    assert alone.tokens[0] in logits[1].topk(10).indices.tolist()
