"""No trainer RPC touches a path outside its root, or replaces a directory it did not write.

One plain trainer server (builtin:micro) with a root; a "victim" directory with files beside
the root (outside it) and one inside it that the project did not write. After every refused
request both are byte-identical and the rank still trains.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from areal_servers.trainer.service import TrainerService, TrainerServiceConfig
from arealgrpc.v1 import trainer_pb2, trainer_pb2_grpc

from areal_grpc.config import OptimizerSettings, TrainerConfig
from areal_grpc.errors import field_violations
from areal_grpc.paths import DEFAULT_ROOT_NAME, MARKER_NAME
from areal_grpc.server import BackgroundServer, service

TIMEOUT = 60.0


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (relative name → bytes)."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


class Rank:
    def __init__(self, roots: tuple[str, ...]) -> None:
        cfg = TrainerServiceConfig(
            trainer=TrainerConfig(fsdp=False, device="cpu", optimizer=OptimizerSettings(lr=1e-3)),
            distributed=False,
            path_roots=roots,
        )
        self.svc = TrainerService(cfg)
        self.svc.wait_ready(TIMEOUT)
        self.server = BackgroundServer(
            [service(self.svc, trainer_pb2_grpc.add_TrainerServiceServicer_to_server, trainer_pb2)]
        )
        running = self.server.start()
        self.channel = grpc.insecure_channel(running.address)
        self.stub = trainer_pb2_grpc.TrainerServiceStub(self.channel)

    def call(self, rpc: str, path: str) -> object:
        if rpc == "save":
            return self.stub.SaveCheckpoint(
                trainer_pb2.SaveCheckpointRequest(path=path), timeout=TIMEOUT
            )
        if rpc == "load":
            return self.stub.LoadCheckpoint(
                trainer_pb2.LoadCheckpointRequest(path=path), timeout=TIMEOUT
            )
        return self.stub.ExportModel(trainer_pb2.ExportModelRequest(path=path), timeout=TIMEOUT)

    def close(self) -> None:
        self.channel.close()
        self.server.stop()
        self.svc.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Rank, Path, Path, Path]]:
    """(rank, root, victim outside the root, foreign directory inside the root)."""
    base = tmp_path_factory.mktemp("paths")
    root = base / "root"
    root.mkdir()
    victim = base / "victim"
    victim.mkdir()
    (victim / "data.txt").write_text("someone else's file\n")
    (victim / "sub").mkdir()
    (victim / "sub" / "x.bin").write_bytes(os.urandom(64))
    foreign = root / "users_dir"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not written by areal-grpc\n")
    (root / "link_out").symlink_to(victim, target_is_directory=True)
    (root / "a_file").write_text("a plain file\n")
    rank = Rank((str(root),))
    yield rank, root, victim, foreign
    rank.close()


def hostile(root: Path, victim: Path) -> dict[str, str]:
    return {
        "absolute outside": str(victim),
        "absolute outside, child": str(victim / "sub"),
        "dotdot escape": str(root / ".." / victim.name),
        "relative dotdot escape": f"../{victim.name}",
        "symlink out": str(root / "link_out"),
        "through symlink": "link_out/sub",
        "root itself": str(root),
        "root itself, relative": ".",
        "system file": "/etc/passwd",
    }


@pytest.mark.parametrize("rpc", ["save", "load", "export"])
def test_paths_outside_the_root_are_invalid_argument_and_touch_nothing(world, rpc) -> None:
    rank, root, victim, foreign = world
    before = snapshot(victim), snapshot(foreign)
    for case, path in hostile(root, victim).items():
        with pytest.raises(grpc.RpcError) as info:
            rank.call(rpc, path)
        err = info.value
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, err.details())
        assert [f for f, _ in field_violations(err)] == ["path"], case
        assert (snapshot(victim), snapshot(foreign)) == before, case
    assert not list(victim.parent.glob(".victim*")), "nothing written beside the victim"


@pytest.mark.parametrize("rpc", ["save", "export"])
def test_a_foreign_directory_or_file_inside_the_root_is_not_replaced(world, rpc) -> None:
    rank, root, _, foreign = world
    before = snapshot(foreign)
    for path in (str(foreign), "users_dir", "a_file"):
        with pytest.raises(grpc.RpcError) as info:
            rank.call(rpc, path)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
        assert "areal-grpc" in info.value.details()
    assert snapshot(foreign) == before
    assert (root / "a_file").read_text() == "a plain file\n"


def test_relative_paths_land_in_the_root_and_our_directories_are_replaced(world) -> None:
    rank, root, _, _ = world
    reply = rank.call("export", "exports/a")
    assert Path(reply.path) == root.resolve() / "exports" / "a"
    assert (root / "exports" / "a" / "config.json").is_file()
    assert (root / "exports" / "a" / MARKER_NAME).is_file()
    # Written by us: replaced whole, twice over, by an export and by a checkpoint.
    rank.call("export", "exports/a")
    saved = rank.call("save", "exports/a")
    assert Path(saved.path) == root.resolve() / "exports" / "a"
    assert (root / "exports" / "a" / "trainer_meta.json").is_file()
    assert not (root / "exports" / "a" / "config.json").exists()
    loaded = rank.call("load", "exports/a")
    assert loaded.policy_version == saved.policy_version
    # An empty directory is filled.
    (root / "empty").mkdir()
    rank.call("save", "empty")
    assert (root / "empty" / MARKER_NAME).is_file()
    # No temporary or aside directories are left behind.
    assert sorted(p.name for p in (root / "exports").iterdir()) == ["a"]


def test_a_path_that_leaves_and_reenters_the_root_is_resolved_not_an_error(world) -> None:
    """``<dir>/../<dir>`` once answered INTERNAL (FileExistsError)."""
    rank, root, _, _ = world
    (root / "d").mkdir(exist_ok=True)
    path = str(root / "d" / ".." / "d")
    first = rank.call("save", path)
    assert Path(first.path) == (root / "d").resolve()
    second = rank.call("save", path)
    assert second.path == first.path
    assert rank.call("load", path).policy_version == first.policy_version


def test_load_reads_nothing_outside_the_root(world, tmp_path) -> None:
    """A real checkpoint outside the root (or reached through a symlink) is not loaded."""
    rank, root, _, _ = world
    rank.call("save", "ck_for_copy")
    outside = tmp_path / "outside_ck"
    import shutil

    shutil.copytree(root / "ck_for_copy", outside)
    (root / "ck_link").symlink_to(outside, target_is_directory=True)
    for path in (str(outside), "ck_link"):
        with pytest.raises(grpc.RpcError) as info:
            rank.call("load", path)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, path


def test_a_server_without_a_root_writes_under_its_default_root(tmp_path, monkeypatch) -> None:
    """No configured root: ``./areal-files/trainer`` is created, and paths stay inside it."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "mine.txt").write_text("keep")
    monkeypatch.chdir(cwd)
    rank = Rank(())
    try:
        default = cwd / DEFAULT_ROOT_NAME / "trainer"
        assert default.is_dir()
        reply = rank.call("export", "a")
        assert Path(reply.path) == default.resolve() / "a"
        for path in (str(cwd), str(cwd / "mine.txt"), "../../mine.txt"):
            with pytest.raises(grpc.RpcError) as info:
                rank.call("save", path)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (cwd / "mine.txt").read_text() == "keep"
        assert sorted(p.name for p in cwd.iterdir()) == [DEFAULT_ROOT_NAME, "mine.txt"]
    finally:
        rank.close()
