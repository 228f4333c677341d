"""Fuzzing WeightSyncService (on a rollout server, builtin:micro) with malformed messages.

Negotiate gets random offers; PushWeights gets valid chunk streams mutated (reordered,
dropped, duplicated, corrupted, resized, truncated, wrong versions); UpdateFromDisk gets
random and hostile paths; UpdateFromDistributed gets announcements refused before any
rendezvous. Every refusal must be a documented status and leave the served version, the
weights and the greedy output untouched; a valid update afterwards must still apply.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from areal_servers.rollout.hf_engine import HFEngine
from areal_servers.rollout.receive.base import ReceiverConfig
from areal_servers.rollout.service import RolloutServiceConfig, RolloutServicer
from areal_servers.rollout.weight_sync import build_weight_sync_service
from arealgrpc.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, tensor_pb2
from arealgrpc.v1 import weight_sync_pb2 as pb
from arealgrpc.v1 import weight_sync_pb2_grpc as pb_grpc
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from areal_grpc import tensor_codec as tc
from areal_grpc.checksum import crc32c
from areal_grpc.chunks import iter_chunks
from areal_grpc.config import ModelConfig, RolloutConfig
from areal_grpc.model import load_tokenizer
from areal_grpc.server import BackgroundServer, service
from areal_grpc.weight_disk import write_version
from areal_grpc.weight_transfer import PUSH_WEIGHTS_METHOD, encode_push_request
from tests.support.fuzz import DOCUMENTED, Tally, fuzz

MODEL = "builtin:micro"
TIMEOUT = 60.0
PROBE = [5, 17, 42, 99, 7]
CHUNK = 64 * 1024
I32 = st.integers(-(2**31), 2**31 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)


def state_dict_of(engine: HFEngine) -> dict[str, torch.Tensor]:
    """The served weights as a trainer sends them (tied lm_head left out)."""
    return {
        k: v.detach().clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"
    }


@dataclass
class Receiver:
    server: BackgroundServer
    engine: HFEngine
    channel: grpc.Channel
    rollout: rollout_pb2_grpc.RolloutServiceStub
    sync: pb_grpc.WeightSyncServiceStub
    root: Path
    version: int = 0
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    probe: list[int] = field(default_factory=list)

    def greedy(self) -> list[int]:
        reply = self.rollout.Generate(
            rollout_pb2.GenerateRequest(
                input_ids=PROBE,
                sampling=common_pb2.SamplingParams(
                    temperature=0.0, max_new_tokens=4, ignore_eos=True
                ),
            ),
            timeout=TIMEOUT,
        )
        return list(reply.completions[0].output_ids)

    def push(self, messages: list[object]) -> pb.PushWeightsResponse:
        call = self.channel.stream_unary(
            PUSH_WEIGHTS_METHOD,
            request_serializer=encode_push_request,
            response_deserializer=pb.PushWeightsResponse.FromString,
        )
        return call(iter(messages), timeout=TIMEOUT)

    def remember(self) -> None:
        """Records the served state as the one that must survive refused updates."""
        self.version = self.engine.version
        self.weights = state_dict_of(self.engine)
        self.probe = self.greedy()

    def check_intact(self) -> None:
        """Version, weights and behaviour are those of the last accepted update."""
        status = self.rollout.GetRolloutStatus(
            rollout_pb2.GetRolloutStatusRequest(), timeout=TIMEOUT
        )
        assert status.policy_version == self.version
        assert not status.paused
        now = state_dict_of(self.engine)
        assert now.keys() == self.weights.keys()
        assert all(torch.equal(now[k], self.weights[k]) for k in now)
        assert self.greedy() == self.probe

    def check_valid_update(self, delta: float = 1e-3) -> None:
        """A valid stream update still applies: new version, exactly the sent weights."""
        new = {k: v + delta for k, v in self.weights.items()}
        resp = self.push(push_messages(new, self.version + 1))
        assert resp.policy_version == self.version + 1
        now = state_dict_of(self.engine)
        assert all(torch.equal(now[k], new[k]) for k in new)
        self.remember()


def start_receiver(root: Path) -> Receiver:
    engine = HFEngine(ModelConfig(source=MODEL, seed=0), RolloutConfig(device="cpu"))
    rollout = RolloutServicer(engine, load_tokenizer(MODEL), RolloutServiceConfig())
    ws = build_weight_sync_service(
        engine,
        ReceiverConfig(disk_root=str(root), group_timeout_s=5, socket_host="127.0.0.1"),
    )
    server = BackgroundServer(
        [service(rollout, rollout_pb2_grpc.add_RolloutServiceServicer_to_server, rollout_pb2), ws]
    )
    running = server.start()
    channel = grpc.insecure_channel(running.address)
    r = Receiver(
        server,
        engine,
        channel,
        rollout_pb2_grpc.RolloutServiceStub(channel),
        pb_grpc.WeightSyncServiceStub(channel),
        root,
    )
    r.remember()
    return r


def stop_receiver(r: Receiver) -> None:
    r.channel.close()
    r.server.call(r.engine.close())
    r.server.stop()


@pytest.fixture(scope="module")
def receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Receiver]:
    base = tmp_path_factory.mktemp("fuzz_ws")
    root = base / "weights"
    root.mkdir()
    (base / "outside").mkdir()
    r = start_receiver(root)
    make_disk_fixtures(r, base)
    yield r
    stop_receiver(r)


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def push_messages(sd: dict[str, torch.Tensor], version: int, plan_id: str = "") -> list[object]:
    header = pb.PushWeightsRequest(
        header=pb.PushWeightsHeader(
            plan_id=plan_id, policy_version=version, tensor_count=len(sd), total_bytes=nbytes(sd)
        )
    )
    return [header, *iter_chunks(sd, CHUNK)]


def negotiate(r: Receiver, method: int) -> str:
    option = pb.TransferOption(method=method)
    if method == pb.TRANSFER_METHOD_DISTRIBUTED:
        option.distributed.CopyFrom(
            pb.DistributedParams(
                backend=pb.COLLECTIVE_BACKEND_GLOO,
                master_address="127.0.0.1",
                master_port=1,  # never dialled: every announcement below is refused first
                world_size=2,
                rank_offset=1,
                group_name="fuzz",
            )
        )
    resp = r.sync.Negotiate(pb.NegotiateRequest(offers=[option]), timeout=TIMEOUT)
    return resp.plan_id


# -------------------------------------------------------------------------------- Negotiate

methods = st.one_of(
    st.sampled_from([1, 2, 3, 4]),
    st.sampled_from([0, 5, 99]),
    st.integers(5, 2**31 - 1),
    st.integers(-(2**31), -1),
)


def mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """``valid`` three times in four, else ``invalid``."""
    return st.integers(0, 3).flatmap(lambda k: invalid if k == 0 else valid)


@st.composite
def offers(draw: st.DrawFn) -> pb.TransferOption:
    option = pb.TransferOption(method=draw(methods))
    matching = {1: "distributed", 2: "stream", 3: "disk", 4: "socket"}.get(option.method, "none")
    kinds = ["none", "distributed", "stream", "disk", "socket"]
    which = draw(mostly(st.just(matching), st.sampled_from(kinds)))
    if which == "distributed":
        world = draw(mostly(st.integers(2, 8), I32))
        option.distributed.CopyFrom(
            pb.DistributedParams(
                backend=draw(mostly(st.just(1), st.one_of(st.sampled_from([0, 2, 3]), I32))),
                master_address=draw(
                    mostly(
                        st.sampled_from(["127.0.0.1", "::1", "host"]),
                        st.just("") | st.text(max_size=20),
                    )
                ),
                master_port=draw(mostly(st.integers(1, 65535), I32)),
                world_size=world,
                rank_offset=draw(mostly(st.integers(1, max(1, world - 1)), I32)),
                group_name=draw(mostly(st.text(min_size=1, max_size=10), st.just(""))),
                bucket_bytes=draw(mostly(st.integers(0, 2**30), I64)),
                joined=draw(st.booleans()),
            )
        )
    elif which == "stream":
        option.stream.CopyFrom(
            pb.StreamParams(max_chunk_bytes=draw(mostly(st.integers(0, 2**21), I64)))
        )
    elif which == "disk":
        option.disk.CopyFrom(pb.DiskParams(root=draw(st.text(max_size=30))))
    elif which == "socket":
        option.socket.CopyFrom(
            pb.SocketParams(
                host=draw(st.text(max_size=10)),
                port=draw(I32),
                token=draw(st.binary(max_size=40)),
                max_frame_bytes=draw(mostly(st.integers(0, 2**27), I64)),
            )
        )
    return option


@fuzz(40)
@given(
    offered=st.lists(offers(), max_size=4),
    sender=st.text(max_size=20),
)
def test_negotiate_random_offers(receiver: Receiver, tally: Tally, offered, sender) -> None:
    req = pb.NegotiateRequest(offers=offered, sender_id=sender)
    code, resp = tally.call(
        "WeightSync.Negotiate", lambda: receiver.sync.Negotiate(req, timeout=TIMEOUT)
    )
    if code == grpc.StatusCode.OK:
        plan = resp.plan
        assert plan.method in (o.method for o in offered)
        assert resp.plan_id and resp.policy_version == receiver.version
        if plan.method == pb.TRANSFER_METHOD_STREAM:
            assert 0 < plan.stream.max_chunk_bytes <= tc.MiB
        elif plan.method == pb.TRANSFER_METHOD_DISK:
            assert Path(plan.disk.root) == receiver.root.resolve()
        elif plan.method == pb.TRANSFER_METHOD_SOCKET:
            s = plan.socket
            assert 0 < s.port < 65536 and len(s.token) == 32 and s.host == "127.0.0.1"
            assert 0 < s.max_frame_bytes <= 64 << 20
        else:
            assert plan.method == pb.TRANSFER_METHOD_DISTRIBUTED
            d = plan.distributed
            assert d.backend == pb.COLLECTIVE_BACKEND_GLOO and d.master_address
            assert 0 < d.master_port < 65536 and 0 < d.rank_offset < d.world_size
    else:
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
    receiver.check_intact()


# ------------------------------------------------------------------------------ PushWeights

MUTATIONS = [
    "swap",
    "drop",
    "duplicate",
    "crc",
    "flip_byte",
    "truncate",
    "no_header",
    "header_twice",
    "empty_message",
    "dtype_unknown",
    "dtype_other",
    "shape",
    "chunk_count",
    "offset",
    "name",
    "tensor_index",
    "tensor_count",
    "total_bytes",
    "huge_total_bytes",
    "stale_version",
    "bad_version",
    "unknown_plan",
    "disk_plan",
    "oversized_chunk",
    "unknown_tensor",
]


def _chunk_positions(msgs: list[object]) -> list[int]:
    return [i for i, m in enumerate(msgs) if isinstance(m, tensor_pb2.TensorChunk)]


def mutate(r: Receiver, msgs: list[object], op: str, data: st.DataObject) -> list[object]:
    """``msgs`` (header first, then chunks) broken by ``op``; always malformed afterwards."""
    msgs = list(msgs)
    chunks = _chunk_positions(msgs)
    header = next(
        (m for m in msgs if isinstance(m, pb.PushWeightsRequest) and m.HasField("header")), None
    )

    def pick() -> int:
        return data.draw(st.sampled_from(chunks), label=f"{op} at")

    def edit(i: int) -> tensor_pb2.TensorChunk:
        c = tensor_pb2.TensorChunk()
        c.CopyFrom(msgs[i])  # type: ignore[arg-type]
        msgs[i] = c
        return c

    def edit_header() -> pb.PushWeightsHeader:
        i = msgs.index(header)
        h = pb.PushWeightsRequest()
        h.CopyFrom(header)  # type: ignore[arg-type]
        msgs[i] = h
        return h.header

    if not chunks or header is None:
        return msgs[: max(0, len(msgs) - 1)]
    if op == "swap" and len(chunks) > 1:
        i, j = data.draw(st.lists(st.sampled_from(chunks), min_size=2, max_size=2, unique=True))
        msgs[i], msgs[j] = msgs[j], msgs[i]
    elif op == "drop":
        del msgs[pick()]
    elif op == "duplicate":
        i = pick()
        msgs.insert(i + data.draw(st.integers(1, 3)), msgs[i])
    elif op == "crc":
        c = edit(pick())
        c.crc32c ^= data.draw(st.integers(1, 2**32 - 1))
    elif op == "flip_byte":
        c = edit(pick())
        k = data.draw(st.integers(0, len(c.data) - 1))
        c.data = c.data[:k] + bytes([c.data[k] ^ data.draw(st.integers(1, 255))]) + c.data[k + 1 :]
    elif op == "truncate":
        msgs = msgs[: data.draw(st.integers(0, len(msgs) - 1))]
    elif op == "no_header":
        msgs.remove(header)
    elif op == "header_twice":
        msgs.insert(data.draw(st.integers(1, len(msgs))), header)
    elif op == "empty_message":
        msgs.insert(data.draw(st.integers(1, len(msgs))), pb.PushWeightsRequest())
    elif op == "dtype_unknown":
        c = edit(pick())
        c.dtype = data.draw(st.integers(9, 2**31 - 1) | st.just(0))
        if c.chunk_index != 0 and c.dtype == 0:
            c.dtype = 99
    elif op == "dtype_other":
        c = edit(pick())
        # On chunk 0 a dtype of another item size (a same-size dtype would be a valid, cast
        # update); on a later chunk any dtype other than chunk 0's.
        choices = [2, 3, 4, 6, 7, 8] if c.chunk_index == 0 else [2, 3, 4, 5, 6, 7, 8]
        c.dtype = data.draw(st.sampled_from(choices))
    elif op == "shape":
        c = edit(data.draw(st.sampled_from([i for i in chunks if msgs[i].chunk_index == 0])))
        shape = list(c.shape)
        choice = data.draw(st.sampled_from(["grow", "extra_dim", "negative", "transpose", "huge"]))
        if choice == "grow" or (choice == "transpose" and len(set(shape)) < 2):
            shape[0] += data.draw(st.integers(1, 5))
        elif choice == "extra_dim":
            shape.append(data.draw(st.integers(2, 4)))
        elif choice == "negative":
            shape[0] = -shape[0] or -1
        elif choice == "transpose":
            shape = shape[::-1]
        else:
            shape = [2**40] * data.draw(st.integers(1, 3))
        del c.shape[:]
        c.shape.extend(shape)
    elif op == "chunk_count":
        c = edit(pick())
        c.chunk_count = data.draw(
            st.sampled_from([0, c.chunk_count + 1, 2**32 - 1, max(0, c.chunk_count - 1)])
        )
    elif op == "offset":
        c = edit(pick())
        c.offset = data.draw(st.integers(0, 2**64 - 1).filter(lambda o: o != c.offset))
    elif op == "name":
        c = edit(pick())
        names = {m.name for m in msgs if isinstance(m, tensor_pb2.TensorChunk)}
        c.name = data.draw(
            st.sampled_from(["", *sorted(names - {c.name})])
            | st.text(max_size=8).filter(lambda s: s != c.name)
        )
    elif op == "tensor_index":
        c = edit(pick())
        c.tensor_index = data.draw(st.integers(0, 2**32 - 1).filter(lambda t: t != c.tensor_index))
    elif op == "tensor_count":
        h = edit_header()
        h.tensor_count = data.draw(
            st.integers(0, 2**32 - 1).filter(lambda n: n != header.header.tensor_count)
        )
    elif op == "total_bytes":
        h = edit_header()
        h.total_bytes = data.draw(
            st.integers(0, 2**64 - 1).filter(lambda n: n != header.header.total_bytes)
        )
    elif op == "huge_total_bytes":
        h = edit_header()
        h.total_bytes = data.draw(st.integers(2**40, 2**64 - 1))
    elif op == "stale_version":
        h = edit_header()
        h.policy_version = data.draw(st.integers(1, max(1, r.version)))
        if r.version == 0:
            h.policy_version = 0
    elif op == "bad_version":
        h = edit_header()
        h.policy_version = data.draw(st.integers(-(2**63), 0))
    elif op == "unknown_plan":
        h = edit_header()
        h.plan_id = data.draw(st.text(min_size=1, max_size=32))
    elif op == "disk_plan":
        h = edit_header()
        h.plan_id = negotiate(r, pb.TRANSFER_METHOD_DISK)
    elif op == "oversized_chunk":
        c = edit(pick())
        c.data = c.data + b"\0" * (tc.MiB + 1 - len(c.data))
        c.crc32c = crc32c(c.data)
    elif op == "unknown_tensor":
        last = max(m.tensor_index for m in msgs if isinstance(m, tensor_pb2.TensorChunk))
        extra = next(iter_chunks({"model.no_such_tensor.weight": torch.zeros(3)}, CHUNK))
        extra.tensor_index = last + 1
        msgs.append(extra)
        h = edit_header()
        h.tensor_count += 1
        h.total_bytes += 12
    else:  # swap of a one-chunk stream
        msgs = msgs[:-1]
    return msgs


@fuzz(40)
@given(
    ops=st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=3, unique=True), data=st.data()
)
def test_push_weights_corrupted_streams(receiver: Receiver, tally: Tally, ops, data) -> None:
    new = {k: v + 0.5 for k, v in receiver.weights.items()}
    msgs = push_messages(new, receiver.version + 1)
    for op in ops:
        msgs = mutate(receiver, msgs, op, data)
    code, _ = tally.call("WeightSync.PushWeights", lambda: receiver.push(msgs))
    # Every mutation breaks the stream: nothing may be applied.
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), (
        ops,
        code,
    )
    receiver.check_intact()
    if tally.sent["WeightSync.PushWeights"] % 10 == 0:
        receiver.check_valid_update()


# A chunk's wire bytes, then damaged: the fast chunk decoder must agree with protobuf's parser.
@fuzz(40)
@given(
    cut=st.integers(0, 200),
    flips=st.lists(st.tuples(st.integers(0, 199), st.integers(1, 255)), max_size=3),
    tail=st.binary(max_size=16),
)
def test_push_weights_damaged_wire_bytes(
    receiver: Receiver, tally: Tally, cut, flips, tail
) -> None:
    sd = {"model.norm.weight": receiver.weights["model.norm.weight"]}
    chunk = next(iter_chunks(sd, CHUNK))
    raw = bytearray(encode_push_request(pb.PushWeightsRequest(chunk=chunk)))
    raw = raw[: len(raw) - cut % len(raw)] if cut else raw
    for pos, x in flips:
        if raw:
            raw[pos % len(raw)] ^= x
    raw = bytes(raw) + tail
    header = pb.PushWeightsRequest(
        header=pb.PushWeightsHeader(
            policy_version=receiver.version + 1, tensor_count=1, total_bytes=nbytes(sd)
        )
    )
    try:
        pb.PushWeightsRequest.FromString(raw)
        parses = True
    except Exception:
        parses = False
    call = receiver.channel.stream_unary(PUSH_WEIGHTS_METHOD, request_serializer=lambda b: b)
    # Bytes that do not parse at all are INVALID_ARGUMENT too (never UNKNOWN).
    code, err = tally.call(
        "WeightSync.PushWeights(raw bytes)",
        lambda: call(iter([header.SerializeToString(), raw]), timeout=TIMEOUT),
    )
    if not parses:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, err
    # One tensor of a 26-tensor model: never a valid update.
    assert code != grpc.StatusCode.OK
    receiver.check_intact()


# --------------------------------------------------------------------------- UpdateFromDisk


def make_disk_fixtures(r: Receiver, base: Path) -> None:
    """Hostile directories under (and around) the receiver's root."""
    root = r.root
    outside = base / "outside"
    # A real version directory outside the root, reachable through a symlink inside it.
    write_version(outside, 999, [state_dict_of(r.engine)], 1)
    os.symlink(outside, root / "link_out")
    (root / "empty_dir").mkdir()
    (root / "a_file").write_text("not a directory")
    garbage = root / "garbage"
    garbage.mkdir()
    (garbage / "model.safetensors").write_bytes(b"\x00\x01not safetensors" * 10)
    bad_index = root / "bad_index"
    bad_index.mkdir()
    (bad_index / "model.safetensors.index.json").write_text('{"weight_map": 3')
    escape_index = root / "escape_index"
    escape_index.mkdir()
    (escape_index / "model.safetensors.index.json").write_text(
        '{"weight_map": {"w": "../../outside/v999/model.safetensors"}}'
    )
    wrong_names = root / "wrong_names"
    wrong_names.mkdir()
    save_file({"no.such.tensor": torch.zeros(4)}, str(wrong_names / "model.safetensors"))
    wrong_shapes = root / "wrong_shapes"
    wrong_shapes.mkdir()
    save_file(
        {k: torch.zeros(3) for k in state_dict_of(r.engine)},
        str(wrong_shapes / "model.safetensors"),
    )
    partial = root / "partial"
    partial.mkdir()
    sd = state_dict_of(r.engine)
    save_file({k: sd[k] for k in list(sd)[:3]}, str(partial / "model.safetensors"))


