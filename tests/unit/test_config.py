"""Run configuration: defaults, YAML + overrides precedence, errors that name the bad key."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from areal_grpc.config import (
    ALGORITHMS,
    ALGORITHMS_DIR,
    RunConfig,
    load_config,
    preflight,
    to_yaml,
    validate_config,
)
from areal_grpc.errors import FieldError
from tests.support.paths import ROOT


def _write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_are_the_builtin_run():
    cfg = load_config(None, [])
    assert cfg == RunConfig()
    assert cfg.model.source.startswith("builtin:")
    assert cfg.data.task == "first3"
    assert cfg.rollout.num_servers == 1
    assert cfg.rollout.engine == "hf"
    assert cfg.trainer.ranks == 2
    assert cfg.launcher.mode == "local"
    # GRPO settings of the measured tiny-model runs.
    assert (cfg.staleness.batch_size, cfg.staleness.group_size) == (32, 8)
    assert cfg.trainer.optimizer.lr == 1e-3
    assert cfg.trainer.optimizer.grad_clip == 1.0
    assert cfg.trainer.optimizer.weight_decay == 0.0
    assert cfg.trainer.ppo.eps_clip == 0.2
    assert (cfg.trainer.ppo.n_minibatches, cfg.trainer.ppo.epochs) == (1, 1)
    assert cfg.trainer.ppo.kl_ctl == 0.0
    norm = cfg.trainer.ppo.reward_norm
    assert (norm.mean_level, norm.std_level, norm.mean_leave1out) == ("group", "group", False)
    assert (cfg.trainer.ppo.adv_norm.mean_level, cfg.trainer.ppo.adv_norm.std_level) == (
        "none",
        "none",
    )
    assert cfg.rollout.sampling.temperature == 1.0
    assert cfg.eval.every_steps == 25
    # Empty: the trainer's order for its device (tests/e2e/weightsync/test_fleet_methods.py).
    assert cfg.weight_sync.methods == []


def test_yaml_then_overrides_in_order(tmp_path):
    path = _write(
        tmp_path,
        "trainer:\n  optimizer:\n    lr: 5.0e-4\n  ranks: 4\nstaleness:\n  max_staleness: 0\n"
        "weight_sync:\n  methods: [disk]\n",
    )
    cfg = load_config(
        path, ["trainer.optimizer.lr=2e-4", "trainer.ppo.eps_clip=0.1", "trainer.optimizer.lr=3e-4"]
    )
    assert cfg.trainer.optimizer.lr == 3e-4  # the last override wins over the file
    assert cfg.trainer.ranks == 4  # from the file
    assert cfg.staleness.max_staleness == 0
    assert cfg.weight_sync.methods == ["disk"]  # lists are replaced, not appended
    assert cfg.trainer.ppo.eps_clip == 0.1
    assert cfg.trainer.ppo.rejection.upper == 5.0  # untouched siblings keep defaults
    assert cfg.rollout == RunConfig().rollout


def test_overrides_parse_yaml_values():
    cfg = load_config(
        None,
        [
            "trainer.ppo.rejection.lower=null",
            "weight_sync.methods=[stream,disk]",
            "output.tensorboard=false",
            "trainer.optimizer.lr=1",
            "name=7",
        ],
    )
    assert cfg.trainer.ppo.rejection.lower is None
    assert cfg.weight_sync.methods == ["stream", "disk"]
    assert cfg.output.tensorboard is False
    assert cfg.trainer.optimizer.lr == 1.0 and isinstance(cfg.trainer.optimizer.lr, float)
    assert cfg.name == "7"


def test_yaml_round_trip(tmp_path):
    cfg = load_config(
        None,
        [
            "launcher.mode=attach",
            "launcher.attach.rollout_addresses=[10.0.0.1:5000]",
            "launcher.attach.trainer_addresses=[10.0.0.2:6000,10.0.0.3:6000]",
            "rollout.sampling.max_new_tokens=64",
        ],
    )
    assert load_config(_write(tmp_path, to_yaml(cfg)), []) == cfg


def test_empty_yaml_file_means_defaults(tmp_path):
    assert load_config(_write(tmp_path, ""), []) == RunConfig()


@pytest.mark.parametrize(
    ("override", "field", "words"),
    [
        ("trainer.optimizer.lr=abc", "trainer.optimizer.lr", "Float"),
        ("trainer.foo=1", "trainer.foo", "unknown key"),
        ("tranier.lr=1e-3", "tranier", "unknown key"),
        ("trainer.ranks=2.5", "trainer.ranks", "Integer"),
        ("trainer.ranks=true", "trainer.ranks", "Integer"),
        ("output.plot=maybe", "output.plot", "bool"),
        ("trainer=3", "trainer", ""),
        ("trainer.optimizer.lr", "trainer.optimizer.lr", "key=value"),
        ("=3", "=3", "key=value"),
        ("trainer..lr=1", "trainer..lr", "empty component"),
        ("trainer.optimizer.lr=", "trainer.optimizer.lr", ""),
        ("name=${nope}", "name", "nope"),
    ],
)
def test_bad_override_names_the_key(override, field, words):
    with pytest.raises(FieldError) as err:
        load_config(None, [override])
    assert err.value.field == field
    assert words in str(err.value)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("trainer.optimizer.lr=0", "trainer.optimizer.lr"),
        ("trainer.ranks=0", "trainer.ranks"),
        ("trainer.backend=mpi", "trainer.backend"),
        ("trainer.ppo.eps_clip=-0.1", "trainer.ppo.eps_clip"),
        ("trainer.ppo.rejection.upper=0.5", "trainer.ppo.rejection.upper"),
        ("trainer.ppo.rejection.lower=1.5", "trainer.ppo.rejection.lower"),
        ("trainer.ppo.rejection.metric=kl", "trainer.ppo.rejection.metric"),
        ("trainer.ppo.rejection.level=batch", "trainer.ppo.rejection.level"),
        ("trainer.ppo.rejection.agg=median", "trainer.ppo.rejection.agg"),
        ("trainer.ppo.kl_loss_coef=-1", "trainer.ppo.kl_loss_coef"),
        ("trainer.ppo.kl_loss_estimator=k4", "trainer.ppo.kl_loss_estimator"),
        ("trainer.ppo.adv_norm.mean_level=token", "trainer.ppo.adv_norm.mean_level"),
        ("trainer.ppo.adv_norm.mean_leave1out=true", "trainer.ppo.adv_norm.mean_leave1out"),
        ("trainer.ppo.reward_norm=group", "trainer.ppo.reward_norm"),
        ("rollout.engine=trtllm", "rollout.engine"),
        ("rollout.vllm.kv_cache_gib=0", "rollout.vllm.kv_cache_gib"),
        ("rollout.dtype=int8", "rollout.dtype"),
        ("rollout.vllm.dtype=bfloat16", "rollout.vllm.dtype"),
        ("rollout.vllm.max_num_seqs=0", "rollout.vllm.max_num_seqs"),
        ("rollout.vllm.idle_spin_s=-1", "rollout.vllm.idle_spin_s"),
        ("rollout.sampling.top_p=0", "rollout.sampling.top_p"),
        ("rollout.max_concurrent_rollouts=0", "rollout.max_concurrent_rollouts"),
        ("fault_tolerance.rollout.max_restarts=-1", "fault_tolerance.rollout.max_restarts"),
        (
            "fault_tolerance.rollout.no_server_timeout_s=0",
            "fault_tolerance.rollout.no_server_timeout_s",
        ),
        ("staleness.max_staleness=-1", "staleness.max_staleness"),
        ("staleness.batch_size=0", "staleness.batch_size"),
        ("weight_sync.methods=[nfs]", "weight_sync.methods[0]"),
        ("weight_sync.methods=[stream,stream]", "weight_sync.methods"),
        ("weight_sync.methods=[stream,nfs]", "weight_sync.methods[1]"),
        ("fault_tolerance.rollout.replace_after_s=0", "fault_tolerance.rollout.replace_after_s"),
        ("weight_sync.timeout_s=0", "weight_sync.timeout_s"),
        ("eval.every_steps=-1", "eval.every_steps"),
        ("launcher.mode=remote", "launcher.mode"),
        ("launcher.attach.rollout_addresses=[localhost]", "launcher.attach.rollout_addresses[0]"),
        ("output.log_level=LOUD", "output.log_level"),
        ("launcher.coordinator_port=70000", "launcher.coordinator_port"),
        ("total_steps=0", "total_steps"),
    ],
)
def test_out_of_range_values_name_the_key(override, field):
    with pytest.raises(FieldError) as err:
        load_config(None, [override])
    assert err.value.field == field


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("rollout.sampling.top_p=0.9", "rollout.sampling.top_p"),
        ("rollout.sampling.top_k=20", "rollout.sampling.top_k"),
    ],
)
def test_vllm_refuses_truncated_sampling_whose_logprobs_it_cannot_report(override, field):
    # vLLM's log-probs come after top-p/top-k truncation; ours are taken before it.
    load_config(None, [override])
    with pytest.raises(FieldError) as err:
        load_config(None, ["rollout.engine=vllm", override])
    assert err.value.field == field
    assert "vllm" in str(err.value)


def test_attach_mode_needs_an_address_per_server_and_rank():
    with pytest.raises(FieldError) as err:
        load_config(None, ["launcher.mode=attach", "launcher.attach.rollout_addresses=[h:1]"])
    assert err.value.field == "launcher.attach.trainer_addresses"
    assert "trainer.ranks = 2" in str(err.value)
    cfg = load_config(
        None,
        [
            "launcher.mode=attach",
            "launcher.attach.rollout_addresses=[h:1]",
            "launcher.attach.trainer_addresses=[h:2,h:3]",
        ],
    )
    assert cfg.launcher.attach.trainer_addresses == ["h:2", "h:3"]


def test_sglang_engine_launches_its_servers_or_attaches_one_url_per_server():
    assert load_config(None, ["rollout.engine=sglang"]).rollout.sglang.urls == []
    with pytest.raises(FieldError) as err:
        load_config(
            None,
            [
                "rollout.engine=sglang",
                "rollout.num_servers=2",
                "rollout.sglang.urls=[http://h:30000]",
            ],
        )
    assert err.value.field == "rollout.sglang.urls"
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.urls=[http://h:30000]"])
    assert cfg.rollout.sglang.urls == ["http://h:30000"]
    with pytest.raises(FieldError, match=r"rollout\.sglang\.urls"):
        load_config(None, ["rollout.engine=sglang", "rollout.sglang_urls=[http://h:30000]"])


def test_bad_yaml_file_errors_name_the_key_or_file(tmp_path):
    with pytest.raises(FieldError) as err:
        load_config(_write(tmp_path, "trainer:\n  optimizer:\n    lr: fast\n"), [])
    assert err.value.field == "trainer.optimizer.lr"
    with pytest.raises(FieldError) as err:
        load_config(_write(tmp_path, "staleness:\n  eta: 2\n"), [])
    assert err.value.field == "staleness.eta"
    path = _write(tmp_path, "- just\n- a list\n")
    with pytest.raises(FieldError, match="mapping") as err:
        load_config(path, [])
    assert err.value.field == path
    with pytest.raises(FieldError, match="not valid YAML"):
        load_config(_write(tmp_path, "trainer: [unclosed\n"), [])


def test_validate_config_checks_a_config_built_in_code():
    cfg = RunConfig()
    cfg.trainer.optimizer.grad_clip = 0.0
    with pytest.raises(FieldError) as err:
        validate_config(cfg)
    assert err.value.field == "trainer.optimizer.grad_clip"


def test_tensorboard_is_off_by_default_and_on_only_where_it_can_write():
    assert load_config(None, []).output.tensorboard is False
    cfg = load_config(None, ["output.tensorboard=true"])
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(FieldError, match=r"output\.tensorboard: needs the tensorboard"):
            preflight(cfg)
    else:
        preflight(cfg)


def test_wandb_is_off_by_default_and_on_only_where_the_package_is():
    out = load_config(None, []).output
    assert (out.wandb, out.wandb_project, out.wandb_name, out.wandb_mode) == (
        False,
        None,
        None,
        "auto",
    )
    cfg = load_config(None, ["output.wandb=true", "output.wandb_mode=online"])
    assert cfg.output.wandb_mode == "online"
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(FieldError, match=r"output\.wandb: needs the wandb package"):
            preflight(cfg)
    else:
        preflight(cfg)
    with pytest.raises(FieldError, match=r"output\.wandb_mode: must be one of auto, offline"):
        load_config(None, ["output.wandb_mode=disabled"])


def test_validation_reads_no_files_and_preflight_names_the_missing_one(tmp_path):
    # A config is valid on a machine without its files (--print-config, a submit host);
    # the process that launches checks them.
    missing = tmp_path / "missing.jsonl"
    cfg = load_config(None, [f"data.path={missing}", "output.tensorboard=false"])
    with pytest.raises(FieldError) as err:
        preflight(cfg)
    assert err.value.field == "data.path" and "missing.jsonl" in str(err.value)
    # A trainer's sections do not include the coordinator's data.
    preflight(cfg, ["model", "trainer"])
    missing.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    preflight(cfg)


def test_an_algorithm_name_sets_its_keys_under_what_the_user_sets(tmp_path):
    rloo = load_config(None, ["algorithm=rloo"]).trainer.ppo.reward_norm
    assert (rloo.mean_level, rloo.std_level, rloo.mean_leave1out) == ("group", "none", True)
    # An explicit key wins over the algorithm's, wherever it is written.
    mine = load_config(None, ["algorithm=rloo", "trainer.ppo.reward_norm.std_level=batch"])
    assert mine.trainer.ppo.reward_norm.std_level == "batch"
    path = tmp_path / "run.yaml"
    path.write_text("algorithm: dapo\ntrainer:\n  ppo:\n    eps_clip: 0.1\n")
    dapo = load_config(str(path))
    assert dapo.algorithm == "dapo" and dapo.trainer.ppo.eps_clip_higher == 0.28
    assert dapo.trainer.ppo.eps_clip == 0.1
    assert dapo.rollout.workflow_params == {"accept": "nonuniform"}
    gspo = load_config(None, ["algorithm=gspo"]).trainer.ppo
    assert (gspo.importance_sampling_level, gspo.eps_clip) == ("sequence", 3e-4)
    assert load_config(None, ["algorithm=dr_grpo"]).trainer.ppo.loss_agg == "constant"
    # The resolved config (what --print-config prints) reads back to the same config.
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(to_yaml(dapo))
    assert "eps_clip_higher: 0.28" in resolved.read_text()
    assert load_config(str(resolved)) == dapo
    with pytest.raises(FieldError, match="algorithm"):
        load_config(None, ["algorithm=ppo_with_critic"])


def test_token_masks_and_critic_free_presets_expand_to_their_keys():
    icepop = load_config(None, ["algorithm=icepop"]).trainer.ppo.rejection
    assert (icepop.metric, icepop.lower, icepop.upper, icepop.action) == ("ratio", 0.5, 5.0, "mask")
    kpop = load_config(None, ["algorithm=kpop"]).trainer.ppo.rejection
    assert (kpop.metric, kpop.upper) == ("binary_kl", 2.0)
    for name in ("ppo_no_critic", "reinforce_pp"):
        p = load_config(None, [f"algorithm={name}"]).trainer.ppo
        assert (p.reward_norm.mean_level, p.reward_norm.std_level) == ("none", "none"), name
        assert (p.adv_norm.mean_level, p.adv_norm.std_level) == ("batch", "batch"), name
    assert load_config(None, ["algorithm=ppo_no_critic"]).trainer.ppo.kl_ctl == 0.0
    reinforce = load_config(None, ["algorithm=reinforce_pp"]).trainer.ppo
    assert (reinforce.kl_ctl, reinforce.kl_estimator) == (0.001, "k1")


def test_rejection_rules_that_cannot_work_are_refused_by_name():
    # Clamping bounds a ratio; a KL has nothing to clamp.
    with pytest.raises(FieldError) as err:
        load_config(
            None, ["trainer.ppo.rejection.metric=kl_k3", "trainer.ppo.rejection.action=clamp"]
        )
    assert err.value.field == "trainer.ppo.rejection.action"
    with pytest.raises(FieldError) as err:
        load_config(None, ["trainer.ppo.rejection.metric=kl_k1", "trainer.ppo.rejection.lower=6"])
    assert err.value.field == "trainer.ppo.rejection.lower"
    # "none" needs no bounds at all.
    off = load_config(None, ["trainer.ppo.rejection.metric=none", "trainer.ppo.rejection.upper=0"])
    assert off.trainer.ppo.rejection.metric == "none"


def test_a_key_earlier_versions_read_names_its_replacement():
    with pytest.raises(FieldError) as err:
        load_config(None, ["trainer.ppo.behav_imp_weight_cap=3"])
    assert err.value.field == "trainer.ppo.behav_imp_weight_cap"
    assert "use trainer.ppo.rejection.upper" in err.value.description


def test_lora_settings_are_checked_by_name():
    assert load_config(None, ["model.lora.rank=8"]).model.lora.target_modules == ["all-linear"]
    for overrides, field in [
        (["model.lora.rank=-1"], "model.lora.rank"),
        (["model.lora.rank=8", "model.lora.alpha=0"], "model.lora.alpha"),
        (["model.lora.rank=8", "model.lora.dropout=1"], "model.lora.dropout"),
        (["model.lora.rank=8", "model.lora.target_modules=[]"], "model.lora.target_modules"),
        # SGLang's distributed updates carry no adapters: with nothing else, refused.
        (
            [
                "model.lora.rank=8",
                "rollout.engine=sglang",
                "rollout.sglang.urls=[http://h:30000]",
                "weight_sync.methods=[distributed]",
            ],
            "weight_sync.methods",
        ),
    ]:
        with pytest.raises(FieldError) as err:
            load_config(None, overrides)
        assert err.value.field == field, overrides
    sglang = ["model.lora.rank=8", "rollout.engine=sglang", "rollout.sglang.urls=[http://h:3]"]
    assert load_config(None, sglang).model.lora.rank == 8


def test_an_external_only_run_needs_no_items_and_no_eval():
    cfg = load_config(None, ["data.task=external", "eval.every_steps=0", "gateway.enabled=true"])
    assert cfg.data.task == "external" and cfg.gateway.enabled
    for overrides, field in [
        (["data.task=external"], "eval.every_steps"),
        (["gateway.port=70000"], "gateway.port"),
        (["gateway.max_tokens=0"], "gateway.max_tokens"),
    ]:
        with pytest.raises(FieldError) as err:
            load_config(None, overrides)
        assert err.value.field == field, overrides


def test_a_task_without_a_reward_is_refused_at_load_unless_rollout_reward_is_set():
    # The default rollout.reward=task would fail every episode with "no reward function".
    items = ["data.task=last_letter", "data.path=items.jsonl"]
    with pytest.raises(FieldError) as err:
        load_config(None, items)
    assert err.value.field == "rollout.reward"
    for words in ["data.task", "'last_letter'", "first_char", "gsm8k"]:
        assert words in str(err.value), words
    assert load_config(None, [*items, "rollout.reward=first_char"]).rollout.reward == "first_char"
    gsm8k = load_config(None, ["data.task=gsm8k", "data.path=items.jsonl"])
    assert (gsm8k.data.task, gsm8k.rollout.reward) == ("gsm8k", "task")
    assert load_config(None, ["data.task=echo"]).data.task == "echo"
    # A task that is not built in has no items without a file.
    with pytest.raises(FieldError) as err:
        load_config(None, ["data.task=gsm8k"])
    assert err.value.field == "data.task" and "data.path" in str(err.value)


def test_a_gateway_chat_template_must_be_a_readable_jinja_file(tmp_path):
    good = tmp_path / "good.jinja"
    good.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert load_config(None, [f"gateway.chat_template={good}"]).gateway.chat_template == str(good)
    broken = tmp_path / "broken.jinja"
    broken.write_text("line one\n{% for m in messages %}{{ m.content }}")
    for path, says in [(tmp_path / "missing.jinja", "cannot be read"), (broken, "line 2")]:
        with pytest.raises(FieldError) as err:
            preflight(load_config(None, [f"gateway.chat_template={path}"]))
        assert err.value.field == "gateway.chat_template" and says in str(err.value)


def test_slurm_job_settings_are_checked_by_name():
    cfg = load_config(None, ["launcher.mode=slurm", "launcher.slurm.time=1-02:00:00"])
    assert cfg.launcher.mode == "slurm" and cfg.launcher.slurm.nodes == 1
    for overrides, field in [
        (["launcher.slurm.time=2 hours"], "launcher.slurm.time"),
        (["launcher.slurm.nodes=0"], "launcher.slurm.nodes"),
        (["launcher.mode=pbs"], "launcher.mode"),
    ]:
        with pytest.raises(FieldError) as err:
            load_config(None, overrides)
        assert err.value.field == field, overrides


def test_the_submit_helper_prints_the_job_script_for_a_config(tmp_path, capsys):
    from areal_grpc.coordinator.submit import main

    code = main(
        [
            "--dry-run",
            f"output.dir={tmp_path}",
            "launcher.slurm.nodes=2",
            "launcher.slurm.gres=gpu:8",
            "launcher.slurm.partition=gpu",
            "launcher.slurm.account=rl",
        ]
    )
    script = capsys.readouterr().out
    assert code == 0
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --gres=gpu:8",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=rl",
        f"#SBATCH --output={tmp_path.resolve()}/slurm-%j.out",
        "#SBATCH --time=01:00:00",
    ]:
        assert line in script.splitlines(), line
    assert script.splitlines()[-1].endswith(f"--config {tmp_path.resolve()}/submitted-config.yaml")
    assert not (tmp_path / "submit.sbatch").exists()  # a dry run writes nothing


def test_algorithm_presets_are_config_files_that_layer_with_the_users_own(tmp_path: Path):
    """configs/algorithms/<name>.yaml is what ``algorithm: <name>`` applies; the same files
    layer with the user's as repeated --config, the last winning."""
    files = sorted(p.stem for p in ALGORITHMS_DIR.glob("*.yaml"))
    assert files == sorted(ALGORITHMS)
    run = tmp_path / "run.yaml"
    run.write_text("trainer:\n  ppo:\n    eps_clip_higher: 0.3\n  optimizer:\n    lr: 2.0e-4\n")
    dapo = str(ALGORITHMS_DIR / "dapo.yaml")
    layered = load_config([dapo, str(run)])
    named = load_config(str(run), ["algorithm=dapo"])
    assert layered.trainer == named.trainer and layered.rollout == named.rollout
    assert layered.trainer.ppo.eps_clip_higher == 0.3  # the later file wins
    assert layered.rollout.workflow_params == {"accept": "nonuniform"}  # the preset's own
    assert load_config([str(run), dapo]).trainer.ppo.eps_clip_higher == 0.28
    with pytest.raises(FieldError) as err:
        load_config([str(tmp_path / "missing.yaml")])
    assert "missing.yaml" in err.value.field and "cannot read" in str(err.value)


