"""The Ray launcher and the elastic rollout fleet, end to end.

A local two-node Ray cluster (``ray.cluster_utils.Cluster``, CPU only) hosts the mesh:
real rollout servers and FSDP2 trainer ranks (gloo) started by actors through the same entry
points as the local launcher, driven by ``python -m areal_grpc.coordinator`` as a user runs
it. The elastic tests resize the fleet mid-run through ``ScaleRolloutFleet`` with both
launchers and check what a user relies on: a new server never contributes samples older than
the run's version when it was admitted, and removing a server loses no prompt.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import ray
from arealgrpc.v1 import coordinator_pb2, coordinator_pb2_grpc
from ray.cluster_utils import Cluster

from areal_grpc.config import load_config
from areal_grpc.coordinator.launcher import new_mesh, start_mesh
from areal_grpc.coordinator.metrics import read_jsonl
from areal_grpc.coordinator.pool import WorkPool
from areal_grpc.coordinator.ray_launcher import bundle_layout
from areal_grpc.coordinator.service import CoordinatorServicer
from areal_grpc.errors import FieldError, field_violations
from areal_grpc.server import ServerOptions, start_server, sync_channel

pytestmark = pytest.mark.slow

# Each simulated node has 3 logical CPUs; a bundle of two 1-CPU servers then fits on a node
# but two bundles do not, so PACK must use both nodes, and 1 CPU per node stays free for
# servers added mid-run.
NODE_CPUS = 3


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Cluster]:
    """A head and one worker node; this test process is a driver (to inspect Ray state)."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": NODE_CPUS})
    cluster.add_node(num_cpus=NODE_CPUS)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def run_overrides(tmp_path: Path, steps: int, rollout_servers: int) -> list[str]:
    return [
        "data.task=echo",
        f"total_steps={steps}",
        "staleness.batch_size=2",
        "staleness.group_size=2",
        "staleness.max_staleness=1",
        f"rollout.num_servers={rollout_servers}",
        "trainer.ranks=2",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        "checkpoint.export_hf=false",
        "output.plot=false",
        f"weight_sync.disk_root={tmp_path / 'weights'}",
    ]


def ray_overrides(cluster: Cluster) -> list[str]:
    # Ray's nodes bind this machine's address, not loopback: plaintext must be chosen.
    return [
        "launcher.mode=ray",
        f"launcher.ray.address={cluster.address}",
        "launcher.ray.nodes=2",
        "security.allow_plaintext=true",
    ]


def wait_for(predicate: Callable[[], bool], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.2)


def trained_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    return path.read_text().count('"kind": "train"') if path.is_file() else 0


def pid_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def alive_server_actors() -> list[dict[str, Any]]:
    """Alive actors of our launcher, from the GCS actor table.

    ``ray.util.state`` needs the dashboard (``ray[default]``); the GCS table is what it reads.
    """
    return [
        a
        for a in ray._private.state.actors().values()
        if a["State"] == "ALIVE" and a["ActorClassName"] == "ServerActor"
    ]


def test_ray_launcher_places_servers_on_both_nodes_trains_and_leaves_nothing(
    ray_cluster, tmp_path, coordinator_command
):
    steps = 5
    out = tmp_path / "run"
    proc = coordinator_command.start(
        out, *run_overrides(tmp_path, steps, 2), *ray_overrides(ray_cluster)
    )
    coordinator_command.address(proc)
    try:
        # The coordinator serves: mesh.json is written (the mesh is healthy) and teardown is
        # seconds away at least.
        mesh = json.loads((out / "mesh.json").read_text())
        # What Ray says about placement while the mesh runs.
        actors = alive_server_actors()
        table = ray.util.placement_group_table()[mesh["placement_group"]]
    finally:
        log = coordinator_command.finish(proc)
    assert proc.returncode == 0, log
    assert f"done: {steps} steps, version {steps}" in log, log
    assert trained_steps(out) == steps

    node_ids = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(node_ids) == 2
    assert table["strategy"] == "PACK"
    assert set(table["bundles_to_node_id"].values()) == node_ids
    assert len(actors) == 4
    assert {a["Address"]["NodeID"] for a in actors} == node_ids
    # Trainer ranks fill the first bundle, rollout servers the second (AReaL's split).
    by_name = {s["name"]: s for s in mesh["servers"]}
    assert by_name["trainer-0"]["node_id"] == by_name["trainer-1"]["node_id"]
    assert by_name["rollout-0"]["node_id"] == by_name["rollout-1"]["node_id"]
    assert by_name["trainer-0"]["node_id"] != by_name["rollout-0"]["node_id"]

    # Teardown: no actor of the run alive, the placement group removed, no process left.
    assert alive_server_actors() == []
    assert ray.util.placement_group_table()[mesh["placement_group"]]["state"] == "REMOVED"
    wait_for(lambda: not any(pid_running(p) for p in mesh_pids(out)), timeout=30)


