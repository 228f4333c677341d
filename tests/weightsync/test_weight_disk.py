"""Versioned weight directories: atomic publication, retention, confined reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from areal_grpc.errors import FieldError
from areal_grpc.weight_disk import (
    VersionWriter,
    list_versions,
    load_version,
    prune_versions,
    write_version,
)
from areal_grpc.weight_transfer import plan_buckets


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(8, 4, generator=g),
        "b": torch.randn(3, generator=g).to(torch.bfloat16),
        "c": torch.arange(5, dtype=torch.int64),
    }


def test_versions_are_written_in_shards_and_read_back_exactly(tmp_path: Path) -> None:
    sd = state(0)
    path = write_version(tmp_path, 7, [{"a": sd["a"]}, {"b": sd["b"], "c": sd["c"]}], 2, {"x": 1})
    assert path == tmp_path / "v00000007"
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    back = load_version(tmp_path, "v00000007")
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) and back[k].dtype == sd[k].dtype for k in sd)


def test_a_failed_write_publishes_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), VersionWriter(tmp_path, 3, shard_count=2) as w:
        w.add_shard({"a": torch.zeros(2)})
        raise RuntimeError("trainer died mid-write")
    assert list(tmp_path.iterdir()) == []
    # Fewer shards than announced is not a complete version either.
    with pytest.raises(ValueError), VersionWriter(tmp_path, 3, shard_count=2) as w:
        w.add_shard({"a": torch.zeros(2)})
    assert list(tmp_path.iterdir()) == []


def test_retention_keeps_the_newest_k_versions(tmp_path: Path) -> None:
    for v in (1, 2, 3, 4):
        write_version(tmp_path, v, [state(v)], 1)
    deleted = prune_versions(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == ["v00000001", "v00000002"]
    assert [v for v, _ in list_versions(tmp_path)] == [3, 4]
    assert torch.equal(load_version(tmp_path, "v00000004")["a"], state(4)["a"])


def test_confined_reads_refuse_paths_out_of_the_root(tmp_path: Path) -> None:
    root, other = tmp_path / "root", tmp_path / "other"
    write_version(other, 1, [state(1)], 1)
    root.mkdir()
    (root / "up").symlink_to(other)
    for path in ("../other/v00000001", str(other / "v00000001"), "up/v00000001", "/"):
        with pytest.raises(FieldError) as err:
            load_version(root, path, field="path")
        assert err.value.field == "path"


def test_buckets_close_before_overflow_and_keep_order() -> None:
    assert plan_buckets([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]
    assert plan_buckets([4, 4, 4], 0) == [[0, 1, 2]]
    assert plan_buckets([], 8) == []


def _corrupt_header(path: Path, edit) -> None:
    """Rewrites a safetensors file's JSON header through ``edit`` (data left as it is)."""
    import json

    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h["a"].update(data_offsets=[0, 10**9]),  # beyond the file
        lambda h: h["a"].update(shape=[9, 4]),  # shape and byte range disagree
        lambda h: h["b"].update(data_offsets=h["a"]["data_offsets"]),  # overlap
        lambda h: h["a"].update(dtype="F8_E4M3_UNKNOWN"),
        lambda h: h["c"].update(shape=[-5]),
    ],
)
def test_a_lying_safetensors_header_is_refused_naming_the_field(tmp_path: Path, edit) -> None:
    path = write_version(tmp_path, 1, [state(0)], 1)
    _corrupt_header(next(path.glob("*.safetensors")), edit)
    with pytest.raises(FieldError) as err:
        load_version(tmp_path, "v00000001", field="path")
    assert err.value.field == "path"


def test_versions_are_read_into_given_buffers_of_matching_shape(tmp_path: Path) -> None:
    sd = state(1)
    write_version(tmp_path, 1, [sd], 1)
    buffers = {
        "a": torch.empty(8, 4),  # fits: read into it
        "b": torch.empty(4, dtype=torch.bfloat16),  # wrong shape: fresh memory instead
    }
    a_ptr, b_ptr = buffers["a"].data_ptr(), buffers["b"].data_ptr()
    back = load_version(tmp_path, "v00000001", buffers=buffers)
    assert back["a"].data_ptr() == a_ptr and back["b"].data_ptr() != b_ptr
    assert all(torch.equal(back[k], sd[k]) and back[k].dtype == sd[k].dtype for k in sd)
    assert "a" not in buffers  # taken
