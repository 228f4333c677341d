"""Versioned weight directories: atomic publication, retention, confined reads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from areal_grpc.errors import FieldError, PreconditionError
from areal_grpc.paths import MARKER_NAME
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
        MARKER_NAME,
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


def test_shards_written_from_several_threads_at_once_make_one_exact_version(
    tmp_path: Path,
) -> None:
    # The trainer writes up to PublisherConfig.disk_writers shards at once.
    shards = [
        {f"t{i}.{j}": torch.full((64, 64), float(i * 10 + j)) for j in range(3)} for i in range(8)
    ]
    with VersionWriter(tmp_path, 5, len(shards)) as w, ThreadPoolExecutor(4) as pool:
        list(pool.map(w.add_shard, shards))
    back = load_version(tmp_path, "v00000005")
    expected = {k: v for shard in shards for k, v in shard.items()}
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], expected[k]) for k in expected)
    assert len(list((tmp_path / "v00000005").glob("*.safetensors"))) == len(shards)


def test_a_shard_failing_beside_others_publishes_nothing(tmp_path: Path) -> None:
    good = [{f"t{i}": torch.zeros(256, 256)} for i in range(4)]
    # Whichever of the two "t0" shards comes second fails.
    with (
        pytest.raises(ValueError, match="written twice"),
        VersionWriter(tmp_path, 2, 5) as w,
        ThreadPoolExecutor(2) as pool,
    ):
        list(pool.map(w.add_shard, [*good, {"t0": torch.ones(2)}]))
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


def test_loaded_tensors_map_the_file_privately_and_outlive_its_pruning(tmp_path: Path) -> None:
    sd = state(1)
    path = write_version(tmp_path, 1, [sd], 1)
    shard = next(path.glob("*.safetensors"))
    on_disk = shard.read_bytes()
    back = load_version(tmp_path, "v00000001")
    assert all(torch.equal(back[k], sd[k]) and back[k].dtype == sd[k].dtype for k in sd)
    # Served weights sit in the file's mapping (no copy was made) ...
    maps = Path("/proc/self/maps").read_text().splitlines()
    ptr = back["a"].data_ptr()
    mapped = [
        m for m in maps if int(m.split("-")[0], 16) <= ptr < int(m.split()[0].split("-")[1], 16)
    ]
    assert mapped and mapped[0].endswith(str(shard)), mapped
    # ... a private one: writing to a tensor never reaches the file ...
    back["a"].add_(1.0)
    assert shard.read_bytes() == on_disk
    # ... and pruning the version directory leaves the tensors intact.
    write_version(tmp_path, 2, [state(2)], 1)
    prune_versions(tmp_path, 1)
    assert not path.exists()
    assert torch.equal(back["b"], sd["b"]) and torch.equal(back["a"], sd["a"] + 1.0)


def halves(seed: int) -> list[dict[str, torch.Tensor]]:
    sd = state(seed)
    return [{"a": sd["a"]}, {"b": sd["b"], "c": sd["c"]}]


def test_a_writer_given_keep_deletes_what_pruning_would_as_it_writes(tmp_path: Path) -> None:
    for v in (1, 2, 3):
        write_version(tmp_path, v, halves(v), 2)

    def files(v: int) -> list[Path]:
        return list((tmp_path / f"v{v:08d}").glob("*.safetensors"))

    # keep=2: once version 4 is published, versions 1 and 2 go. While 4 is written, each
    # shard first deletes at least its own size of their files (the largest first) ...
    with VersionWriter(tmp_path, 4, 2, keep=2) as w:
        w.add_shard(halves(4)[0])
        assert len(files(1) + files(2)) == 3
        w.add_shard(halves(4)[1])
        assert len(files(1) + files(2)) == 2
        # ... and the newest published version stays whole.
        assert len(files(3)) == 2
    prune_versions(tmp_path, 2)
    assert [v for v, _ in list_versions(tmp_path)] == [3, 4]
    back = load_version(tmp_path, "v00000004")
    assert all(torch.equal(back[k], state(4)[k]) for k in back) and len(back) == 3


def test_a_failed_write_leaves_the_newest_version_loadable(tmp_path: Path) -> None:
    write_version(tmp_path, 1, halves(1), 2)
    with pytest.raises(RuntimeError), VersionWriter(tmp_path, 2, 2, keep=1) as w:
        w.add_shard(halves(2)[0])
        raise RuntimeError("the trainer died mid-write")
    assert [v for v, _ in list_versions(tmp_path)] == [1]
    assert torch.equal(load_version(tmp_path, "v00000001")["a"], state(1)["a"])


def test_directories_the_project_did_not_write_are_never_replaced_or_pruned(
    tmp_path: Path,
) -> None:
    """A version-named directory without the marker is refused and survives pruning."""
    sd = state(0)
    foreign = tmp_path / "v00000002"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("a user's file")
    with pytest.raises(PreconditionError, match="did not write"):
        write_version(tmp_path, 2, [sd], 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000002"]
    for v in (3, 4, 5):
        write_version(tmp_path, v, [sd], 1)
    prune_versions(tmp_path, keep=1)
    assert (foreign / "mine.txt").read_text() == "a user's file"
    assert [v for v, _ in list_versions(tmp_path)] == [5]
    # A directory that is ours is replaced whole when its version is written again.
    write_version(tmp_path, 5, [state(1)], 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000002", "v00000005"]
