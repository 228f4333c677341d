"""The sglang engine keeps the engine contract the hf engine keeps, against SGLang's real server
(its torch-native CPU path, fp32).

One rollout server on SGLang (built-in tiny model, the trainer's initial weights) answers
Generate, RunEpisodes and WeightSync calls; an hf engine on the same model and seed, and the
model's own forward, are the references for tokens and log-probs. The module's last test
freezes the server (one SGLang start less: SGLang takes about 20 s to start here); killed
processes, through a whole run, are test_sglang_run.py's.
"""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import sys
import time

import grpc
import psutil
import pytest
import torch
from areal_servers.rollout.engine import SamplingConfig
from arealgrpc.v1 import common_pb2, rollout_pb2, weight_sync_pb2

from areal_grpc.model import load_model
from areal_grpc.weight_disk import write_version
from areal_grpc.weight_transfer import WeightGroup
from tests.support.engine_contract import (
    DYING_SENDER,
    LOGPROB_TOL,
    PROMPT,
    check_versions_and_logprobs_across,
    expect_invalid,
    hf_reference,
    initial_weights,
    join_as_sender,
    long_episode_across_an_update,
    negotiate_gloo,
)
from tests.support.sglang import RPC_TIMEOUT, TINY, SglangServer


def reference_logprobs(
    tokens: list[int], prompt: list[int], temperature: float, weights=None
) -> list[float]:
    """log_softmax(logits / T) of each output token under the model's own forward (fp32)."""
    model = load_model(TINY, seed=0)
    if weights is not None:
        model.load_state_dict(weights, strict=False)  # the tied head is the embedding
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    n = len(prompt)
    return [logp[n - 1 + i, t].item() for i, t in enumerate(tokens)]


def changed_weights() -> dict[str, torch.Tensor]:
    """The initial weights with every MLP weight and the tied embedding scaled: a change the
    greedy log-probs show."""
    return {
        k: (t * 1.05 if "mlp" in k or "embed" in k else t) for k, t in initial_weights().items()
    }


def test_greedy_tokens_and_logprobs_equal_the_hf_engine(sglang_server: SglangServer):
    got = sglang_server.greedy(PROMPT, n=16)
    want = hf_reference(PROMPT, SamplingConfig(temperature=0.0, max_new_tokens=16, ignore_eos=True))
    assert list(got.output_ids) == want.output_ids
    assert list(got.output_logprobs) == pytest.approx(want.output_logprobs, abs=LOGPROB_TOL)
    assert got.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert set(got.output_versions) == {sglang_server.version()}


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"), [(0.7, 1.0, 0), (1.0, 0.9, 0), (1.0, 1.0, 20)]
)
def test_sampled_logprobs_are_log_softmax_over_temperature_before_truncation(
    sglang_server: SglangServer, temperature: float, top_p: float, top_k: int
):
    """What the trainer computes, whatever top-p / top-k truncated: SGLang reports the
    sampled token's log-prob under the whole tempered distribution. Against the truncated,
    renormalised distribution (what vLLM reports) they differ."""
    reply = sglang_server.generate(
        PROMPT,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=12,
        ignore_eos=True,
    )
    c = reply.completions[0]
    want = reference_logprobs(list(c.output_ids), PROMPT, temperature)
    assert list(c.output_logprobs) == pytest.approx(want, abs=LOGPROB_TOL)
    if top_k:
        # The 20 likeliest of the tiny model's 384 tokens hold well under all the mass.
        model = load_model(TINY, seed=0)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(c.output_ids)])).logits[0]
        top = torch.log_softmax(logits / temperature, -1).topk(top_k, -1).values
        mass = top.logsumexp(-1)[len(PROMPT) - 1 : -1]
        assert (mass < -0.5).all(), mass


