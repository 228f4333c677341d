"""``python -m areal_grpc.tinker`` driven by the official ``tinker`` SDK (0.38.0), unchanged:
SFT, an RL loop, tenants kept apart, quotas, checkpoints that resume bit-exactly, and clear
refusals of what is not served."""

from __future__ import annotations

import os
import re
import signal
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from areal_grpc.launch import Child, stop_children
from tests.support.tinker import SEQ, greedy, sft_datum, sft_steps, start_tinker

MODEL = "builtin:tiny"
KEYS = {
    "alice": "tml-alice-0123456789abcdef",
    "bob": "tml-bob-0123456789abcdefgh",
    "carol": "tml-carol-0123456789abcdef",
    # Only the trainer group's test runs as dave: the quota test fills carol's runs.
    "dave": "tml-dave-0123456789abcdefgh",
}
MAX_RUNS = 4


@dataclass
class Service:
    child: Child
    url: str
    root: Path

    def client(self, tenant: str) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.url, api_key=KEYS[tenant])

    def rest(self, tenant: str) -> tinker.RestClient:
        return tinker.RestClient(base_url=self.url, api_key=KEYS[tenant])


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    os.environ["TINKER_TELEMETRY"] = "0"
    out = tmp_path_factory.mktemp("tinker")
    child = start_tinker(
        out,
        KEYS,
        MODEL,
        f"tinker.max_runs_per_tenant={MAX_RUNS}",
        "tinker.retry_after_s=3",
    )
    try:
        yield Service(child, f"http://{child.address}", out / "run" / "tinker")
    finally:
        stop_children([child])


def test_sft_loss_falls_and_the_saved_sampler_samples_the_trained_adapter(svc: Service):
    sc = svc.client("alice")
    caps = svc.rest("alice").get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [MODEL]
    tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=1).result()
    base = greedy(sc.create_sampling_client(base_model=MODEL).result(), SEQ[:3])
    losses = sft_steps(tc, 20)
    assert losses[-1] < 0.5 * losses[0]
    sampler = tc.save_weights_and_get_sampling_client().result()
    assert greedy(sampler, SEQ[:3]) == SEQ[3:8] != base
    info = tc.get_info()
    assert info.model_data.model_name == MODEL and info.lora_rank == 8


def test_compute_logprobs_and_a_custom_loss(svc: Service):
    sc = svc.client("bob")
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    sft_steps(tc, 3)
    # The learner's log-probs of a sequence (forward) are what its sampler scores.
    learner = tc.forward([sft_datum()], "cross_entropy").result()
    scored = (
        tc.save_weights_and_get_sampling_client()
        .result()
        .compute_logprobs(types.ModelInput.from_ints(SEQ))
    )
    values = scored.result()
    assert values[0] is None and len(values) == len(SEQ)
    assert values[1:] == pytest.approx(learner.loss_fn_outputs[0]["logprobs"].tolist(), abs=1e-4)

    # A loss the SDK computes client-side from the log-probs (two calls to the service).
    def loss_fn(data, logprobs):
        loss = -sum(lp.sum() for lp in logprobs)
        return loss, {"custom:sum": float(loss)}

    out = tc.forward_backward_custom([sft_datum()], loss_fn).result()
    assert out.metrics["custom:sum"] > 0
    tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    after = tc.forward([sft_datum()], "cross_entropy").result().metrics["loss:sum"]
    assert after < out.metrics["custom:sum"]


