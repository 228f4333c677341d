"""Prefix sharing (servers/trainer/prefix_tree.py) is exact: the rows of a micro-batch packed as
tries give the unshared forward's per-token log-probs, loss and every parameter's gradient
(fp32, to 1e-5 relative), on GRPO-shaped groups, on rows that share nothing, and on multi-turn
sessions whose conversations extend and fork each other.

Why 1e-5: the packed forward sums the same terms (a masked key adds an exact zero after the
softmax) in another order and over wider rows, which moves each of the model's reductions by a
few fp32 ulps (1.2e-7 relative); through the micro model's layers that stays two orders of
magnitude under 1e-5.
"""

from __future__ import annotations

import random

import pytest
import torch
from areal_servers.trainer.algorithm import masked_token_logprobs, trainable_mask
from areal_servers.trainer.engine import TrainerEngine
from areal_servers.trainer.microbatch import MicroBatchSpec, split_microbatches
from areal_servers.trainer.prefix_tree import attention_weight, exact_for, pack_forest, sharing

from areal_grpc.config import LoraSettings, TrainerConfig
from areal_grpc.model import load_model, masked_logits
from areal_grpc.prefixes import prefix_nodes
from tests.support.prefix_sharing import batch_of, grpo_groups, sessions, unshared
from tests.support.trainer import MODEL, POLICY, config, with_exact_behaviour

RTOL = 1e-5


CASES = {"grpo groups": grpo_groups, "no shared prefix": unshared, "sessions": sessions}


@pytest.fixture(scope="module", params=["full", "lora"])
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    """The micro model, or the same with LoRA adapters (only they have gradients)."""
    torch.manual_seed(0)
    lora = LoraSettings(rank=4, alpha=8.0) if request.param == "lora" else None
    m = load_model(MODEL, lora=lora)
    m.config.use_cache = False
    if lora is not None:
        # Fresh adapters output zero (B = 0): make them count, so their gradients differ.
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.02)
    return m