HOSTILE_PATHS = [
    "",
    ".",
    "..",
    "../outside",
    "../outside/v999",
    "link_out",
    "link_out/v999",
    "/",
    "/etc",
    "/tmp",
    "empty_dir",
    "a_file",
    "garbage",
    "bad_index",
    "escape_index",
    "wrong_names",
    "wrong_shapes",
    "partial",
    "no_such_dir",
    "nul\x00byte",
    "empty_dir/../../outside",
    "./empty_dir/./",
    "//",
    "~",
]


@fuzz(40)
@given(
    path=st.one_of(st.sampled_from(HOSTILE_PATHS), st.text(max_size=40)),
    absolute=st.booleans(),
    version=st.one_of(st.integers(-3, 3), I64),
    plan=st.sampled_from(["", "unknown", "stream", "disk"]),
)
def test_update_from_disk_hostile_paths(
    receiver: Receiver, tally: Tally, path, absolute, version, plan
) -> None:
    if absolute and path and not path.startswith("/"):
        path = str(receiver.root / path)
    plan_id = {
        "": "",
        "unknown": "no-such-plan",
        "stream": negotiate(receiver, pb.TRANSFER_METHOD_STREAM),
        "disk": negotiate(receiver, pb.TRANSFER_METHOD_DISK),
    }[plan]
    req = pb.UpdateFromDiskRequest(plan_id=plan_id, policy_version=version, path=path)
    code, _ = tally.call(
        "WeightSync.UpdateFromDisk", lambda: receiver.sync.UpdateFromDisk(req, timeout=TIMEOUT)
    )
    # Nothing under the root is a complete, valid version directory.
    assert code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
    ), (path, version, plan, code)
    receiver.check_intact()