def test_an_rl_loop_raises_the_reward(svc: Service):
    """sample -> reward -> importance_sampling forward_backward -> optim_step, as the
    cookbook's RL loop does it; the reward is the share of sampled tokens below 64."""
    tc = svc.client("alice").create_lora_training_client(base_model=MODEL, rank=8, seed=1).result()
    prompt = [5, 6, 7]
    rewards = []
    for it in range(10):
        sampler = tc.save_weights_and_get_sampling_client().result()
        result = sampler.sample(
            prompt=types.ModelInput.from_ints(prompt),
            num_samples=16,
            sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=it, stop=[]),
        ).result()
        scores = [sum(t < 64 for t in s.tokens) / len(s.tokens) for s in result.sequences]
        mean = statistics.mean(scores)
        rewards.append(mean)
        data = []
        for seq, score in zip(result.sequences, scores, strict=True):
            full = prompt + list(seq.tokens)
            pad = [0.0] * (len(prompt) - 1)
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={
                        "target_tokens": full[1:],
                        "logprobs": pad + list(seq.logprobs),
                        "advantages": pad + [score - mean] * len(seq.tokens),
                    },
                )
            )
        tc.forward_backward(data, "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    assert statistics.mean(rewards[-3:]) > statistics.mean(rewards[:2]) + 0.3, rewards


def test_tenants_are_kept_apart(svc: Service):
    alice, bob = svc.client("alice"), svc.client("bob")
    a = alice.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    b = bob.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    path = a.save_weights_for_sampler("mine").result().path
    run_id = a.model_id
    # Bob cannot see, sample or load Alice's run.
    with pytest.raises(tinker.NotFoundError):
        svc.rest("bob").get_training_run(run_id).result()
    with pytest.raises(tinker.NotFoundError):
        greedy(bob.create_sampling_client(model_path=path).result(), SEQ[:3])
    with pytest.raises(tinker.NotFoundError):
        b.load_state(path.replace("sampler_weights", "weights")).result()
    # Alice's malformed datum is a 400 naming the field; Bob trains on.
    bad = types.Datum(
        model_input=types.ModelInput.from_ints(SEQ[:-1]),
        loss_fn_inputs={"target_tokens": SEQ[1:], "weights": [1.0] * 3},
    )
    with pytest.raises(tinker.BadRequestError, match=r"data\[0\]\.weights"):
        a.forward_backward([bad], "cross_entropy").result()
    assert len(sft_steps(b, 2)) == 2
    runs = svc.rest("bob").list_training_runs().result()
    assert run_id not in [r.training_run_id for r in runs.training_runs]


def test_a_full_quota_is_429_with_a_retry_delay(svc: Service):
    headers = {"X-API-Key": KEYS["carol"]}
    with httpx.Client(base_url=svc.url, headers=headers, timeout=60) as http:
        session = http.post("/api/v1/create_session", json={}).json()["session_id"]
        statuses = []
        for seq in range(MAX_RUNS + 1):
            reply = http.post(
                "/api/v1/create_model",
                json={"session_id": session, "model_seq_id": seq, "base_model": MODEL},
            )
            statuses.append(reply.status_code)
        assert statuses == [200] * MAX_RUNS + [429]
        assert reply.headers["retry-after-ms"] == "3000"
        assert "max_runs_per_tenant" in reply.json()["detail"]


def test_malformed_requests_are_400s_naming_the_field_and_the_service_stays_up(svc: Service):
    headers = {"X-API-Key": KEYS["carol"]}
    with httpx.Client(base_url=svc.url, headers=headers, timeout=60) as http:
        session = http.post("/api/v1/create_session", json={}).json()["session_id"]
        cases = [
            ("/api/v1/create_model", {"session_id": session, "model_seq_id": "x"}, "model_seq_id"),
            (
                "/api/v1/create_model",
                {
                    "session_id": session,
                    "model_seq_id": 0,
                    "base_model": MODEL,
                    "lora_config": {"rank": 2**40},
                },
                "lora_config.rank",
            ),
            ("/api/v1/optim_step", {"model_id": "m", "adam_params": {"beta1": "x"}}, "beta1"),
            ("/api/v1/optim_step", {"model_id": "m", "seq_id": -3, "adam_params": {}}, "seq_id"),
            ("/api/v1/asample", {"sampling_session_id": "nope"}, "sampling_session_id"),
            ("/api/v1/retrieve_future", {"request_id": 7}, "request_id"),
            ("/api/v1/load_weights", {"model_id": "m", "path": "tinker://a/b"}, "path"),
            ("/api/v1/session_heartbeat", [1, 2], "JSON object"),
        ]
        for path, body, named in cases:
            reply = http.post(path, json=body)
            assert 400 <= reply.status_code < 500, (path, body, reply.text)
            assert named in reply.json()["detail"], (path, reply.text)
        garbage = http.post(
            "/api/v1/forward_backward",
            content=b"\xff\x00not a protobuf",
            headers={"Content-Type": "application/x-protobuf"},
        )
        assert garbage.status_code == 400
        as_json = http.post("/api/v1/forward_backward", json={"model_id": "m"})
        assert as_json.status_code == 400 and "x-protobuf" in as_json.json()["detail"]
        assert http.get("/api/v1/healthz").json() == {"status": "ok"}


def test_state_checkpoints_resume_bit_exactly(svc: Service):
    sc = svc.client("bob")
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=2).result()
    sft_steps(tc, 2)
    path = tc.save_state("after-2").result().path
    assert path.startswith("tinker://") and "/weights/after-2" in path
    info = svc.rest("bob").get_weights_info_by_tinker_path(path).result()
    assert info.base_model == MODEL and info.lora_rank == 4
    first = sft_steps(tc, 3)
    resumed = sc.create_training_client_from_state_with_optimizer(path).result()
    assert sft_steps(resumed, 3) == first


