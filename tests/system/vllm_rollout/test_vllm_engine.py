"""The vllm engine keeps the engine contract the hf engine keeps (real vLLM, CPU build).

One rollout server on vLLM (built-in tiny model, the trainer's initial weights) answers
Generate, GenerateStream, RunEpisodes and WeightSync calls; an hf engine on the same model and
seed is the reference for tokens and log-probs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from areal_servers.rollout.engine import SamplingConfig
from arealgrpc.v1 import common_pb2, rollout_pb2, weight_sync_pb2

from areal_grpc import tensor_codec as tc
from areal_grpc.errors import field_violations
from areal_grpc.model import load_model
from areal_grpc.ports import free_port
from areal_grpc.shared_memory import own_root
from areal_grpc.weight_disk import write_version
from areal_grpc.weight_transfer import GroupParams, WeightGroup
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
from tests.support.vllm import RPC_TIMEOUT, SETTINGS, TINY, VllmServer, start_vllm_server
from tests.support.weightsync import push_messages


def test_greedy_tokens_and_logprobs_equal_the_hf_engine(vllm_server: VllmServer):
    got = vllm_server.greedy(PROMPT, n=16)
    want = hf_reference(PROMPT, SamplingConfig(temperature=0.0, max_new_tokens=16, ignore_eos=True))
    assert list(got.output_ids) == want.output_ids
    assert list(got.output_logprobs) == pytest.approx(want.output_logprobs, abs=LOGPROB_TOL)
    assert got.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert set(got.output_versions) == {vllm_server.version()}


def test_sampled_logprobs_are_log_softmax_over_temperature_as_the_trainer_computes(
    vllm_server: VllmServer,
):
    temperature = 0.7
    reply = vllm_server.generate(
        PROMPT, temperature=temperature, max_new_tokens=12, seed=3, ignore_eos=True
    )
    c = reply.completions[0]
    model = load_model(TINY, seed=0)
    ids = torch.tensor([PROMPT + list(c.output_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    n = len(PROMPT)
    want = [logp[n - 1 + i, t].item() for i, t in enumerate(c.output_ids)]
    assert list(c.output_logprobs) == pytest.approx(want, abs=LOGPROB_TOL)


def test_the_same_seed_gives_the_same_samples(vllm_server: VllmServer):
    def samples(seed: int) -> list[list[int]]:
        reply = vllm_server.generate(
            PROMPT, temperature=1.0, max_new_tokens=12, n_samples=4, seed=seed, ignore_eos=True
        )
        return [list(c.output_ids) for c in reply.completions]

    first = samples(11)
    assert samples(11) == first
    # Sample i uses seed + i: the four differ, and another seed gives other ones.
    assert len({tuple(s) for s in first}) == 4
    assert samples(12) != first
    assert samples(12)[:3] == first[1:]


def test_seeded_requests_whose_prompts_exceed_one_steps_budget_sample_as_alone(
    vllm_server: VllmServer,
):
    """Many seeded requests at once, with more prompt tokens than vLLM schedules in one
    step. With chunked prefill, vLLM's CPU build crashes its engine on them (rewinding a
    request's generator after a partial prefill: "CPU Generator does not use offset"); the
    engine turns it off on CPUs. Each request samples what it samples alone."""
    prompts = [[(7 * i + j) % 250 + 3 for j in range(200)] for i in range(40)]
    params = {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(
            pool.map(
                lambda ip: vllm_server.generate(ip[1], seed=ip[0], **params), enumerate(prompts)
            )
        )
    assert not vllm_server.fatal
    for i in (0, 17, 39):
        alone = vllm_server.generate(prompts[i], seed=i, **params)
        assert list(together[i].completions[0].output_ids) == list(alone.completions[0].output_ids)


def test_stop_token_ids_end_generation_and_are_kept(vllm_server: VllmServer):
    greedy = list(vllm_server.greedy(PROMPT, n=12).output_ids)
    stop = greedy[5]
    reply = vllm_server.generate(
        PROMPT, temperature=0.0, max_new_tokens=12, stop_token_ids=[stop], ignore_eos=True
    )
    c = reply.completions[0]
    cut = greedy.index(stop) + 1
    assert list(c.output_ids) == greedy[:cut]
    assert c.finish_reason == common_pb2.FINISH_REASON_STOP


def test_top_logprobs_are_the_most_likely_tokens_as_the_hf_engine_reports(
    vllm_server: VllmServer,
):
    reply = vllm_server.generate(
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


def test_bad_sampling_fields_and_overlong_prompts_are_invalid_argument_naming_the_field(
    vllm_server: VllmServer,
):
    # vLLM reports log-probs after truncation: refused rather than reported wrong.
    expect_invalid(lambda: vllm_server.generate(PROMPT, top_p=0.5), "sampling.top_p")
    expect_invalid(lambda: vllm_server.generate(PROMPT, top_k=5), "sampling.top_k")
    expect_invalid(lambda: vllm_server.generate(PROMPT, temperature=-1.0), "sampling.temperature")
    limit = vllm_server.engine.max_context
    expect_invalid(lambda: vllm_server.generate([5] * limit), "input_ids")
    expect_invalid(
        lambda: vllm_server.generate([5] * (limit - 4), max_new_tokens=8), "sampling.max_new_tokens"
    )
    expect_invalid(lambda: vllm_server.generate([5, 6, 7, 100_000]), "input_ids[3]")
    # The server stays up and serves.
    assert len(vllm_server.greedy(PROMPT, n=4).output_ids) == 4
    assert vllm_server.fatal == []


def test_a_cancelled_stream_frees_its_request(vllm_server: VllmServer):
    call = vllm_server.rollout.GenerateStream(
        rollout_pb2.GenerateStreamRequest(
            input_ids=PROMPT,
            sampling=common_pb2.SamplingParams(
                temperature=1.0, max_new_tokens=200, ignore_eos=True
            ),
        ),
        timeout=RPC_TIMEOUT,
    )
    got = 0
    for msg in call:
        got += len(msg.output_ids)
        if got >= 3:
            call.cancel()
            break
    deadline = time.monotonic() + 30
    while vllm_server.engine.status().running and time.monotonic() < deadline:
        time.sleep(0.1)
    assert vllm_server.engine.status().running == 0


def test_an_update_changes_logprobs_and_the_original_weights_restore_them_exactly(
    vllm_server: VllmServer,
):
    original = initial_weights()
    before = vllm_server.greedy(PROMPT)
    v = vllm_server.version()
    # A change the hf engine's reference sees too (every MLP weight and the tied embedding).
    changed = {k: (t * 1.05 if "mlp" in k or "embed" in k else t) for k, t in original.items()}
    assert vllm_server.push(changed, v + 1).policy_version == v + 1
    after = vllm_server.greedy(PROMPT)
    assert list(after.output_logprobs) != pytest.approx(list(before.output_logprobs), abs=1e-3)
    want = hf_reference(
        PROMPT, SamplingConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True), changed
    )
    assert list(after.output_ids) == want.output_ids
    assert list(after.output_logprobs) == pytest.approx(want.output_logprobs, abs=LOGPROB_TOL)
    assert set(after.output_versions) == {v + 1}
    # Back to the original weights: the original log-probs, exactly (same kernels, same
    # weights).
    vllm_server.push(original, v + 2)
    restored = vllm_server.greedy(PROMPT)
    assert list(restored.output_ids) == list(before.output_ids)
    assert list(restored.output_logprobs) == list(before.output_logprobs)


def test_a_distributed_update_lands_in_vllms_worker_while_vllm_goes_on_generating(
    vllm_server: VllmServer,
):
    original = initial_weights()
    changed = {k: (t * 1.05 if "mlp" in k or "embed" in k else t) for k, t in original.items()}
    before = vllm_server.greedy(PROMPT)
    v = vllm_server.version()
    params, request = join_as_sender(vllm_server, changed, v + 1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(vllm_server.sync.UpdateFromDistributed, request, timeout=RPC_TIMEOUT)
        # Returns once vLLM's worker has joined; it now waits for the broadcast on a thread
        # of its own, and vLLM answers meanwhile, on the old weights.
        group = WeightGroup(params)
        during = vllm_server.greedy(PROMPT)
        assert list(during.output_logprobs) == list(before.output_logprobs)
        assert set(during.output_versions) == {v}
        assert not reply.done()
        for t in changed.values():
            group.broadcast(t.contiguous())
        assert reply.result().policy_version == v + 1
    after = vllm_server.greedy(PROMPT)
    want = hf_reference(
        PROMPT, SamplingConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True), changed
    )
    assert list(after.output_ids) == want.output_ids
    assert list(after.output_logprobs) == pytest.approx(want.output_logprobs, abs=LOGPROB_TOL)
    assert set(after.output_versions) == {v + 1}
    # The worker's nothing written, nothing staged: the broadcast was its own.
    assert vllm_server.engine.last_load_s[0] == 0.0
    assert vllm_server.engine.last_staged_bytes == 0
    # The worker is still in the group, which a new plan for it says (so a sender keeps its
    # group); the original weights then restore the original log-probs exactly.
    again = negotiate_gloo(vllm_server, params.master_port, params.group_name)
    assert again.plan.distributed.joined
    request.plan_id = again.plan_id
    request.policy_version = v + 2
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(vllm_server.sync.UpdateFromDistributed, request, timeout=RPC_TIMEOUT)
        for t in original.values():
            group.broadcast(t.contiguous())
        assert reply.result().policy_version == v + 2
    group.close()
    restored = vllm_server.greedy(PROMPT)
    assert list(restored.output_ids) == list(before.output_ids)
    assert list(restored.output_logprobs) == list(before.output_logprobs)
    assert vllm_server.fatal == []


def test_a_distributed_update_that_does_not_fit_the_model_is_invalid_argument_naming_the_tensor(
    vllm_server: VllmServer,
):
    original = initial_weights()
    name = next(k for k in original if "mlp" in k)
    wrong = {**original, name: torch.zeros(3, 5)}
    before = vllm_server.greedy(PROMPT)
    v = vllm_server.version()
    params, request = join_as_sender(vllm_server, wrong, v + 1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(vllm_server.sync.UpdateFromDistributed, request, timeout=RPC_TIMEOUT)
        group = WeightGroup(params)
        for t in wrong.values():
            group.broadcast(t.contiguous())
        with pytest.raises(grpc.RpcError) as info:
            reply.result()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert name in (info.value.details() or "")
    assert vllm_server.version() == v
    assert list(vllm_server.greedy(PROMPT).output_logprobs) == list(before.output_logprobs)
    # The server stays up, and the group with it: the model's own tensors then land.
    request.ClearField("tensors")
    request.tensors.extend(tc.tensor_spec(n, t) for n, t in original.items())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(vllm_server.sync.UpdateFromDistributed, request, timeout=RPC_TIMEOUT)
        for t in original.values():
            group.broadcast(t.contiguous())
        assert reply.result().policy_version == v + 1
    group.close()
    assert list(vllm_server.greedy(PROMPT).output_logprobs) == list(before.output_logprobs)
    assert vllm_server.fatal == []


def test_a_sender_that_dies_mid_broadcast_fails_the_update_and_the_old_weights_keep_serving(
    vllm_server: VllmServer,
):
    original = initial_weights()
    before = vllm_server.greedy(PROMPT)
    v = vllm_server.version()
    params, request = join_as_sender(vllm_server, original, v + 1)
    shapes = ["x".join(map(str, t.shape)) or "1" for t in original.values()]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(vllm_server.sync.UpdateFromDistributed, request, timeout=RPC_TIMEOUT)
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
        # The worker's broadcast breaks on the closed connection, long before the group's
        # 60 s timeout.
        with pytest.raises(grpc.RpcError) as info:
            reply.result(timeout=30)
    assert info.value.code() == grpc.StatusCode.DATA_LOSS, info.value.details()
    assert "did not receive the weights" in (info.value.details() or "")
    assert vllm_server.version() == v
    # The broken group is left: a plan for it again needs a rendezvous.
    assert not negotiate_gloo(
        vllm_server, params.master_port, params.group_name
    ).plan.distributed.joined
    kept = vllm_server.greedy(PROMPT)
    assert list(kept.output_logprobs) == list(before.output_logprobs)
    # The next update forms a new group with the worker and lands.
    changed = {k: t * 1.05 if "mlp" in k else t for k, t in original.items()}
    params, request = join_as_sender(vllm_server, changed, v + 1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(vllm_server.sync.UpdateFromDistributed, request, timeout=RPC_TIMEOUT)
        group = WeightGroup(params)
        for t in changed.values():
            group.broadcast(t.contiguous())
        assert reply.result().policy_version == v + 1
    group.close()
    assert list(vllm_server.greedy(PROMPT).output_logprobs) != list(before.output_logprobs)
    assert vllm_server.fatal == []


def test_a_corrupted_or_mismatched_update_is_refused_and_the_old_weights_keep_serving(
    vllm_server: VllmServer,
):
    v = vllm_server.version()
    before = vllm_server.greedy(PROMPT)
    new = {k: t + 0.01 for k, t in initial_weights().items()}
    messages = push_messages(new, v + 1, chunk_bytes=4096)
    bad = messages[3].to_proto()
    bad.data = bytes([bad.data[0] ^ 1]) + bad.data[1:]
    messages[3] = bad
    with pytest.raises(grpc.RpcError) as info:
        vllm_server.push_messages(messages)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert next(f for f, _ in field_violations(info.value)).endswith(".crc32c")
    # A well-formed stream of the wrong tensors (a shape the model does not have).
    wrong = dict(new)
    name = "model.layers.0.mlp.up_proj.weight"
    wrong[name] = torch.zeros(wrong[name].shape[0] + 1, wrong[name].shape[1])
    with pytest.raises(grpc.RpcError) as info:
        vllm_server.push(wrong, v + 1)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert name in (info.value.details() or "")
    # A disk update that vLLM's worker would read straight from its files: a file of the
    # wrong tensors, and a truncated one, are refused from their headers, before any change.
    root = vllm_server.disk_root
    assert root is not None

    def update_from_disk(state: dict[str, torch.Tensor], version: int, cut: int = 0) -> object:
        directory = write_version(root, version, [state], 1)
        if cut:
            [file] = directory.glob("*.safetensors")
            file.write_bytes(file.read_bytes()[:-cut])
        request = weight_sync_pb2.UpdateFromDiskRequest(policy_version=version, path=directory.name)
        try:
            return vllm_server.sync.UpdateFromDisk(request, timeout=RPC_TIMEOUT)
        finally:
            shutil.rmtree(directory)

    for state, cut in ((wrong, 0), (new, 64)):
        with pytest.raises(grpc.RpcError) as info:
            update_from_disk(state, v + 1, cut)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (name if cut == 0 else "cannot read") in (info.value.details() or "")
    assert vllm_server.version() == v
    again = vllm_server.greedy(PROMPT)
    assert list(again.output_ids) == list(before.output_ids)
    assert list(again.output_logprobs) == list(before.output_logprobs)
    assert vllm_server.fatal == []
    # A sound one lands, read from its own file: nothing written for vLLM first.
    assert update_from_disk(new, v + 1).policy_version == v + 1
    assert vllm_server.engine.last_load_s[0] == 0.0
    assert vllm_server.greedy(PROMPT).output_logprobs != pytest.approx(
        list(before.output_logprobs), abs=1e-4
    )


def test_a_request_in_flight_during_an_update_is_interrupted_and_completes_after_it(
    vllm_server: VllmServer,
):
    """Abort mode (the default): RunEpisodes keeps a long episode going across Pause, an
    update and Resume, the request interrupted and sent again; each token carries its
    version and the log-probs after the update are the new weights'."""
    v = vllm_server.version()
    new = {k: t * 1.05 if "mlp" in k else t for k, t in initial_weights().items()}
    paused, traj = long_episode_across_an_update(vllm_server, new)
    assert paused.interrupted_requests >= 1
    check_versions_and_logprobs_across(traj, v, new)