def server_pid(out: Path, address: str) -> int:
    """Pid of the server at ``address``, from mesh.json (local: children; ray: servers)."""
    mesh = json.loads((out / "mesh.json").read_text())
    return next(
        s["pid"] for s in mesh.get("servers", mesh.get("children")) if s["address"] == address
    )


def mesh_pids(out: Path) -> list[int]:
    """Every server (and, on Ray, actor) process mesh.json lists."""
    mesh = json.loads((out / "mesh.json").read_text())
    servers = mesh.get("servers", mesh.get("children", []))
    return [s["pid"] for s in servers] + [s["actor_pid"] for s in servers if "actor_pid" in s]


def rollout_health(address: str) -> dict[str, bool]:
    """Rollout server address -> healthy, as the coordinator reports it."""
    with sync_channel(address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        status = stub.GetCoordinatorStatus(
            coordinator_pb2.GetCoordinatorStatusRequest(), timeout=30
        )
    return {
        w.address: w.healthy
        for w in status.workers
        if w.role == coordinator_pb2.WORKER_ROLE_ROLLOUT
    }


def scale(address: str, servers: int) -> coordinator_pb2.ScaleRolloutFleetResponse:
    with sync_channel(address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        return stub.ScaleRolloutFleet(
            coordinator_pb2.ScaleRolloutFleetRequest(servers=servers), timeout=300
        )


@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_a_server_added_mid_run_serves_the_current_version_and_removal_loses_nothing(
    launcher, request, tmp_path, coordinator_command
):
    # Steps take a fraction of a second here and a server seconds to start, so the run is
    # open-ended and stopped with Ctrl-C (SIGINT) once the fleet has grown and shrunk.
    eta, batch = 1, 2
    overrides = run_overrides(tmp_path, 100_000, 1)
    if launcher == "ray":
        overrides += ray_overrides(request.getfixturevalue("ray_cluster"))
    out = tmp_path / "run"
    proc = coordinator_command.start(out, *overrides)
    address = coordinator_command.address(proc)
    try:
        wait_for(lambda: trained_steps(out) >= 2)
        with pytest.raises(grpc.RpcError) as err:
            scale(address, 0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in field_violations(err.value)] == ["servers"]

        grown = scale(address, 2)
        assert grown.servers == 2 and len(grown.added) == 1 and not grown.removed
        newcomer = grown.added[0]
        admitted_at = newcomer.policy_version
        assert admitted_at >= 2
        pid = server_pid(out, newcomer.address)

        def newcomer_trained() -> bool:
            return any(
                g["producer"] == newcomer.address
                for b in read_jsonl(out / "batches.jsonl")
                for g in b["groups"]
            )

        # It takes work (after being brought to the run's version) while the run goes on.
        wait_for(newcomer_trained)
        shrunk = scale(address, 1)
        # The server started last goes first; it is stopped, not just taken out of rotation.
        assert [w.address for w in shrunk.removed] == [newcomer.address]
        assert shrunk.servers == 1 and shrunk.requeued_tasks >= 0
        wait_for(lambda: not pid_running(pid), timeout=30)
        # A few more steps, so work re-queued from the removed server gets trained.
        removed_at = trained_steps(out)
        wait_for(lambda: trained_steps(out) >= removed_at + eta + 3)
        if launcher == "ray":
            # An actor that dies (here: its process killed) takes its server with it; the
            # coordinator reports a failed server, and stopping the run does not hang on it.
            first = next(
                s
                for s in json.loads((out / "mesh.json").read_text())["servers"]
                if s["name"] == "rollout-0"
            )
            os.kill(first["actor_pid"], signal.SIGKILL)
            wait_for(lambda: not pid_running(first["pid"]), timeout=30)
            wait_for(lambda: rollout_health(address).get(first["address"]) is False)
        proc.send_signal(signal.SIGINT)
    finally:
        if proc.poll() is None and proc.returncode is None:
            proc.send_signal(signal.SIGINT)
        log = coordinator_command.finish(proc)
    assert proc.returncode == 130, log
    assert "mesh stopped" in log, log
    if launcher == "ray":
        assert "'rollout-0': -9" in log, log

    batches = read_jsonl(out / "batches.jsonl")
    groups = [g for b in batches for g in b["groups"]]
    theirs = [g for g in groups if g["producer"] == newcomer.address]
    assert theirs
    # Brought to the fleet's version before its first episode: nothing older than that.
    assert all(g["min_version"] >= admitted_at for g in theirs), theirs
    # Nothing trained twice, nothing lost: every prompt up to the last few handed out was
    # trained (what was running on the removed server went back to the queue).
    steps = len(batches)
    seqs = [g["seq"] for g in groups]
    assert len(seqs) == len(set(seqs)) == steps * batch
    assert set(range(steps * batch - (eta + 1) * batch)) <= set(seqs)
    for b in batches:
        assert all(g["min_version"] >= b["version"] - eta for g in b["groups"]), b
    if launcher == "ray":
        assert alive_server_actors() == []
    wait_for(lambda: not any(pid_running(p) for p in mesh_pids(out)), timeout=30)


def test_scaling_without_a_launcher_is_a_failed_precondition():
    """A coordinator that cannot start servers (attach mode, standalone) says so."""

    async def scenario() -> None:
        servicer = CoordinatorServicer(WorkPool(2, 1, 8))
        server = await start_server(
            [servicer.as_service()],
            ServerOptions(host="127.0.0.1", port=0),
        )
        try:
            async with grpc.aio.insecure_channel(server.address) as ch:
                stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ScaleRolloutFleet(
                        coordinator_pb2.ScaleRolloutFleetRequest(servers=2), timeout=10
                    )
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "RegisterWorker" in (err.value.details() or "")
                # Still serving after the refusal.
                await stub.GetCoordinatorStatus(
                    coordinator_pb2.GetCoordinatorStatusRequest(), timeout=10
                )
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_a_layout_the_cluster_cannot_hold_fails_with_the_reason_and_leaves_nothing(
    ray_cluster, tmp_path
):
    # 2 x 4 CPUs per bundle: no simulated node has 4.
    cfg = load_config(
        None,
        [
            *ray_overrides(ray_cluster),
            "launcher.trainer_cpus=4",
            "launcher.ray.start_timeout_s=3",
            f"output.dir={tmp_path}",
        ],
    )
    before = set(ray.util.placement_group_table())
    with pytest.raises(FieldError, match=r"launcher\.ray\.nodes: .*could not be placed within 3s"):
        start_mesh(cfg, tmp_path / "logs", new_mesh(cfg, tmp_path / "logs"))
    created = {k: v for k, v in ray.util.placement_group_table().items() if k not in before}
    assert created and all(v["state"] == "REMOVED" for v in created.values())
    assert alive_server_actors() == []


def test_plaintext_off_loopback_is_refused_unless_chosen_and_leaves_nothing(ray_cluster, tmp_path):
    # Ray's nodes bind this machine's (non-loopback) address: without TLS, plaintext there
    # is the operator's explicit choice, as for any server started by hand.
    overrides = [o for o in ray_overrides(ray_cluster) if not o.startswith("security.")]
    cfg = load_config(None, [*overrides, f"output.dir={tmp_path}"])
    before = set(ray.util.placement_group_table())
    with pytest.raises(FieldError, match=r"security\.allow_plaintext"):
        start_mesh(cfg, tmp_path / "logs", new_mesh(cfg, tmp_path / "logs"))
    created = {k: v for k, v in ray.util.placement_group_table().items() if k not in before}
    assert all(v["state"] == "REMOVED" for v in created.values())
    assert alive_server_actors() == []


def test_bundles_hold_trainers_then_rollout_servers_in_contiguous_blocks():
    cfg = load_config(None, ["trainer.ranks=2", "rollout.num_servers=3", "launcher.ray.nodes=2"])
    assert bundle_layout(cfg) == [
        ["trainer-0", "trainer-1", "rollout-0"],
        ["rollout-1", "rollout-2"],
    ]
    with pytest.raises(FieldError, match=r"launcher\.ray\.nodes"):
        load_config(None, ["launcher.mode=ray", "launcher.ray.nodes=9"])
    with pytest.raises(FieldError, match=r"launcher\.ray\.strategy"):
        load_config(None, ["launcher.ray.strategy=ANYWHERE"])


def test_a_killed_trainer_rank_on_ray_is_replaced_by_new_actors_and_the_run_finishes(
    ray_cluster, tmp_path, coordinator_command
):
    steps = 8
    out = tmp_path / "run"
    overrides = [
        o for o in run_overrides(tmp_path, steps, 1) if not o.startswith("checkpoint.every")
    ]
    overrides += ["checkpoint.every_steps=2", "fault_tolerance.trainer.health_interval_s=1"]
    proc = coordinator_command.start(out, *overrides, *ray_overrides(ray_cluster))
    coordinator_command.address(proc)
    try:
        wait_for(lambda: trained_steps(out) >= 3)  # past the checkpoint of step 2
        before = {s["name"]: s for s in json.loads((out / "mesh.json").read_text())["servers"]}
        # Killed while the coordinator stands still, so steps are left for a new group to
        # train, however loaded the machine is.
        with coordinator_command.paused(proc.pid, out) as trained:
            assert trained < steps, trained
            os.kill(before["trainer-1"]["pid"], signal.SIGKILL)
    finally:
        log = coordinator_command.finish(proc)
    assert proc.returncode == 0, log
    assert "trainer group restarted" in log and f"done: {steps} steps" in log, log
    after = {s["name"]: s for s in json.loads((out / "mesh.json").read_text())["servers"]}
    # Both ranks are new processes in new actors (the survivor's group was broken too).
    for rank in ("trainer-0", "trainer-1"):
        assert after[rank]["pid"] != before[rank]["pid"]
        assert after[rank]["actor_pid"] != before[rank]["actor_pid"]
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["kind"] for r in records].count("recovery") == 1
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, steps + 1))
    assert alive_server_actors() == []
    wait_for(lambda: not any(pid_running(p) for p in mesh_pids(out)), timeout=30)


