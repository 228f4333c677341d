"""HFEngine.load_weights(owned=True): received tensors become the parameters without copies."""

from __future__ import annotations

import asyncio

import pytest
import torch
from areal_servers.rollout.engine import SamplingConfig
from areal_servers.rollout.hf_engine import HFEngine
from areal_servers.rollout.weight_sync import WeightSyncServicer

from areal_grpc.config import ModelConfig, RolloutConfig
from areal_grpc.errors import PreconditionError
from areal_grpc.model import load_model


@pytest.fixture
def engine():
    eng = HFEngine(ModelConfig(source="builtin:micro", seed=0), RolloutConfig(dtype="float32"))
    yield eng
    asyncio.run(eng.close())


def _fresh(seed: int) -> dict[str, torch.Tensor]:
    sd = load_model("builtin:micro", seed=seed).state_dict()
    return {k: v.clone() for k, v in sd.items() if k != "lm_head.weight"}


def test_owned_tensors_are_installed_without_a_copy(engine):
    sd = _fresh(3)
    expected = {k: v.clone() for k, v in sd.items()}
    asyncio.run(engine.load_weights(sd, version=1, owned=True))
    assert engine.version == 1
    params = dict(engine.model.named_parameters(remove_duplicate=False))
    for name, t in sd.items():
        if name in params:
            assert params[name].data_ptr() == t.data_ptr(), name
    current = engine.model.state_dict()
    for name, t in expected.items():
        assert torch.equal(current[name], t), name
    if getattr(engine.model.config, "tie_word_embeddings", False):
        tied = current["lm_head.weight"], current["model.embed_tokens.weight"]
        assert tied[0].data_ptr() == tied[1].data_ptr()
    res = asyncio.run(engine.generate([4, 5], SamplingConfig(max_new_tokens=2, ignore_eos=True)))
    assert res.output_versions == [1, 1]


def test_owned_tensors_of_another_dtype_are_converted(engine):
    sd = {k: v.to(torch.float64) for k, v in _fresh(4).items()}
    asyncio.run(engine.load_weights(sd, version=1, owned=True))
    for name, t in engine.model.state_dict().items():
        if name in sd:
            assert t.dtype == torch.float32
            assert torch.equal(t, sd[name].to(torch.float32)), name


def test_default_load_keeps_private_copies(engine):
    sd = _fresh(5)
    expected = {k: v.clone() for k, v in sd.items()}
    asyncio.run(engine.load_weights(sd, version=1))
    for t in sd.values():
        t.zero_()
    current = engine.model.state_dict()
    for name, t in expected.items():
        assert torch.equal(current[name], t), name


def test_owned_load_refuses_stale_versions_and_bad_shapes(engine):
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(PreconditionError):
        asyncio.run(engine.load_weights(_fresh(6), version=0, owned=True))
    bad = _fresh(6)
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        asyncio.run(engine.load_weights(bad, version=2, owned=True))
    assert engine.version == 0
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_the_receiver_hands_its_tensors_over_and_keeps_the_replaced_ones_for_reuse(engine):
    served = {k: v.data_ptr() for k, v in engine.model.state_dict().items()}
    received = _fresh(4)
    receiver = WeightSyncServicer(engine)
    asyncio.run(receiver.state.load(received, version=1))
    # The received tensors are the parameters now (no copy)...
    params = engine.model.state_dict()
    assert all(params[k].data_ptr() == t.data_ptr() for k, t in received.items())
    # ...and the ones served before wait as the next update's receive buffers.
    assert receiver.spare and {k: t.data_ptr() for k, t in receiver.spare.items()} == {
        k: served[k] for k in receiver.spare
    }


def test_owned_load_hands_back_the_replaced_weights_nothing_uses_any_more(engine):
    before = {k: v.data_ptr() for k, v in engine.model.state_dict().items()}
    spare = asyncio.run(engine.load_weights(_fresh(7), version=1, owned=True))
    in_use = {t.untyped_storage().data_ptr() for t in engine.model.state_dict().values()}
    assert spare and set(spare) <= set(before)
    for name, t in spare.items():
        assert t.data_ptr() == before[name], name  # the weights version 0 was served from
        assert t.untyped_storage().data_ptr() not in in_use, name
    # Each storage once, even where two names shared it (tied embeddings).
    assert len({t.untyped_storage().data_ptr() for t in spare.values()}) == len(spare)
    assert asyncio.run(engine.load_weights(_fresh(8), version=2)) == {}  # copies: nothing back