def test_keep_mode_holds_a_request_across_an_update_with_each_tokens_version(
    vllm_installed: None,
):
    """Keep mode: vLLM holds the request through the update instead of ending it; its KV
    cache is recomputed under the new weights, so the log-probs after the update are the
    new weights' on the whole sequence, and vLLM's version spans give each token's version."""
    # Closed here, not with the module: the tests after this one count vLLM's processes.
    server = start_vllm_server(settings=dataclasses.replace(SETTINGS, pause_mode="keep"))
    try:
        v = server.version()
        new = {k: t * 1.05 if "mlp" in k else t for k, t in initial_weights().items()}
        paused, traj = long_episode_across_an_update(server, new)
        assert paused.interrupted_requests == 0
        check_versions_and_logprobs_across(traj, v, new)
        assert not server.fatal
    finally:
        server.close()


def test_vllms_socket_files_stay_in_the_engines_own_directory_and_go_with_it(
    vllm_installed: None,
):
    """vLLM names its ZeroMQ sockets in /tmp by default and leaves them there (seven files an
    engine, measured); this engine gives it a directory of its own, removed at close."""
    server = start_vllm_server()
    try:
        rpc = server.engine.rpc_dir
        own = own_root()
        assert rpc is not None and own is not None and rpc.parent == own[0]
        assert any(p.is_socket() for p in rpc.iterdir())
        assert len(server.greedy(PROMPT).output_ids) == 12
    finally:
        server.close()
    assert not rpc.exists()


