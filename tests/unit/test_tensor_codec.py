"""Tensor codec: round trips, bit-exactness, validation of every malformed input, wire format."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import google_crc32c
import pytest
import torch
from arealgrpc.v1 import tensor_pb2, weight_sync_pb2
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_grpc import tensor_codec as tc
from areal_grpc.checksum import crc32c
from areal_grpc.chunk_wire import decode_chunk, encode_chunk
from areal_grpc.chunks import ChunkView, StateDictAssembler, assemble, iter_chunk_views, iter_chunks
from areal_grpc.errors import FieldError
from areal_grpc.host_memory import empty_buffer

DTYPES = list(tc.SUPPORTED_DTYPES)
SHAPES = [(), (0,), (0, 3), (3, 0, 2), (1,), (7,), (3, 4, 5)]
# Modest by default (shared 2-core CI); raise CODEC_EXAMPLES by hand for a deeper search.
FAST = settings(
    max_examples=int(os.environ.get("CODEC_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def raw(t: torch.Tensor) -> bytes:
    """The tensor's bytes in C order: equal iff bit-identical (NaN payloads, -0.0 included)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)


def make(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g).to(dtype)
        flat = t.reshape(-1)
        if flat.numel() >= 3:  # specials must survive too
            flat[0], flat[1], flat[2] = float("nan"), -0.0, float("-inf")
        return t
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


def chunked_round_trip(sd: dict[str, torch.Tensor], max_chunk_bytes: int) -> dict:
    """Through the wire bytes, as a gRPC stream would carry them."""
    wires = [encode_chunk(c) for c in iter_chunk_views(sd, max_chunk_bytes)]
    return assemble((decode_chunk(w) for w in wires), expected_tensors=len(sd))


# --- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_every_dtype_and_shape(dtype, shape):
    t = make(dtype, shape)
    proto = tc.tensor_to_proto(t)
    assert proto.dtype == tc.dtype_to_proto(dtype) and list(proto.shape) == list(shape)
    assert len(proto.data) == t.numel() * t.element_size()
    # Decoding the serialized message, as a receiver would.
    back = tc.tensor_from_proto(tensor_pb2.TensorProto.FromString(proto.SerializeToString()))
    assert same(back, t)
    # The same tensor as a chunk stream, 5-byte chunks so most tensors span several.
    assert same(assemble(iter_chunks({"w": t}, max_chunk_bytes=5))["w"], t)
    assert same(chunked_round_trip({"w": t}, 5)["w"], t)


def test_non_contiguous_and_expanded_inputs_round_trip():
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    cases = {
        "transposed": base.transpose(0, 2),
        "strided": base[:, ::2, 1:],
        "expanded": torch.tensor([1, 2, 3], dtype=torch.int64).expand(4, 3),
        "bf16_t": base.to(torch.bfloat16)[1].t(),
    }
    for name, t in cases.items():
        assert not t.is_contiguous(), name
        expected = t.contiguous()
        assert same(tc.tensor_from_proto(tc.tensor_to_proto(t)), expected), name
    out = chunked_round_trip(cases, max_chunk_bytes=7)
    for name, t in cases.items():
        assert same(out[name], t.contiguous()), name


def test_multi_chunk_layout_follows_the_contract():
    sd = {
        "a": make(torch.float32, (1000,)),
        "b": make(torch.int8, (0,)),
        "c": make(torch.bool, (9,)),
    }
    chunks = list(iter_chunks(sd, max_chunk_bytes=1024))
    by_tensor: dict[int, list[tensor_pb2.TensorChunk]] = {}
    for c in chunks:
        assert len(c.data) <= 1024
        assert c.crc32c == (google_crc32c.value(c.data) if c.data else 0)
        by_tensor.setdefault(c.tensor_index, []).append(c)
    assert sorted(by_tensor) == [0, 1, 2]
    a = by_tensor[0]
    assert [c.chunk_index for c in a] == [0, 1, 2, 3] and {c.chunk_count for c in a} == {4}
    assert [c.offset for c in a] == [0, 1024, 2048, 3072]
    assert a[0].dtype == tensor_pb2.DTYPE_FLOAT32 and list(a[0].shape) == [1000]
    assert b"".join(c.data for c in a) == raw(sd["a"])
    # An empty tensor is one chunk with no data.
    assert len(by_tensor[1]) == 1 and by_tensor[1][0].chunk_count == 1
    assert by_tensor[1][0].data == b""