def test_update_from_disk_valid_after_refusals(receiver: Receiver, tally: Tally) -> None:
    """After all the refusals, a valid version directory under the root still loads."""
    new = {k: v - 1e-3 for k, v in receiver.weights.items()}
    path = write_version(receiver.root, receiver.version + 1, [new], 1)
    tally.note("WeightSync.UpdateFromDisk(valid)", "OK")
    resp = receiver.sync.UpdateFromDisk(
        pb.UpdateFromDiskRequest(
            plan_id=negotiate(receiver, pb.TRANSFER_METHOD_DISK),
            policy_version=receiver.version + 1,
            path=path.name,
        ),
        timeout=TIMEOUT,
    )
    assert resp.policy_version == receiver.version + 1
    now = state_dict_of(receiver.engine)
    assert all(torch.equal(now[k], new[k]) for k in new)
    receiver.remember()
    receiver.check_intact()


# -------------------------------------------------------------------- UpdateFromDistributed

DTYPES = st.one_of(st.integers(1, 8), st.integers(9, 2**31 - 1), st.just(0))


@st.composite
def distributed_requests(
    draw: st.DrawFn, dist_plan: str, other_plans: list[str]
) -> pb.UpdateFromDistributedRequest:
    """Announcements that must be refused before the receiver joins any group."""
    specs = draw(
        st.lists(
            st.builds(
                lambda name, dtype, shape: tensor_pb2.TensorSpec(
                    name=name, dtype=dtype, shape=shape
                ),
                st.sampled_from(["a", "b", ""]) | st.text(max_size=6),
                DTYPES,
                st.lists(st.one_of(st.integers(0, 8), st.integers(-(2**40), 2**40)), max_size=3),
            ),
            max_size=4,
        )
    )
    req = pb.UpdateFromDistributedRequest(
        plan_id=draw(st.sampled_from(["", "no-such-plan", dist_plan, *other_plans])),
        policy_version=draw(st.one_of(st.integers(-3, 3), I64)),
        tensors=specs,
        bucket_bytes=draw(st.one_of(st.integers(0, 2**20), I64)),
    )
    if req.plan_id == dist_plan:
        # The plan is real: make sure something else is wrong, so no rendezvous is tried.
        flaw = draw(
            st.sampled_from(["no_tensors", "dup", "neg_dim", "dtype", "version", "bucket", "huge"])
        )
        if flaw == "no_tensors":
            del req.tensors[:]
        elif flaw == "dup":
            req.tensors.extend([tensor_pb2.TensorSpec(name="d", dtype=1)] * 2)
        elif flaw == "neg_dim":
            req.tensors.append(tensor_pb2.TensorSpec(name="neg", dtype=1, shape=[2, -1]))
        elif flaw == "dtype":
            req.tensors.append(
                tensor_pb2.TensorSpec(name="dt", dtype=draw(st.integers(9, 2**31 - 1) | st.just(0)))
            )
        elif flaw == "version":
            req.policy_version = draw(st.integers(-(2**63), 0))
        elif flaw == "bucket":
            req.bucket_bytes = draw(st.integers(-(2**63), -1))
        else:
            req.tensors.append(tensor_pb2.TensorSpec(name="huge", dtype=1, shape=[2**40, 2**20]))
    return req