def staged_files() -> list[Path]:
    """The vllm engine's staged weight files (in this process's shared-memory directory: the
    test's server runs in this process)."""
    own = own_root()
    assert own is not None
    return sorted(own[0].glob("staged-v*.safetensors"))


def test_updates_are_received_into_the_staged_file_which_vllm_does_not_serve_from(
    vllm_server: VllmServer,
):
    """The second of two streamed updates lands in the staged file itself (nothing copied),
    and vLLM keeps its own copy: rewriting the file after a load changes nothing served."""
    v = vllm_server.version()
    new = {k: t * 1.01 for k, t in initial_weights().items()}
    vllm_server.push(new, v + 1)
    vllm_server.push(new, v + 2)
    assert vllm_server.engine.last_staged_bytes == 0
    before = vllm_server.greedy(PROMPT)
    [staged] = staged_files()
    size = staged.stat().st_size
    with staged.open("r+b") as f:
        header_len = int.from_bytes(f.read(8), "little")
        f.seek(8 + header_len)
        f.write(b"\xff" * (size - 8 - header_len))  # every float a NaN
    after = vllm_server.greedy(PROMPT)
    assert list(after.output_ids) == list(before.output_ids)
    assert list(after.output_logprobs) == list(before.output_logprobs)
    # The next update overwrites the file whole, and serves what it sent.
    vllm_server.push(initial_weights(), v + 3)
    assert vllm_server.engine.last_staged_bytes == 0
    restored = vllm_server.greedy(PROMPT)
    assert all(x == x for x in restored.output_logprobs)
    assert [staged] == staged_files()