def test_default_chunks_are_at_most_one_mib():
    t = make(torch.float32, (600_000,))  # 2.4 MB -> 3 chunks
    chunks = list(iter_chunk_views({"w": t}))
    assert [len(c.data) for c in chunks] == [1 << 20, 1 << 20, 600_000 * 4 - 2 * (1 << 20)]


def test_decoding_a_bytearray_is_zero_copy_and_outputs_are_cpu():
    t = make(torch.bfloat16, (4, 8))
    buf = bytearray(raw(t))
    out = tc.tensor_from_bytes(buf, tensor_pb2.DTYPE_BFLOAT16, [4, 8], name="w")
    assert same(out, t) and out.device.type == "cpu"
    buf[0] ^= 0xFF  # the tensor is a view of the buffer we handed over
    assert raw(out)[0] == buf[0]
    # Assembled tensors own writable memory (no read-only views of received bytes).
    got = chunked_round_trip({"w": t}, 16)["w"]
    got.add_(1)


def test_empty_buffer_is_a_writable_flat_byte_tensor():
    for n in (0, 5, 8 << 20):  # the big one is advised onto huge pages
        buf = empty_buffer(n)
        assert buf.dtype == torch.uint8 and buf.shape == (n,) and buf.is_contiguous()
        buf.fill_(7)
        assert n == 0 or int(buf[-1]) == 7


def test_spec_and_dtype_helpers():
    t = torch.zeros(2, 3, dtype=torch.int32)
    assert tc.tensor_spec("x", t) == tensor_pb2.TensorSpec(
        name="x", dtype=tensor_pb2.DTYPE_INT32, shape=[2, 3]
    )
    for d in DTYPES:
        assert tc.dtype_from_proto(tc.dtype_to_proto(d)) == d
    with pytest.raises(ValueError):
        tc.dtype_to_proto(torch.complex64)
    with pytest.raises(FieldError) as e:
        tc.dtype_from_proto(tensor_pb2.DTYPE_UNSPECIFIED, 'tensor["x"].dtype')
    assert e.value.field == 'tensor["x"].dtype'


def test_crc_helpers_match_google_crc32c():
    data = bytes(random.Random(1).randbytes(5000))
    want = google_crc32c.value(data)
    assert crc32c(data) == want
    assert crc32c(bytearray(data)) == want
    assert crc32c(memoryview(data)[10:]) == google_crc32c.value(data[10:])
    assert crc32c(b"") == 0
    # In pieces, each extending the CRC of the ones before (as the side channel checks a
    # frame while it arrives), it is the CRC of the whole.
    crc = 0
    for start in range(0, len(data), 777):
        crc = crc32c(memoryview(data)[start : start + 777], crc)
    assert crc == want
    # Tensor memory as it is (what the chunk streams and the side channel checksum).
    t = torch.arange(1000, dtype=torch.float32)
    assert crc32c(memoryview(t.numpy()).cast("B")) == google_crc32c.value(t.numpy().tobytes())


# --- TensorProto validation ---------------------------------------------------------------


def proto(dtype=tensor_pb2.DTYPE_FLOAT32, shape=(2, 3), nbytes=24):
    return tensor_pb2.TensorProto(dtype=dtype, shape=list(shape), data=bytes(nbytes))


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (proto(dtype=tensor_pb2.DTYPE_UNSPECIFIED), 'tensor["w"].dtype'),
        (proto(dtype=99), 'tensor["w"].dtype'),
        (proto(nbytes=23), 'tensor["w"].data'),
        (proto(nbytes=28), 'tensor["w"].data'),
        (proto(shape=(2, -3)), 'tensor["w"].shape[1]'),
        (proto(shape=(1 << 40, 1 << 40)), 'tensor["w"].shape'),
        (proto(shape=(), nbytes=0), 'tensor["w"].data'),
        (proto(dtype=tensor_pb2.DTYPE_BOOL, shape=(3,), nbytes=0), 'tensor["w"].data'),
        (
            tensor_pb2.TensorProto(dtype=tensor_pb2.DTYPE_BOOL, shape=[3], data=b"\x00\x01\x02"),
            'tensor["w"].data',
        ),
    ],
)
def test_malformed_tensor_proto_names_the_field(msg, field):
    with pytest.raises(FieldError) as e:
        tc.tensor_from_proto(msg, name="w")
    assert e.value.field == field


