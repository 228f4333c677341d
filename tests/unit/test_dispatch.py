"""Dispatch of whole groups across trainer ranks by token count."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_grpc.dispatch import (
    DEFAULT_METHOD,
    METHODS,
    balance_ratio,
    dispatch_groups,
    rank_loads,
)


def test_default_is_least_loaded_with_refinement():
    assert DEFAULT_METHOD == "lpt_refine"
    counts = [5, 4, 3, 3, 3]
    # The greedy pass alone leaves 8 / 10; the default reaches 9 / 9.
    assert rank_loads(counts, dispatch_groups(counts, 2, "lpt")) == [8, 10]
    assert rank_loads(counts, dispatch_groups(counts, 2)) == [9, 9]


def test_known_plans_where_ffd_balances_counts_not_tokens():
    counts = [9, 1, 1, 1]
    # AReaL's fewest-items rule balances counts: the big group gets company.
    ffd = dispatch_groups(counts, 2, "ffd")
    assert ffd == [[0, 3], [1, 2]]
    assert rank_loads(counts, ffd) == [10, 2]
    lpt = dispatch_groups(counts, 2)
    assert lpt == [[0], [1, 2, 3]]
    assert rank_loads(counts, lpt) == [9, 3]
    assert dispatch_groups(counts, 2, "round_robin") == [[0, 2], [1, 3]]
    assert balance_ratio(counts, lpt) == pytest.approx(1.5)
    assert balance_ratio(counts, ffd) == pytest.approx(10 / 6)


@pytest.mark.parametrize("method", METHODS)
def test_fewer_groups_than_ranks_leaves_ranks_empty(method):
    plan = dispatch_groups([5, 7], 4, method)
    assert len(plan) == 4
    assert sorted(i for r in plan for i in r) == [0, 1]
    assert sum(1 for r in plan if not r) == 2


@pytest.mark.parametrize("method", METHODS)
def test_empty_batch_gives_every_rank_an_empty_list(method):
    assert dispatch_groups([], 3, method) == [[], [], []]


@settings(max_examples=50, deadline=None)
@given(
    counts=st.lists(st.integers(0, 50_000), max_size=64),
    n_ranks=st.integers(1, 8),
    method=st.sampled_from(METHODS),
)
def test_every_group_goes_to_exactly_one_rank(counts, n_ranks, method):
    plan = dispatch_groups(counts, n_ranks, method)
    assert len(plan) == n_ranks
    assert sorted(i for r in plan for i in r) == list(range(len(counts)))
    # Oldest group first within a rank, and the same plan on every call.
    assert all(r == sorted(r) for r in plan)
    assert dispatch_groups(counts, n_ranks, method) == plan
    assert sum(rank_loads(counts, plan)) == sum(counts)


@settings(max_examples=50, deadline=None)
@given(counts=st.lists(st.integers(1, 50_000), min_size=1, max_size=64), n_ranks=st.integers(1, 8))
def test_default_busiest_rank_within_one_group_of_the_mean_and_no_worse_than_lpt(counts, n_ranks):
    loads = rank_loads(counts, dispatch_groups(counts, n_ranks))
    assert max(loads) <= sum(counts) / n_ranks + max(counts)
    assert max(loads) <= max(rank_loads(counts, dispatch_groups(counts, n_ranks, "lpt")))


def test_equal_groups_split_evenly():
    plan = dispatch_groups([100] * 8, 4)
    assert rank_loads([100] * 8, plan) == [200, 200, 200, 200]
    assert balance_ratio([100] * 8, plan) == 1.0


def test_balance_ratio_of_empty_batch_is_one():
    assert balance_ratio([], [[], []]) == 1.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_ranks"):
        dispatch_groups([1], 0)
    with pytest.raises(ValueError, match="unknown dispatch method 'kk'; choose one of lpt_refine"):
        dispatch_groups([1], 2, "kk")
    with pytest.raises(ValueError, match="negative"):
        dispatch_groups([1, -2], 2)