def vllm_growth_over_200_updates(vllm_server: VllmServer, update) -> int:
    """Bytes the server's vLLM processes' resident memory grew over ``update(200)``, after
    ``update(20)`` let the allocator and page cache settle."""
    import psutil

    vllm_procs = [
        p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")
    ]
    assert len(vllm_procs) >= 1

    def rss() -> int:
        return sum(p.memory_info().rss for p in vllm_procs)

    update(20)
    before = rss()
    update(200)
    grown = rss() - before
    print(f"vLLM RSS {before / 2**20:.0f} MiB, {grown / 2**20:+.1f} MiB over 200 updates")
    return grown


def test_hundreds_of_updates_do_not_grow_vllms_memory(vllm_server: VllmServer):
    """200 full updates (each one copied into the staged file and a layerwise reload in
    vLLM's worker): the resident memory of the server's vLLM processes stays put after the
    first few."""
    engine = vllm_server.engine
    weights = initial_weights()
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())

    def update(n: int) -> None:
        async def run() -> None:
            for _ in range(n):
                await engine.load_weights(weights, engine.version + 1)

        vllm_server.server.call(run(), timeout_s=900)

    grown = vllm_growth_over_200_updates(vllm_server, update)
    # A leak of one copy per update would be 200 x the weights (800 MB here).
    assert grown < 10 * nbytes, f"vLLM grew {grown / 2**20:.0f} MiB over 200 updates"
    assert vllm_server.greedy(PROMPT).output_ids
    assert vllm_server.fatal == []
    # Every update went through the one staged file.
    assert len(staged_files()) == 1