def test_tensor_proto_size_cap_is_configurable():
    msg = proto(shape=(1000,), nbytes=4000)
    assert tc.tensor_from_proto(msg, name="w", max_bytes=4000).shape == (1000,)
    with pytest.raises(FieldError) as e:
        tc.tensor_from_proto(msg, name="w", max_bytes=3999)
    assert e.value.field == 'tensor["w"].shape'


# --- chunk stream validation ------------------------------------------------------------------


def stream() -> list[tensor_pb2.TensorChunk]:
    """Tensor "a" in 4 chunks of 8 bytes, then "b" in 1 chunk."""
    sd = {"a": make(torch.float32, (8,)), "b": make(torch.int32, (2,))}
    return list(iter_chunks(sd, max_chunk_bytes=8))


def fail(chunks, **kw) -> FieldError:
    with pytest.raises(FieldError) as e:
        assemble(chunks, **kw)
    return e.value


def edit(c: tensor_pb2.TensorChunk, **fields) -> tensor_pb2.TensorChunk:
    c = tensor_pb2.TensorChunk.FromString(c.SerializeToString())
    for k, v in fields.items():
        if k == "shape":
            del c.shape[:]
            c.shape.extend(v)
        else:
            setattr(c, k, v)
    return c


def test_stream_validation_names_tensor_and_field():
    s = stream()
    assert [(c.name, c.chunk_index) for c in s] == [
        ("a", 0),
        ("a", 1),
        ("a", 2),
        ("a", 3),
        ("b", 0),
    ]
    cases = {
        "missing chunk": ([*s[:2], *s[3:]], 'tensor["a"].chunk[2]'),
        "duplicate chunk": ([*s[:2], s[1], *s[2:]], 'tensor["a"].chunk[1].chunk_index'),
        "swapped chunks": ([s[0], s[2], s[1], *s[3:]], 'tensor["a"].chunk[1]'),
        "missing chunk 0": (s[1:], 'tensor["a"].chunk[0]'),
        "missing tensor": ([s[4]], 'tensor["b"].tensor_index'),
        "tensor_index out of order": (
            [*s[:4], edit(s[4], tensor_index=0)],
            'tensor["b"].tensor_index',
        ),
        "ends mid-tensor": (s[:3], 'tensor["a"].chunk[3]'),
        "chunk_count mismatch": (
            [s[0], edit(s[1], chunk_count=5), *s[2:]],
            'tensor["a"].chunk[1].chunk_count',
        ),
        "chunk_count too small": (
            [*(edit(c, chunk_count=2) for c in s[:4]), s[4]],
            'tensor["a"].chunk[1].data',
        ),
        "chunk_count zero": ([edit(s[0], chunk_count=0)], 'tensor["a"].chunk_count'),
        "offset mismatch": ([s[0], edit(s[1], offset=9), *s[2:]], 'tensor["a"].chunk[1].offset'),
        "checksum mismatch": (
            [s[0], s[1], edit(s[2], crc32c=s[2].crc32c ^ 1), s[3], s[4]],
            'tensor["a"].chunk[2].crc32c',
        ),
        "data flipped": (
            [s[0], edit(s[1], data=bytes([s[1].data[0] ^ 4]) + s[1].data[1:]), *s[2:]],
            'tensor["a"].chunk[1].crc32c',
        ),
        "data too long": ([s[0], s[1], s[2], edit(s[3], data=s[3].data + b"x")], None),
        "unknown dtype": ([edit(s[0], dtype=42), *s[1:]], 'tensor["a"].dtype'),
        "unspecified dtype": ([edit(s[0], dtype=0), *s[1:]], 'tensor["a"].dtype'),
        "later dtype contradicts": (
            [s[0], edit(s[1], dtype=tensor_pb2.DTYPE_INT32), *s[2:]],
            'tensor["a"].chunk[1].dtype',
        ),
        "later shape contradicts": (
            [s[0], edit(s[1], shape=[4, 2]), *s[2:]],
            'tensor["a"].chunk[1].shape',
        ),
        "later name contradicts": ([s[0], edit(s[1], name="z"), *s[2:]], 'tensor["a"].chunk[1]'),
        "negative dim": ([edit(s[0], shape=[-8]), *s[1:]], 'tensor["a"].shape[0]'),
        "shape too big for the data": (
            [edit(s[0], shape=[9]), *s[1:]],
            'tensor["a"].chunk[3].data',
        ),
        "absurd shape": ([edit(s[0], shape=[1 << 62, 1 << 62]), *s[1:]], 'tensor["a"].shape'),
        "duplicate name": ([*s[:4], edit(s[4], name="a")], 'tensor["a"].name'),
        "empty name": ([edit(c, name="") for c in s[:4]], 'tensor[""].name'),
    }
    for what, (chunks, field) in cases.items():
        err = fail(chunks)
        if field is None:
            assert err.field.startswith('tensor["a"].chunk[3]'), (what, err)
        else:
            assert err.field == field, (what, err.field, str(err))