def test_a_trie_holds_each_shared_prefix_once_and_each_node_sees_its_ancestors_only() -> None:
    batch = batch_of([[7, 8, 9, 1], [7, 8, 9, 2, 3], [7, 8, 4], [5, 6]], [2, 2, 2, 1], [0, 0, 0, 1])
    forest = pack_forest(batch["input_ids"], batch["attention_mask"], batch["group_index"])
    assert forest is not None
    # Group 0: 7 8 9 1 | 2 3 | 4 (7 nodes for 12 tokens); group 1: 5 6.
    assert (forest.nodes, forest.tokens) == (9, 14)
    assert forest.input_ids.tolist() == [[7, 8, 9, 1, 2, 3, 4], [5, 6, 0, 0, 0, 0, 0]]
    assert forest.position_ids.tolist() == [[0, 1, 2, 3, 3, 4, 2], [0, 1, 0, 0, 0, 0, 0]]
    seen = forest.attention_mask[0, 0]
    assert seen[5].nonzero().flatten().tolist() == [0, 1, 2, 4, 5]  # 3 sees 7 8 9 2 and itself
    assert seen[6].nonzero().flatten().tolist() == [0, 1, 6]  # 4 sees 7 8 and itself
    assert forest.node_of[1, :5].tolist() == [0, 1, 2, 4, 5]
    assert forest.node_of[3].tolist() == [7, 8, -1, -1, -1]  # group 1's row is trie 1 (W=7)
    # A row that is not right-padded has positions that are not its depths: not packed.
    left = batch["attention_mask"].clone()
    left[3] = torch.tensor([False, False, False, True, True])
    assert pack_forest(batch["input_ids"], left, batch["group_index"]) is None


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_log_probs_loss_and_every_gradient_equal_the_unshared_step(
    model: torch.nn.Module, case: str, seed: int
) -> None:
    batch = CASES[case](seed)
    ids, attn = batch["input_ids"], batch["attention_mask"]
    mask = trainable_mask(batch["loss_mask"], attn)
    # Rows that share nothing pack as one row of separate roots (apart, each its own trie,
    # they would cost as much as unpacked and are left so).
    forest = pack_forest(ids, attn, None if case == "no shared prefix" else batch["group_index"])
    assert forest is not None
    if case == "no shared prefix":
        assert forest.nodes == forest.tokens
    else:
        assert forest.nodes < forest.tokens
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(seed))

    def step(packed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        model.zero_grad(set_to_none=True)
        forward = (
            forest.forward(model)
            if packed
            else (lambda keep: masked_logits(model, ids, attn, keep))
        )
        logp, entropy = masked_token_logprobs(forward, ids, mask)
        # A loss of the shape PPO's is: a weighted sum over the trained tokens.
        loss = (logp * weights * mask).sum() + 0.1 * (entropy * mask).sum()
        loss.backward()
        grads = {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }
        return logp.detach(), entropy.detach(), loss.detach(), grads

    logp, entropy, loss, grads = step(packed=True)
    ref_logp, ref_entropy, ref_loss, ref_grads = step(packed=False)
    assert bool(mask.any())
    torch.testing.assert_close(logp, ref_logp, rtol=RTOL, atol=RTOL * float(ref_logp.abs().max()))
    torch.testing.assert_close(entropy, ref_entropy, rtol=RTOL, atol=RTOL)
    assert abs(float(loss - ref_loss)) <= RTOL * abs(float(ref_loss))
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in ref_grads.items():
        # Norm-wise: an entry near zero has no meaningful relative error of its own.
        assert float((grads[name] - g).norm()) <= RTOL * float(g.norm()), name


def test_a_trainer_step_with_shared_prefixes_equals_one_without_and_records_the_ratio() -> None:
    torch.manual_seed(0)
    batch = grpo_groups(3)
    results, models = {}, {}
    for setting in ("on", "off"):
        cfg = config(fsdp=False)
        cfg.prefix_sharing = setting  # type: ignore[assignment]
        engine = TrainerEngine(cfg, POLICY)
        assert engine.prefix_sharing == (setting == "on")
        b, _ = with_exact_behaviour(engine.model, dict(batch))
        results[setting] = engine.train_step(b)
        models[setting] = engine
    on, off = results["on"], results["off"]
    forest = pack_forest(batch["input_ids"], batch["attention_mask"], batch["group_index"])
    assert forest is not None
    assert on.extra["prefix_sharing_ratio"] == pytest.approx(forest.nodes / forest.tokens)
    assert on.extra["prefix_sharing_ratio"] < 1.0
    assert "prefix_sharing_ratio" not in off.extra
    for field in ("loss", "entropy", "importance_weight_mean", "clip_fraction"):
        a, b = getattr(on, field), getattr(off, field)
        assert abs(a - b) <= RTOL * max(abs(b), 1e-3), field
    assert on.trained_tokens == off.trained_tokens


def test_sharing_is_on_where_exact_and_on_is_refused_where_not(model: torch.nn.Module) -> None:
    assert exact_for(model) == (True, "")
    assert sharing("auto", model) == (True, "auto: exact for this model")
    assert sharing("off", model) == (False, "as set")
    model.config._attn_implementation = "flash_attention_2"
    try:
        assert sharing("auto", model)[0] is False
        with pytest.raises(ValueError, match=r"trainer\.prefix_sharing"):
            sharing("on", model)
    finally:
        model.config._attn_implementation = "sdpa"


@pytest.mark.parametrize("seed", range(5))
def test_prefix_nodes_counts_the_nodes_of_the_packed_trie(seed: int) -> None:
    for make in CASES.values():
        batch = make(seed)
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        rows = [batch["input_ids"][i, :n].tolist() for i, n in enumerate(lengths)]
        for trie_of in (batch["group_index"], None):
            forest = pack_forest(batch["input_ids"], batch["attention_mask"], trie_of)
            if forest is None:  # rows that share nothing, each its own trie: no cheaper
                assert make is unshared and trie_of is not None
                continue
            keys = trie_of.tolist() if trie_of is not None else [0] * len(rows)
            counted = sum(
                prefix_nodes([r for r, k in zip(rows, keys, strict=True) if k == key])
                for key in set(keys)
            )
            assert counted == forest.nodes
    assert prefix_nodes([]) == 0
    assert prefix_nodes([[1, 2, 3], [1, 2, 3], [1, 2], [1, 4], [5]]) == 5


def test_micro_batches_keep_a_group_together_and_count_its_trie_against_the_budget() -> None:
    # Two groups of 4 rows: a 10-token prompt and 3 tokens of their own each (52 tokens,
    # 22 nodes per group).
    rows, groups = [], []
    for g in range(2):
        prompt = list(range(10 + 20 * g, 20 + 20 * g))
        rows += [prompt + [100 + 10 * k + j for j in range(3)] for k in range(4)]
        groups += [g] * 4
    batch = batch_of(rows, [10] * 8, groups)
    shared = split_microbatches(batch, MicroBatchSpec(max_tokens_per_mb=50, share_prefixes=True))
    assert [r for r, _ in shared] == [list(range(8))]  # 44 nodes fit in 50
    apart = split_microbatches(batch, MicroBatchSpec(max_tokens_per_mb=50))
    assert len(apart) == 3 and sorted(r for rows, _ in apart for r in rows) == list(range(8))
    # A budget under both groups: one micro-batch per group, each group whole.
    per_group = split_microbatches(batch, MicroBatchSpec(max_tokens_per_mb=30, share_prefixes=True))
    assert sorted(r for r, _ in per_group) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # A group over the budget (22 nodes in 20) goes row by row: 13 tokens each, one per
    # micro-batch.
    rowwise = split_microbatches(batch, MicroBatchSpec(max_tokens_per_mb=20, share_prefixes=True))
    assert sorted(r for r, _ in rowwise) == [[i] for i in range(8)]


def test_rows_that_would_cost_more_packed_stay_apart(model: torch.nn.Module) -> None:
    # Two 400-token rows sharing their first 8 tokens: the packed row is 792 wide, and its
    # attention (every node over all 792 keys) costs more than the two rows' own.
    rng = random.Random(0)
    head = [rng.randrange(3, 380) for _ in range(8)]
    rows = [head + [rng.randrange(3, 380) for _ in range(392)] for _ in range(2)]
    batch = batch_of(rows, [8, 8], [0, 0])
    weight = attention_weight(model)
    # The micro model: hidden 64, MLP 256, 4 heads and 4 k/v heads.
    assert weight == pytest.approx(2 * 64 / (2 * 64 * 64 + 2 * 64 * 64 + 3 * 64 * 256))
    args = (batch["input_ids"], batch["attention_mask"], batch["group_index"], 0)
    # 792 * (1 + 792 w) = 2015 token-costs packed against 2 * 400 * (1 + 400 w) = 1425.
    assert pack_forest(*args, weight) is None
    packed = pack_forest(*args, 0.0)  # counting tokens alone, sharing 8 of 800 pays
    assert packed is not None and packed.nodes == 792
    # The same rows as a group of short completions of one long prompt pack.
    short = [head * 40 + [rng.randrange(3, 380) for _ in range(4)] for _ in range(8)]
    group = batch_of(short, [320] * 8, [0] * 8)
    assert pack_forest(group["input_ids"], group["attention_mask"], None, 0, weight) is not None


def two_minibatches(setting: str, prox_logp_method: str) -> TrainerConfig:
    """A one-process trainer with ``trainer.prefix_sharing`` at ``setting``, two updates per
    step (so the proximal log-probs are ``prox_logp_method``'s), 40 tokens per micro-batch."""
    cfg = config(fsdp=False, max_tokens=40)
    cfg.prefix_sharing = setting  # type: ignore[assignment]
    cfg.ppo.n_minibatches = 2
    cfg.ppo.prox_logp_method = prox_logp_method  # type: ignore[assignment]
    return cfg


def test_the_proximal_and_reference_log_probs_with_shared_prefixes_equal_the_unshared_ones() -> (
    None
):
    """The recompute path (several updates per step) and the reference policy (a KL term) go
    through the packed forward too: their log-probs, recomputed before any update, equal the
    unshared ones to 1e-5 (the micro-batches differ: sharing packs them by group)."""
    batch = grpo_groups(5)
    got = {}
    for setting in ("on", "off"):
        cfg = two_minibatches(setting, "recompute")
        cfg.ppo.kl_loss_coef = 0.1
        engine = TrainerEngine(cfg, POLICY)
        plan = engine.plan_step(dict(batch))
        assert engine.proximal_mode(plan) == "recompute"
        engine.proximal_logprobs(plan, "recompute")
        if setting == "on":
            assert len(engine._forests) > 0  # packed micro-batches were used
        out = {k: torch.zeros(batch["input_ids"].shape) for k in ("prox_logp", "ref_logp")}
        for rows, mb in plan.microbatches:
            for key, full in out.items():
                width = mb[key].shape[1]
                full[rows, :width] = mb[key]
        got[setting] = out
    for key in ("prox_logp", "ref_logp"):
        ref = got["off"][key]
        assert bool(ref.ne(0).any())
        torch.testing.assert_close(
            got["on"][key], ref, rtol=RTOL, atol=RTOL * float(ref.abs().max())
        )


@pytest.mark.parametrize("method", ["loglinear", "metrics", "recompute"])
def test_loglinear_proximal_log_probs_with_shared_prefixes_equal_the_unshared_ones(
    method: str,
) -> None:
    """The loglinear path reads the packed training forward, each micro-batch's behaviour
    log-probs and versions (sharing regroups the rows): with stale tokens of three versions
    and two updates, the behaviour weights, the clipped fraction and loglinear's measured
    error ("metrics") equal the unshared step's to 1e-5. These are sums over tokens; the loss
    is a mean per update, and the mini-batches differ (sharing keeps a group in one). The
    learning rate is 0 so that the second update runs on the same weights on both sides (Adam
    would otherwise magnify last-bit differences)."""
    batch = grpo_groups(7)
    results = {}
    for setting in ("on", "off"):
        cfg = two_minibatches(setting, method)
        cfg.optimizer.lr = 0.0
        engine = TrainerEngine(cfg, POLICY)
        engine.version = 3
        b, _ = with_exact_behaviour(engine.model, dict(batch))
        gen = torch.Generator().manual_seed(7)
        stale = torch.randint(1, 4, b["versions"].shape, generator=gen)
        b["versions"] = torch.where(b["versions"] >= 0, stale, b["versions"])
        noise = 0.3 * torch.randn(b["logprobs"].shape, generator=gen)
        b["logprobs"] = (b["logprobs"] - noise.abs()) * b["loss_mask"]
        assert engine.proximal_mode(engine.plan_step(dict(b))) == method
        results[setting] = engine.train_step(b)
    on, off = results["on"], results["off"]
    assert on.extra["prefix_sharing_ratio"] < 1.0
    fields = ["importance_weight_mean", "importance_weight_max", "clip_fraction", "entropy"]
    for field in fields:
        a, b = getattr(on, field), getattr(off, field)
        assert abs(a - b) <= RTOL * max(abs(b), 1e-3), field
    if method == "metrics":
        for key in ("prox_approx_abs_error", "prox_approx_weight_error"):
            a, b = on.extra[key], off.extra[key]
            assert b > 0 and abs(a - b) <= RTOL * b, key