def test_hundreds_of_updates_received_in_vllms_worker_do_not_grow_its_memory(
    vllm_server: VllmServer,
):
    """The same for 200 broadcasts into vLLM's worker over one kept group: each lands in the
    buffers the last one was received into."""
    engine = vllm_server.engine
    weights = initial_weights()
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    specs = [(n, t.dtype, list(t.shape)) for n, t in weights.items()]
    port = free_port()
    mine = GroupParams("127.0.0.1", port, 2, 1, f"many-{port}", "gloo", timeout_s=60)
    sender: list[WeightGroup] = []

    def send(n: int) -> None:
        if not sender:
            sender.append(WeightGroup(dataclasses.replace(mine, rank=0)))
        for _ in range(n):
            for t in weights.values():
                sender[0].broadcast(t)

    def update(n: int) -> None:
        async def run() -> None:
            for _ in range(n):
                await engine.receive_group(mine, specs)
                await engine.load_received(engine.version + 1)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            sent = pool.submit(send, n)
            vllm_server.server.call(run(), timeout_s=900)
            sent.result(timeout=60)

    grown = vllm_growth_over_200_updates(vllm_server, update)
    sender[0].close()
    assert grown < 10 * nbytes, f"vLLM grew {grown / 2**20:.0f} MiB over 200 updates"
    assert vllm_server.greedy(PROMPT).output_ids
    assert vllm_server.fatal == []