def test_expected_tensors_and_total_byte_cap():
    s = stream()
    assert set(assemble(s, expected_tensors=2)) == {"a", "b"}
    assert fail(s[:4], expected_tensors=2).field == "tensors"
    assert fail(s, expected_tensors=1).field == 'tensor["b"].tensor_index'
    assert set(assemble(s, max_total_bytes=40)) == {"a", "b"}
    assert fail(s, max_total_bytes=39).field == 'tensor["b"].shape'


def test_bool_stream_rejects_non_boolean_bytes():
    data = b"\x00\x01\x05"
    chunk = tensor_pb2.TensorChunk(
        name="m",
        chunk_count=1,
        dtype=tensor_pb2.DTYPE_BOOL,
        shape=[3],
        data=data,
        crc32c=google_crc32c.value(data),
    )
    assert fail([chunk]).field == 'tensor["m"].data'


def test_assembler_is_spent_after_an_error():
    s = stream()
    asm = StateDictAssembler()
    asm.add(s[0])
    with pytest.raises(FieldError):
        asm.add(s[2])
    with pytest.raises(FieldError):  # a later good chunk does not resurrect the stream
        asm.add(s[1])
    with pytest.raises(FieldError):
        asm.finish()


# --- property tests ---------------------------------------------------------------------------


@st.composite
def tensors(draw, max_numel: int = 40) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    numel = 1
    for d in shape:
        numel *= d
    if numel > max_numel:
        shape = (max_numel,)
        numel = max_numel
    if dtype == torch.bool:
        data = bytes(draw(st.lists(st.integers(0, 1), min_size=numel, max_size=numel)))
    else:
        # Arbitrary bit patterns: NaN payloads, -0.0, subnormals, infinities.
        n = numel * dtype.itemsize
        data = draw(st.binary(min_size=n, max_size=n))
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


@st.composite
def state_dicts(draw) -> dict[str, torch.Tensor]:
    names = draw(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=4, unique=True))
    return {n: draw(tensors()) for n in names}


@FAST
@given(t=tensors(), chunk=st.integers(1, 64))
def test_property_decode_encode_is_bit_identical(t, chunk):
    assert same(tc.tensor_from_proto(tc.tensor_to_proto(t)), t)
    assert same(chunked_round_trip({"x": t}, chunk)["x"], t)


CORRUPTIONS = ["data", "shape", "dtype", "swap", "drop", "duplicate", "crc", "truncate"]


