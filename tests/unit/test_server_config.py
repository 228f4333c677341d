"""One config source: the servers read the coordinator's run config, defaults defined once."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import subprocess
from pathlib import Path

import pytest
from areal_servers.rollout.__main__ import add_rollout_args
from areal_servers.trainer.__main__ import add_trainer_args
from areal_servers.trainer.build import config_from_args

from areal_grpc.cli import base_parser
from areal_grpc.config import RunConfig, load_config
from areal_grpc.coordinator.mesh import rollout_argv, trainer_argv
from areal_grpc.errors import FieldError
from areal_grpc.launch import python_module_argv
from areal_grpc.server_config import (
    ROLLOUT_SECTIONS,
    TRAINER_SECTIONS,
    for_servers,
    run_config_from_args,
)


def trainer_args(argv: list[str]) -> argparse.Namespace:
    parser = base_parser("areal-trainer", "", 0)
    add_trainer_args(parser)
    return parser.parse_args(argv)


def rollout_args(argv: list[str]) -> argparse.Namespace:
    return add_rollout_args(base_parser("areal-rollout", "", 0)).parse_args(argv)


def test_a_standalone_trainer_takes_the_run_configs_defaults():
    cfg = config_from_args(trainer_args([]))
    run = RunConfig()
    # The rank takes the run's sections themselves, not copies of some of their fields (with
    # Dr.GRPO's length constant, 0 there, resolved to the response budget).
    assert cfg.model == run.model
    resolved = dataclasses.replace(cfg.trainer.ppo, loss_constant_len=0)
    assert dataclasses.replace(cfg.trainer, ppo=resolved) == run.trainer
    assert cfg.total_steps == run.total_steps


def test_ppo_minibatches_and_epochs_reach_the_trainer_engine():
    ppo = config_from_args(
        trainer_args(["trainer.ppo.n_minibatches=4", "trainer.ppo.epochs=2"])
    ).trainer.ppo
    assert (ppo.n_minibatches, ppo.epochs) == (4, 2)


def test_the_trainer_reads_the_coordinators_file_and_overrides(tmp_path: Path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "total_steps: 7\n"
        "trainer:\n  optimizer:\n    lr: 3.0e-4\n  ppo:\n    reward_norm:\n      std_level: none\n"
        "      mean_leave1out: true\n      eps: 1.0e-3\n"
        f"output:\n  dir: {tmp_path / 'out'}\n"
        "weight_sync:\n  methods: [stream]\n"
    )
    cfg = config_from_args(
        trainer_args(
            ["--config", str(config), "trainer.optimizer.lr=2e-5", "trainer.ppo.kl_estimator=k3"]
        )
    )
    assert cfg.trainer.optimizer.lr == 2e-5 and cfg.total_steps == 7
    assert cfg.trainer.ppo.kl_estimator == "k3"
    # RLOO: a leave-one-out group mean and no std, with the configured eps.
    norm = cfg.trainer.ppo.reward_norm
    assert norm.mean_leave1out and norm.std_level == "none"
    assert norm.eps == 1e-3
    # It may write under the run's output directory only; no disk method, no weights root.
    assert cfg.path_roots == (str((tmp_path / "out").resolve()),)
    assert cfg.weights.disk_root is None


@pytest.mark.parametrize("rank", [0, 1])
def test_what_the_coordinator_runs_with_is_what_each_trainer_rank_gets(tmp_path: Path, rank: int):
    run = load_config(
        None,
        [
            f"output.dir={tmp_path}/out",
            "trainer.optimizer.lr=4e-4",
            "trainer.ppo.adv_norm.std_level=none",
            "trainer.device=cpu",
            "weight_sync.bucket_mb=8",
        ],
    )
    argv = trainer_argv(run, rank, master_port=29999)
    assert argv[1:3] == ["-m", "areal_servers.trainer"]
    args = trainer_args(argv[3:])
    assert (args.rank, args.world_size, args.master_port) == (rank, run.trainer.ranks, 29999)
    assert run_config_from_args(args, TRAINER_SECTIONS) == for_servers(run)
    cfg = config_from_args(args)
    assert cfg.trainer.optimizer.lr == 4e-4 and cfg.weights.bucket_bytes == 8 << 20
    assert cfg.weights.disk_root == str((tmp_path / "out" / "weights").resolve())


def test_what_the_coordinator_runs_with_is_what_each_rollout_server_gets(tmp_path: Path):
    run = load_config(
        None,
        [
            f"output.dir={tmp_path}/out",
            "rollout.max_running_requests=7",
            "rollout.sampling.max_new_tokens=5",
            "model.seed=11",
        ],
    )
    argv = rollout_argv(run, 0)
    assert argv[1:3] == ["-m", "areal_servers.rollout"]
    got = run_config_from_args(rollout_args(argv[3:]), ROLLOUT_SECTIONS)
    assert got == for_servers(run)
    assert got.rollout.max_running_requests == 7 and got.model.seed == 11
    # Directories are absolute: a server may start in another working directory.
    assert Path(got.output.dir).is_absolute()


@pytest.mark.parametrize("module", ["areal_servers.trainer", "areal_servers.rollout"])
def test_a_bad_setting_stops_a_server_with_one_line_naming_the_key(module: str):
    out = subprocess.run(
        python_module_argv(module, "--port", "0", "model.seed=-1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == "config error: model.seed: must be >= 0, got -1"
    assert "LISTENING" not in out.stdout


def test_the_rollout_engine_takes_the_runs_sections_themselves():
    """The hf engine reads the run's model and rollout sections, not a copy of their fields."""
    from areal_servers.rollout.build import create_engine

    run = load_config(None, ["rollout.max_running_requests=3", "rollout.device=cpu"])
    engine = create_engine(run)
    assert engine.policy is run.model and engine.rollout is run.rollout
    assert str(engine.device) == "cpu"


def test_the_standalone_coordinator_reads_the_run_configs_staleness_rule():
    """areal-coordinator takes the training run's keys and defaults; its old flags are refused
    with the key that replaced them."""
    from areal_grpc.coordinator.serve import add_coordinator_args, build

    def pool_of(argv: list[str]):
        args = add_coordinator_args(base_parser("areal-coordinator", "", 0)).parse_args(argv)
        [svc] = asyncio.run(build(args))
        return svc.servicer.pool

    default, run = pool_of([]), RunConfig()
    assert default.staleness.consumer_batch_size == run.staleness.batch_size
    assert default.staleness.max_staleness == run.staleness.max_staleness
    assert default.lease_ttl_s == run.staleness.lease_ttl_s
    pool = pool_of(["staleness.batch_size=3", "staleness.max_staleness=0"])
    assert (pool.staleness.consumer_batch_size, pool.staleness.max_staleness) == (3, 0)
    with pytest.raises(FieldError) as err:
        pool_of(["--batch-size", "8"])
    assert err.value.field == "--batch-size" and "staleness.batch_size=8" in str(err.value)