def test_the_flat_ray_and_slurm_keys_of_earlier_versions_name_their_nested_keys():
    for old, new in (
        ("launcher.ray_nodes=2", "launcher.ray.nodes"),
        ("launcher.slurm_gres=gpu:8", "launcher.slurm.gres"),
    ):
        with pytest.raises(FieldError) as err:
            load_config(None, [old])
        assert f"no longer read: use {new}" in str(err.value)
    layered = load_config(None, ["launcher.ray.nodes=2", "launcher.slurm.time=02:00:00"])
    assert (layered.launcher.ray.nodes, layered.launcher.slurm.time) == (2, "02:00:00")


def test_the_optimizer_keys_of_earlier_versions_name_their_new_home():
    with pytest.raises(FieldError) as err:
        load_config(None, ["trainer.lr=1e-4"])
    assert err.value.field == "trainer.lr"
    assert "no longer read: use trainer.optimizer.lr" in str(err.value)
    assert load_config(None, ["trainer.optimizer.lr=1e-4"]).trainer.optimizer.lr == 1e-4


@pytest.mark.parametrize("name", ["smollm2_agent.yaml", "smollm2_arith.yaml"])
def test_the_example_configs_hold_only_keys_the_config_tree_has(name: str):
    """A renamed or moved setting fails here rather than in a user's first run (the data
    files the examples name are written by a command, so that section is not checked)."""
    from areal_grpc.config import SECTION_CHECKS

    path = ROOT / "examples" / name
    load_config(str(path), sections=[s for s in SECTION_CHECKS if s != "data"])