def corrupt(
    rnd: random.Random, how: str, chunks: list[tensor_pb2.TensorChunk], sd: dict
) -> list[tensor_pb2.TensorChunk] | None:
    """``chunks`` with one corruption of kind ``how``; None when it cannot apply here."""
    c = list(chunks)
    firsts = [i for i, x in enumerate(c) if x.chunk_index == 0]
    if how == "data":
        idx = [i for i, x in enumerate(c) if x.data]
        if not idx:
            return None
        i = rnd.choice(idx)
        data = bytearray(c[i].data)
        data[rnd.randrange(len(data))] ^= 1 << rnd.randrange(8)
        c[i] = edit(c[i], data=bytes(data))
    elif how == "shape":
        i = rnd.choice(firsts)
        old = sd[c[i].name]
        new = [rnd.randint(-3, 9) for _ in range(rnd.randint(0, 3))]
        numel = 1
        for d in new:
            numel *= d
        if all(d >= 0 for d in new) and numel == old.numel():
            return None  # same byte size: the contract cannot tell (crc covers data only)
        c[i] = edit(c[i], shape=new)
    elif how == "dtype":
        i = rnd.choice(firsts)
        old = sd[c[i].name]
        new = rnd.choice([0, 9, 1000, *range(1, 9)])
        if new in range(1, 9) and (
            old.numel() == 0 or tc._FROM_PROTO[new].itemsize == old.element_size()
        ):
            return None  # same byte size: undetectable by the contract
        c[i] = edit(c[i], dtype=new)
    elif how == "swap":
        if len(c) < 2:
            return None
        i, j = rnd.sample(range(len(c)), 2)
        c[i], c[j] = c[j], c[i]
    elif how == "drop":
        del c[rnd.randrange(len(c))]
    elif how == "duplicate":
        i = rnd.randrange(len(c))
        c.insert(rnd.randint(i + 1, len(c)), c[i])
    elif how == "crc":
        i = rnd.randrange(len(c))
        c[i] = edit(c[i], crc32c=c[i].crc32c ^ (1 << rnd.randrange(32)))
    elif how == "truncate":
        c = c[: rnd.randrange(len(c))]
    return c


@FAST
@given(
    sd=state_dicts(),
    chunk=st.integers(1, 32),
    how=st.sampled_from(CORRUPTIONS),
    seed=st.integers(0, 2**32),
)
def test_property_corruption_is_a_field_error(sd, chunk, how, seed):
    chunks = list(iter_chunks(sd, chunk))
    bad = corrupt(random.Random(seed), how, chunks, sd)
    if bad is None:
        return
    with pytest.raises(FieldError) as e:
        assemble(bad, expected_tensors=len(sd))
    field = e.value.field
    labels = [tc.tensor_label(n) for n in sd]
    assert field == "tensors" or any(field.startswith(lb) for lb in labels), (how, field)


# --- wire format ------------------------------------------------------------------------------


@st.composite
def chunk_fields(draw) -> dict:
    u32 = st.integers(0, 2**32 - 1)
    return {
        "name": draw(st.text(max_size=8)),
        "tensor_index": draw(u32),
        "chunk_index": draw(u32),
        "chunk_count": draw(u32),
        "dtype": draw(st.sampled_from([0, 1, 3, 8, 77])),
        "shape": draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4)),
        "offset": draw(st.integers(0, 2**64 - 1)),
        "data": draw(st.binary(max_size=64)),
        "crc32c": draw(u32),
    }


chunk_fields_keys = [
    "name",
    "tensor_index",
    "chunk_index",
    "chunk_count",
    "dtype",
    "shape",
    "offset",
    "data",
    "crc32c",
]


def fields_of(c) -> dict:
    """The nine TensorChunk fields as plain values, for a message or a ChunkView alike."""
    return {
        k: (list(v) if k == "shape" else bytes(v) if k == "data" else v)
        for k, v in ((k, getattr(c, k)) for k in chunk_fields_keys)
    }