def test_n_samples_max_new_tokens_and_stop_token_ids(sglang_server: SglangServer):
    reply = sglang_server.generate(PROMPT, temperature=1.0, max_new_tokens=8, n_samples=3)
    assert len(reply.completions) == 3
    for c in reply.completions:
        assert c.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
        assert 1 <= len(c.output_ids) <= 8
    assert len({tuple(c.output_ids) for c in reply.completions}) > 1
    greedy = list(sglang_server.greedy(PROMPT, n=12).output_ids)
    stop = greedy[5]
    cut = greedy.index(stop) + 1
    # With EOS honoured SGLang stops on the id; ignoring EOS turns SGLang's stop ids off, and
    # the engine cuts there itself: the same answer either way, the stop id kept.
    for ignore_eos in (False, True):
        c = sglang_server.generate(
            PROMPT, temperature=0.0, max_new_tokens=12, stop_token_ids=[stop], ignore_eos=ignore_eos
        ).completions[0]
        assert list(c.output_ids) == greedy[:cut], ignore_eos
        assert c.finish_reason == common_pb2.FINISH_REASON_STOP
        assert len(c.output_logprobs) == len(c.output_versions) == cut


def test_top_logprobs_are_the_most_likely_tokens_as_the_hf_engine_reports(
    sglang_server: SglangServer,
):
    reply = sglang_server.generate(
        PROMPT, temperature=0.0, max_new_tokens=6, top_logprobs=3, ignore_eos=True
    )
    c = reply.completions[0]
    want = hf_reference(
        PROMPT, SamplingConfig(temperature=0.0, max_new_tokens=6, top_logprobs=3, ignore_eos=True)
    )
    assert len(c.output_top_logprobs) == 6
    for got, (ids, lps) in zip(c.output_top_logprobs, want.output_top, strict=True):
        assert list(got.token_ids) == ids
        assert list(got.logprobs) == pytest.approx(lps, abs=LOGPROB_TOL)


def test_bad_fields_are_invalid_argument_naming_the_field(sglang_server: SglangServer):
    # SGLang ignores seeds outside its deterministic mode: refused rather than not kept.
    expect_invalid(lambda: sglang_server.generate(PROMPT, seed=3), "sampling.seed")
    expect_invalid(lambda: sglang_server.generate(PROMPT, temperature=-1.0), "sampling.temperature")
    limit = sglang_server.engine.max_context
    expect_invalid(lambda: sglang_server.generate([5] * limit), "input_ids")
    expect_invalid(lambda: sglang_server.generate([5, 6, 7, 100_000]), "input_ids[3]")
    assert len(sglang_server.greedy(PROMPT, n=4).output_ids) == 4
    assert sglang_server.deaths == []


def test_a_cancelled_request_is_aborted_in_sglang(sglang_server: SglangServer):
    """A cancelled call sends /abort_request: SGLang drops the request at once (a cache flush,
    which SGLang refuses while any request is pending, then succeeds)."""
    future = sglang_server.rollout.Generate.future(
        rollout_pb2.GenerateRequest(
            input_ids=PROMPT,
            sampling=common_pb2.SamplingParams(
                temperature=1.0, max_new_tokens=400, ignore_eos=True
            ),
        ),
        timeout=RPC_TIMEOUT,
    )
    deadline = time.monotonic() + 30
    while sglang_server.engine.status().running == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    assert sglang_server.sglang("/flush_cache", {}).status_code != 200  # busy
    future.cancel()
    deadline = time.monotonic() + 10
    while sglang_server.sglang("/flush_cache", {}).status_code != 200:
        assert time.monotonic() < deadline, "SGLang still runs the cancelled request"
        time.sleep(0.1)
    assert sglang_server.engine.status().running == 0


def test_stream_and_disk_updates_land_and_the_original_weights_restore_them_exactly(
    sglang_server: SglangServer,
):
    original = initial_weights()
    before = sglang_server.greedy(PROMPT)
    v = sglang_server.version()
    changed = changed_weights()
    assert sglang_server.push(changed, v + 1).policy_version == v + 1
    after = sglang_server.greedy(PROMPT)
    assert list(after.output_logprobs) != pytest.approx(list(before.output_logprobs), abs=1e-3)
    want = hf_reference(
        PROMPT, SamplingConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True), changed
    )
    assert list(after.output_ids) == want.output_ids
    assert list(after.output_logprobs) == pytest.approx(want.output_logprobs, abs=LOGPROB_TOL)
    assert set(after.output_versions) == {v + 1}
    # Back to the original weights, from a version directory on disk: the original
    # log-probs, exactly (same kernels, same weights).
    assert sglang_server.disk_root is not None
    path = write_version(sglang_server.disk_root, v + 2, [original], 1)
    reply = sglang_server.sync.UpdateFromDisk(
        weight_sync_pb2.UpdateFromDiskRequest(
            path=str(path.relative_to(sglang_server.disk_root)), policy_version=v + 2
        ),
        timeout=RPC_TIMEOUT,
    )
    assert reply.policy_version == v + 2
    restored = sglang_server.greedy(PROMPT)
    assert list(restored.output_ids) == list(before.output_ids)
    assert list(restored.output_logprobs) == list(before.output_logprobs)
    assert set(restored.output_versions) == {v + 2}