def test_a_killed_rollout_server_on_ray_is_replaced_by_a_new_actor_and_the_run_finishes(
    ray_cluster, tmp_path, coordinator_command
):
    steps = 12
    out = tmp_path / "run"
    proc = coordinator_command.start(
        out, *run_overrides(tmp_path, steps, 1), *ray_overrides(ray_cluster)
    )
    coordinator_command.address(proc)
    try:
        wait_for(lambda: trained_steps(out) >= 3)
        before = {s["name"]: s for s in json.loads((out / "mesh.json").read_text())["servers"]}
        # Killed while the coordinator stands still, with steps left that only a rollout
        # server can feed: the replacement cannot be skipped by a run that ends first.
        with coordinator_command.paused(proc.pid, out) as trained:
            # (run_overrides: staleness.max_staleness=1)
            assert coordinator_command.needs_rollouts_after(trained, steps, 1), trained
            os.kill(before["rollout-0"]["pid"], signal.SIGKILL)
    finally:
        log = coordinator_command.finish(proc)
    assert proc.returncode == 0, log
    assert "rollout server restarted" in log and f"done: {steps} steps" in log, log
    after = {s["name"]: s for s in json.loads((out / "mesh.json").read_text())["servers"]}
    # The dead server's actor is gone from the mesh; a new actor runs its replacement.
    assert "rollout-0" not in after and after["rollout-1"]["pid"] != before["rollout-0"]["pid"]
    records = read_jsonl(out / "metrics.jsonl")
    [restart] = [r for r in records if r["kind"] == "rollout_restart"]
    assert restart["old_address"] == before["rollout-0"]["address"]
    assert restart["new_address"] == after["rollout-1"]["address"]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, steps + 1))
    assert alive_server_actors() == []
    wait_for(lambda: not any(pid_running(p) for p in mesh_pids(out)), timeout=30)
