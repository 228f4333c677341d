"""Loading a checkpoint never runs code written into it.

A plain-process engine saves a real DCP checkpoint (model, AdamW state, scheduler); its
``.metadata`` pickle or one of its byte entries is then replaced by a pickle that would create
a file when unpickled by ``pickle.load`` / ``torch.load(weights_only=False)`` (what DCP does
by default). The trainer must refuse the checkpoint, create nothing, and keep its state.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from areal_servers.trainer.engine import TrainerEngine
from areal_servers.trainer.safe_checkpoint import UnsafeCheckpointError
from torch.distributed.checkpoint import FileSystemReader

from areal_grpc.config import ModelConfig, OptimizerSettings, TrainerConfig


class _Touch:
    """Unpickling this calls ``os.system`` (a stand-in for arbitrary code)."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.target}",)


def engine() -> TrainerEngine:
    return TrainerEngine(
        TrainerConfig(fsdp=False, device="cpu", optimizer=OptimizerSettings(lr=1e-3)),
        ModelConfig(source="builtin:micro"),
    )


@pytest.fixture()
def saved(make_batch, tmp_path: Path) -> tuple[TrainerEngine, Path]:
    e = engine()
    e.train_step(make_batch(seed=1))
    path = tmp_path / "ckpt"
    e.save_checkpoint(str(path))
    return e, path


def test_an_untampered_checkpoint_restores_exactly(saved) -> None:
    source, path = saved
    fresh = engine()
    fresh.load_checkpoint(str(path))
    want, got = source.full_state_dict(), fresh.full_state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert fresh.version == source.version and fresh.global_step == source.global_step
    # The optimizer's non-tensor entries (loaded with weights_only=True) came back too.
    assert fresh.optimizer.param_groups[0]["betas"] == source.optimizer.param_groups[0]["betas"]


def test_code_in_the_metadata_pickle_is_not_run(saved, tmp_path: Path) -> None:
    _, path = saved
    sentinel = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Touch(sentinel)))
    target = engine()
    before = target.full_state_dict()
    with pytest.raises(BaseException) as info:
        target.load_checkpoint(str(path))
    assert "os" in str(info.value) and "system" in str(info.value)
    assert not sentinel.exists()
    after = target.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_code_in_a_byte_entry_is_not_run(saved, tmp_path: Path) -> None:
    _, path = saved
    sentinel = tmp_path / "pwned"
    metadata = FileSystemReader(str(path)).read_metadata()
    # A non-tensor entry (an optimizer hyper-parameter) and where its bytes live.
    byte_key = next(
        k
        for k, v in metadata.state_dict_metadata.items()
        if type(v).__name__ == "BytesStorageMetadata"
    )
    info = next(v for idx, v in metadata.storage_data.items() if idx.fqn == byte_key)
    data_file = path / info.relative_path
    blob = bytearray(data_file.read_bytes())
    evil = pickle.dumps(_Touch(sentinel), protocol=2)
    # Same offset; torch.load reads a plain pickle stream as well as a zip archive.
    if len(evil) > info.length:
        pytest.fail(f"payload of {len(evil)} bytes does not fit the {info.length}-byte entry")
    blob[info.offset : info.offset + len(evil)] = evil
    data_file.write_bytes(bytes(blob))
    with pytest.raises(BaseException) as exc_info:
        engine().load_checkpoint(str(path))
    assert not sentinel.exists()
    text = str(exc_info.value)
    assert (
        isinstance(exc_info.value, UnsafeCheckpointError)
        or "weights_only" in text
        or ("Unsafe" in text or "UnpicklingError" in text)
    ), text