@FAST
@given(f=chunk_fields())
def test_property_hand_built_wire_bytes_are_a_valid_tensor_chunk(f):
    view = ChunkView(**f)
    wire = encode_chunk(view)
    parsed = tensor_pb2.TensorChunk.FromString(wire)
    assert fields_of(parsed) == f
    assert wire == parsed.SerializeToString()  # even the canonical field order
    assert fields_of(decode_chunk(parsed.SerializeToString())) == f
    # Wrapped in PushWeightsRequest.chunk (field 2), as the WeightSync stream sends it.
    outer = weight_sync_pb2.PushWeightsRequest.FromString(encode_chunk(view, wrap_field=2))
    assert outer.WhichOneof("kind") == "chunk" and fields_of(outer.chunk) == f
    assert fields_of(decode_chunk(outer.SerializeToString(), wrap_field=2)) == f


@FAST
@given(junk=st.binary(max_size=40))
def test_property_decoder_agrees_with_protobuf_on_arbitrary_bytes(junk):
    try:
        want = tensor_pb2.TensorChunk.FromString(junk)
    except DecodeError:
        want = None
    try:
        got = decode_chunk(junk)
    except DecodeError:
        got = None
    if want is None:
        assert got is None
    else:
        assert got is not None and fields_of(got) == fields_of(want)


def test_wrapped_decoder_leaves_anything_but_one_chunk_field_to_protobuf():
    chunk = ChunkView(name="w", chunk_count=1, data=b"abc", crc32c=crc32c(b"abc"))
    once = encode_chunk(chunk, wrap_field=2)
    with pytest.raises(DecodeError):
        decode_chunk(once + once, wrap_field=2)
    with pytest.raises(DecodeError):
        decode_chunk(b"", wrap_field=2)
    with pytest.raises(DecodeError):
        decode_chunk(once[:-1], wrap_field=2)
    # A oneof sibling after the chunk wins in protobuf: only the full parser may decide.
    header = weight_sync_pb2.PushWeightsRequest(
        header=weight_sync_pb2.PushWeightsHeader(plan_id="p")
    ).SerializeToString()
    with pytest.raises(DecodeError):
        decode_chunk(once + header, wrap_field=2)
    with pytest.raises(DecodeError):
        decode_chunk(header, wrap_field=2)


def test_decoder_accepts_unpacked_shape_and_unknown_fields():
    wire = tensor_pb2.TensorChunk(name="w", shape=[3, 4], data=b"abc", crc32c=7).SerializeToString()
    # After the name: shape as two unpacked varints (key 6<<3|0), then unknown fields 20
    # (varint) and 21 (bytes), then the rest of the canonical encoding (packed shape 3, 4).
    name = bytes([0x0A, 1, ord("w")])
    assert wire.startswith(name)
    extra = bytes([0x30, 3, 0x30, 4, 0xA0, 0x01, 5, 0xAA, 0x01, 2, 9, 9])
    odd = name + extra + wire[len(name) :]
    want = tensor_pb2.TensorChunk.FromString(odd)
    assert list(want.shape) == [3, 4, 3, 4]
    assert fields_of(decode_chunk(odd)) == fields_of(want)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_tune_malloc_reuses_freed_activation_sized_blocks():
    """After tune_malloc, a freed 16 MiB block is reused, not unmapped and faulted in again.

    A training step allocates and frees blocks of this size per layer; with a low fixed mmap
    threshold each one cost 4,096 page faults (the trainer ran 1.3x slower than without
    tuning). Run in a child: the setting is process-wide.
    """
    code = (
        "import resource, torch\n"
        "from areal_grpc.host_memory import tune_malloc\n"
        "assert tune_malloc()\n"
        "for _ in range(20):\n"  # warm-up: the heap grows to its working size
        "    torch.empty(16 << 20, dtype=torch.uint8).fill_(1)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "for _ in range(20):\n"
        "    torch.empty(16 << 20, dtype=torch.uint8).fill_(1)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    faults = int(out.stdout.split()[-1])
    # 20 fresh mappings would be 20 x 4,096 faults; reuse leaves a few hundred at most.
    assert faults < 4096, f"{faults} page faults for 20 reused 16 MiB blocks"