def test_an_update_that_does_not_fit_or_is_stale_is_refused_and_the_old_weights_serve(
    sglang_server: SglangServer,
):
    """SGLang itself would take a missing tensor as "keep the old one" and ignore an unknown
    one: the engine refuses both, naming the tensor, before SGLang hears of them."""
    original = initial_weights()
    before = sglang_server.greedy(PROMPT)
    v = sglang_server.version()
    name = next(k for k in original if "mlp" in k)
    for bad, words in (
        ({k: t for k, t in original.items() if k != name}, "lacks"),
        ({**original, "model.extra.weight": torch.zeros(3)}, "unknown"),
        ({**original, name: torch.zeros(3, 5)}, name),
    ):
        with pytest.raises(grpc.RpcError) as info:
            sglang_server.push(bad, v + 1)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert words in (info.value.details() or "")
    with pytest.raises(grpc.RpcError) as info:
        sglang_server.push(original, v)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert sglang_server.version() == v
    assert list(sglang_server.greedy(PROMPT).output_logprobs) == list(before.output_logprobs)
    assert sglang_server.deaths == []


def test_a_distributed_update_over_gloo_lands_and_keeps_the_group(sglang_server: SglangServer):
    """SGLang joins this process's gloo group (the key layout its group helper uses) and takes
    the broadcast inside a weight-update session; a second update reuses the group."""
    original = initial_weights()
    changed = changed_weights()
    before = sglang_server.greedy(PROMPT)
    v = sglang_server.version()
    params, request = join_as_sender(sglang_server, changed, v + 1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(sglang_server.sync.UpdateFromDistributed, request, timeout=RPC_TIMEOUT)
        group = WeightGroup(params)
        for t in changed.values():
            group.broadcast(t.contiguous())
        assert reply.result().policy_version == v + 1
    after = sglang_server.greedy(PROMPT)
    want = hf_reference(
        PROMPT, SamplingConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True), changed
    )
    assert list(after.output_ids) == want.output_ids
    assert list(after.output_logprobs) == pytest.approx(want.output_logprobs, abs=LOGPROB_TOL)
    assert set(after.output_versions) == {v + 1}
    again = negotiate_gloo(sglang_server, params.master_port, params.group_name)
    assert again.plan.distributed.joined
    request.plan_id = again.plan_id
    request.policy_version = v + 2
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(sglang_server.sync.UpdateFromDistributed, request, timeout=RPC_TIMEOUT)
        for t in original.values():
            group.broadcast(t.contiguous())
        assert reply.result().policy_version == v + 2
    group.close()
    restored = sglang_server.greedy(PROMPT)
    assert list(restored.output_logprobs) == list(before.output_logprobs)
    assert sglang_server.deaths == []