@fuzz(40)
@given(data=st.data())
def test_update_from_distributed_refused_before_rendezvous(
    receiver: Receiver, tally: Tally, data
) -> None:
    dist_plan = negotiate(receiver, pb.TRANSFER_METHOD_DISTRIBUTED)
    others = [negotiate(receiver, pb.TRANSFER_METHOD_STREAM)]
    req = data.draw(distributed_requests(dist_plan, others))
    if req.plan_id == dist_plan:
        allowed = {grpc.StatusCode.INVALID_ARGUMENT}
    else:
        allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
    code, _ = tally.call(
        "WeightSync.UpdateFromDistributed",
        lambda: receiver.sync.UpdateFromDistributed(req, timeout=TIMEOUT),
        allowed=allowed,
    )
    assert code != grpc.StatusCode.OK
    receiver.check_intact()


def test_valid_stream_update_after_fuzzing(receiver: Receiver, tally: Tally) -> None:
    tally.note("WeightSync.PushWeights(valid)", "OK")
    receiver.check_valid_update(delta=-2e-3)
    receiver.check_intact()


# ------------------------------------------- regressions: crashes this fuzzing found (fixed)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_weights_do_not_kill_the_server(tmp_path: Path, bad: float) -> None:
    """Weights holding NaN/inf (pushed with correct CRCs) used to make the next sampled
    Generate kill the decode thread; whether refused or served, the server must go on."""
    root = tmp_path / "w"
    root.mkdir()
    r = start_receiver(root)
    try:
        sd = state_dict_of(r.engine)
        sd["model.norm.weight"][0] = bad
        try:
            r.push(push_messages(sd, 1))
        except grpc.RpcError as err:
            assert err.code() in DOCUMENTED
        req = rollout_pb2.GenerateRequest(
            input_ids=PROBE, sampling=common_pb2.SamplingParams(max_new_tokens=2)
        )
        for _ in range(2):
            try:
                r.rollout.Generate(req, timeout=3)
            except grpc.RpcError as err:
                assert err.code() in DOCUMENTED, err
        r.rollout.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=3)
    finally:
        stop_receiver(r)


def test_undecodable_bytes_are_invalid_argument(receiver: Receiver) -> None:
    """Bytes that are not the request message get INVALID_ARGUMENT naming its type."""
    negotiate = receiver.channel.unary_unary(
        "/arealgrpc.v1.WeightSyncService/Negotiate", request_serializer=lambda b: b
    )
    push = receiver.channel.stream_unary(PUSH_WEIGHTS_METHOD, request_serializer=lambda b: b)
    calls = {
        "arealgrpc.v1.NegotiateRequest": lambda: negotiate(b"\xff", timeout=TIMEOUT),
        "arealgrpc.v1.PushWeightsRequest": lambda: push(iter([b"\xff"]), timeout=TIMEOUT),
    }
    for type_name, send in calls.items():
        with pytest.raises(grpc.RpcError) as info:
            send()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, type_name
        assert f"not a valid {type_name}" in info.value.details()
    receiver.check_intact()