def test_supervision_keys_of_earlier_versions_name_their_fault_tolerance_home():
    for old, new in (
        ("rollout.episode_timeout_s=5", "fault_tolerance.rollout.episode_timeout_s"),
        ("trainer.call_timeout_s=5", "fault_tolerance.trainer.call_timeout_s"),
    ):
        with pytest.raises(FieldError) as err:
            load_config(None, [old])
        assert f"no longer read: use {new}" in str(err.value)
    # rollout.vllm's own health settings stay where they are.
    assert load_config(None, ["rollout.vllm.health_timeout_s=9"]).rollout.vllm.health_timeout_s == 9


def test_on_and_off_settings_take_the_bare_words_yaml_reads_as_booleans(tmp_path):
    # YAML 1.1 reads a bare on / off as true / false; the settings whose choices are those
    # words take them as written, on the command line and in a file.
    cfg = load_config(None, ["trainer.mixed_precision=off", "rollout.chat_template=on"])
    assert (cfg.trainer.mixed_precision, cfg.rollout.chat_template) == ("off", "on")
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  mixed_precision: on\nrollout:\n  chat_template: off\n")
    cfg = load_config(str(path))
    assert (cfg.trainer.mixed_precision, cfg.rollout.chat_template) == ("on", "off")
    # A boolean setting still reads them as booleans.
    assert load_config(None, ["trainer.fsdp=off"]).trainer.fsdp is False