def test_a_sender_that_dies_mid_broadcast_fails_the_update_and_the_old_weights_keep_serving(
    sglang_server: SglangServer,
):
    original = initial_weights()
    before = sglang_server.greedy(PROMPT)
    v = sglang_server.version()
    params, request = join_as_sender(sglang_server, original, v + 1)
    shapes = ["x".join(map(str, t.shape)) or "1" for t in original.values()]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(sglang_server.sync.UpdateFromDistributed, request, timeout=RPC_TIMEOUT)
        sender = subprocess.Popen(
            [
                sys.executable,
                "-c",
                DYING_SENDER,
                str(params.master_port),
                params.group_name,
                str(len(shapes) // 2),
                *shapes,
            ]
        )
        assert sender.wait(timeout=120) == -signal.SIGKILL
        with pytest.raises(grpc.RpcError) as info:
            reply.result(timeout=60)
    assert info.value.code() != grpc.StatusCode.OK
    assert sglang_server.version() == v
    assert not negotiate_gloo(
        sglang_server, params.master_port, params.group_name
    ).plan.distributed.joined
    kept = sglang_server.greedy(PROMPT)
    assert list(kept.output_logprobs) == list(before.output_logprobs)
    # The next update forms a new group with SGLang and lands.
    changed = changed_weights()
    params, request = join_as_sender(sglang_server, changed, v + 1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(sglang_server.sync.UpdateFromDistributed, request, timeout=RPC_TIMEOUT)
        group = WeightGroup(params)
        for t in changed.values():
            group.broadcast(t.contiguous())
        assert reply.result().policy_version == v + 1
    group.close()
    assert list(sglang_server.greedy(PROMPT).output_logprobs) != list(before.output_logprobs)
    assert sglang_server.deaths == []


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_a_request_in_flight_during_an_update_carries_each_tokens_version(
    sglang_server: SglangServer, mode: str
):
    """abort: the request comes back INTERRUPTED and is sent again after the update; retract:
    SGLang holds it and recomputes its cache under the new weights. Either way the tokens
    before the update carry the old version, those after it the new one, with the new
    weights' log-probs."""
    sglang_server.engine.settings.pause_mode = mode  # read at each pause
    # SGLang's own testing knob: every step sleeps, so that the update lands mid-request.
    sglang_server.sglang("/slow_down", {"forward_sleep_time": 0.02})
    try:
        v = sglang_server.version()
        new = {k: t * 1.02 for k, t in initial_weights().items()}
        paused, traj = long_episode_across_an_update(sglang_server, new, seed=None, running_s=1.0)
        assert paused.interrupted_requests == (1 if mode == "abort" else 0)
        check_versions_and_logprobs_across(traj, v, new)
    finally:
        sglang_server.engine.settings.pause_mode = "abort"
        sglang_server.sglang("/slow_down", {"forward_sleep_time": None})
    assert sglang_server.deaths == []


def test_what_sglang_cannot_take_is_declined_in_negotiation(sglang_server: SglangServer):
    nccl = negotiate_offers(sglang_server, weight_sync_pb2.COLLECTIVE_BACKEND_NCCL)
    assert nccl.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "DISTRIBUTED (backends gloo)" in (nccl.details() or "")


def negotiate_offers(server: SglangServer, backend: int) -> grpc.RpcError:
    from tests.support.weightsync import distributed_offer

    with pytest.raises(grpc.RpcError) as info:
        server.sync.Negotiate(
            weight_sync_pb2.NegotiateRequest(
                offers=[distributed_offer(backend=backend)], sender_id="test"
            ),
            timeout=RPC_TIMEOUT,
        )
    return info.value


def test_a_frozen_scheduler_is_the_engines_death_and_nothing_is_left_behind(
    sglang_server: SglangServer,
):
    """Last in the module: it ends the module's server. SGLang's scheduler frozen (SIGSTOP):
    /health fails twice, which is the engine's death, named once; the call waiting on it stops
    waiting, later calls are UNAVAILABLE, and closing the engine leaves none of SGLang's
    processes behind."""
    assert sglang_server.engine.process is not None
    root = psutil.Process(sglang_server.engine.process.pid)
    procs = [root, *root.children(recursive=True)]
    [scheduler] = [p for p in procs if "scheduler" in p.name()]
    scheduler.send_signal(signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(sglang_server.greedy, PROMPT, 8)
        # Two /health checks of health_timeout_s each, health_interval_s apart.
        deadline = time.monotonic() + 90
        while not sglang_server.deaths and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sglang_server.deaths, "no death in 90 s"
        assert "did not answer /health" in sglang_server.deaths[0], sglang_server.deaths
        with pytest.raises(grpc.RpcError) as info:
            waiting.result(timeout=30)
    death = f"the sglang engine died: {sglang_server.deaths[0]}"
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert death in (info.value.details() or "")
    with pytest.raises(grpc.RpcError) as later:
        sglang_server.greedy(PROMPT, 4)
    assert later.value.code() == grpc.StatusCode.UNAVAILABLE
    assert death in (later.value.details() or "")
    assert len(sglang_server.deaths) == 1
    sglang_server.server.call(sglang_server.engine.close(), timeout_s=120)
    deadline = time.monotonic() + 30
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs):
        assert time.monotonic() < deadline, [p for p in procs if p.is_running()]
        time.sleep(0.2)