def test_what_is_not_served_is_refused_at_once(svc: Service):
    headers = {"X-API-Key": KEYS["alice"]}
    with httpx.Client(base_url=svc.url, headers=headers, timeout=60) as http:
        # Not 5xx: the SDK would retry those for minutes.
        reply = http.post("/api/v1/create_custom_loss", json={})
        assert reply.status_code == 404 and "not supported" in reply.json()["detail"]
        assert http.get("/api/v1/billing/usage/checkpoints/current").status_code == 404
    tc = svc.client("alice").create_lora_training_client(base_model=MODEL, rank=4).result()
    with pytest.raises(tinker.APIStatusError) as err:
        tc.optim_step(types.DimuonParams(learning_rate=1e-3)).result()
    assert err.value.status_code == 400 and "Adam" in str(err.value)


def test_files_are_written_only_under_the_service_root(svc: Service):
    # Checkpoints under tinker.root; the training service's log under output.dir/logs.
    logs = svc.root.parent / "logs"
    written = [p for p in (svc.root.parent).rglob("*") if p.is_file()]
    assert any(p.is_relative_to(svc.root) for p in written)
    assert all(p.is_relative_to(svc.root) or p.is_relative_to(logs) for p in written)


def service_pids(log: Path) -> list[int]:
    return [int(line.split()[2]) for line in log.read_text().splitlines() if "SERVICE pid" in line]


def test_a_killed_training_service_fails_its_calls_clearly_and_is_restarted(
    tmp_path_factory: pytest.TempPathFactory,
):
    """kill -9 of the process holding the model: the tenant gets an error saying what
    happened (not minutes of retries) and where the run's last autosave is, a new run works
    on the restarted service, and both the autosave and a state saved before the kill resume
    exactly where the run was."""
    out = tmp_path_factory.mktemp("tinker-kill")
    child = start_tinker(out, KEYS, MODEL, "tinker.autosave_steps=2")
    try:
        svc = Service(child, f"http://{child.address}", out / "run" / "tinker")
        sc = svc.client("alice")
        tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
        sft_steps(tc, 2)
        path = tc.save_state("before-kill").result().path
        [next_loss] = sft_steps(tc, 1)
        log = out / "run" / "logs" / "lora-training.log"
        [pid] = service_pids(log)
        os.kill(pid, signal.SIGKILL)
        restarted = r"exited .* restarted: runs made before"
        with pytest.raises(tinker.NotFoundError, match=restarted) as lost:
            sft_steps(tc, 1)
        assert len(service_pids(log)) == 2  # it was started again
        # The error names the run's autosave: after its second step, the one saved above.
        autosave = r"its state at step 2 is saved as (tinker://\S+/weights/autosave),"
        found = re.search(autosave, str(lost.value))
        assert found is not None, str(lost.value)
        autosaved = sc.create_training_client_from_state_with_optimizer(found.group(1)).result()
        assert sft_steps(autosaved, 1) == [next_loss]
        fresh = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
        assert len(sft_steps(fresh, 2)) == 2
        # A state saved before the kill resumes exactly where it was.
        resumed = sc.create_training_client_from_state_with_optimizer(path).result()
        assert sft_steps(resumed, 1) == [next_loss]
    finally:
        stop_children([child])


def trainer_rank_pids(log: Path) -> list[int]:
    """Every trainer-group worker the service started, in order."""
    return [
        int(pid)
        for pid in re.findall(r"trainer-rank-\d+ listening on \S+ \(pid (\d+)\)", log.read_text())
    ]


def test_a_trainer_group_trains_as_one_process_and_outlives_a_killed_rank(
    svc: Service, tmp_path_factory: pytest.TempPathFactory
):
    """tinker.trainer_ranks=2: the SDK's losses are those of the one-process service (the
    module's), and kill -9 of the worker rank costs the tenant nothing but time."""
    out = tmp_path_factory.mktemp("tinker-group")
    child = start_tinker(out, KEYS, MODEL, "tinker.trainer_ranks=2")
    try:
        grouped = Service(child, f"http://{child.address}", out / "run" / "tinker")
        tc = (
            grouped.client("dave")
            .create_lora_training_client(base_model=MODEL, rank=8, seed=1)
            .result()
        )
        alone = (
            svc.client("dave")
            .create_lora_training_client(base_model=MODEL, rank=8, seed=1)
            .result()
        )
        data = [sft_datum(), sft_datum([9, 4, 7, 30, 2]), sft_datum([3, 3, 40, 41])]
        first = sft_steps(tc, 4, data=data)
        assert first == pytest.approx(sft_steps(alone, 4, data=data), rel=1e-4)
        assert first[-1] < first[0]
        log = out / "run" / "logs" / "lora-training.log"
        [worker] = trainer_rank_pids(log)
        os.kill(worker, signal.SIGKILL)
        assert sft_steps(tc, 3, data=data) == pytest.approx(
            sft_steps(alone, 3, data=data), rel=1e-4
        )
        assert len(trainer_rank_pids(log)) == 2  # replaced
    finally:
        stop_children([child])