def test_an_idle_worker_gives_its_core_back(vllm_server: VllmServer):
    """Right after generation ends, vLLM's model worker would spin for a second after every
    message (its shared-memory queue's busy wait), health pings included: a core's worth of
    CPU that a trainer sharing the machine loses. With ``rollout.vllm.idle_spin_s`` (0.05 s
    here) it sleeps instead: over the 4 s after a generation it uses a small share of the
    CPU seconds one spinning second alone would take (CPU time, not wall time: a busy
    machine cannot make it pass or fail)."""
    import psutil

    (worker,) = [p for p in psutil.Process().children(recursive=True) if p.name() == "VLLM::Worker"]
    assert vllm_server.greedy(PROMPT, n=8).output_ids
    before = worker.cpu_times()
    time.sleep(4.0)
    after = worker.cpu_times()
    used = (after.user - before.user) + (after.system - before.system)
    print(f"vLLM worker: {used:.2f} CPU s in the 4 s after generation")
    assert used < 0.3, f"vLLM's worker used {used:.2f} CPU s while idle"


def test_vllms_engine_killed_under_a_load_and_a_generate_names_one_death_on_every_path(
    vllm_server: VllmServer,
):
    """Last in the module: it ends the module's server. Where the kill lands does not change
    what is said: with vLLM's engine process frozen, a weight update and a generate are sent
    (both wait on it), then it is killed. Both calls, the watchdog and every later call name
    the same death, UNAVAILABLE; the version stays."""
    import psutil

    server = vllm_server
    [core] = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.name().startswith("VLLM::EngineCore")
    ]
    v = server.version()
    assert server.greedy(PROMPT, 4).output_ids
    core.send_signal(signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        load = pool.submit(server.push, initial_weights(), v + 1)
        generate = pool.submit(server.greedy, PROMPT, 8)
        # Both are under way (the load has paused generation; the generate waits).
        time.sleep(2.0)
        assert not load.done() and not generate.done()
        core.send_signal(signal.SIGKILL)
        errors = []
        for call in (load, generate):
            with pytest.raises(grpc.RpcError) as info:
                call.result(timeout=RPC_TIMEOUT)
            errors.append(info.value)
    death = "the vllm engine died: its engine process died"
    for error in errors:
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
        assert death in error.details()
    assert server.fatal == ["its engine process died"]
    with pytest.raises(grpc.RpcError) as later:
        server.greedy(PROMPT, 4)
    assert later.value.code() == grpc.StatusCode.UNAVAILABLE
    assert death in later.value.details()
    assert server.engine.version == v
