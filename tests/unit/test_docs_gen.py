"""The gRPC API reference (docs/reference/grpc-api.md) is what buf's image of protos/
generates, and it documents the whole contract: every RPC with its streaming, every field
with its comment, every type linked to a definition on the page."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from areal_grpc.docs_gen import anchor, grpc_reference_markdown, load_descriptor_set
from tests.support.paths import ROOT

PAGE = ROOT / "docs" / "reference" / "grpc-api.md"


def buf() -> str:
    """The buf binary of the dev extra (buf-bin, next to this interpreter), else on PATH."""
    here = Path(sys.executable).parent / "buf"
    found = str(here) if here.is_file() else shutil.which("buf")
    assert found, "buf is missing: pip install -e '.[dev]' (buf-bin)"
    return found


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> descriptor_pb2.FileDescriptorSet:
    out = tmp_path_factory.mktemp("buf") / "protos.binpb"
    subprocess.run([buf(), "build", "-o", str(out)], cwd=ROOT, check=True, timeout=120)
    return load_descriptor_set(out)


@pytest.fixture(scope="module")
def page(image: descriptor_pb2.FileDescriptorSet) -> str:
    return grpc_reference_markdown(image)


def test_the_committed_grpc_reference_is_what_the_protos_generate(page: str) -> None:
    assert PAGE.read_text() == page, "run ./scripts/gen-docs"


def test_every_rpc_is_documented_with_its_types_and_streaming(
    image: descriptor_pb2.FileDescriptorSet, page: str
) -> None:
    ours = [f for f in image.file if f.package == "arealgrpc.v1"]
    assert {s.name for f in ours for s in f.service} >= {
        "CoordinatorService",
        "RolloutService",
        "TrainerService",
        "WeightSyncService",
    }
    for f in ours:
        for s in f.service:
            for m in s.method:
                heading = f"#### `{s.name}.{m.name}`"
                assert heading in page
                signature = page.split(heading, 1)[1].split("\n\n", 2)[1]
                signature, _, idempotency = signature.partition(" · ")
                request, response = signature.split(" → ")
                level = {"": 0, "no side effects": 1, "idempotent": 2}[idempotency]
                assert level == m.options.idempotency_level, heading
                # And in the service's summary table.
                assert f"#{anchor(f'{f.package}.{s.name}.{m.name}')}) | {request} | " in page
                assert request.startswith("stream ") == m.client_streaming, signature
                assert response.startswith("stream ") == m.server_streaming, signature
                assert f"#{anchor(m.input_type.lstrip('.'))})" in request
                assert f"#{anchor(m.output_type.lstrip('.'))})" in response
    # The bidi stream the coordinator drives a rollout server with.
    assert (
        "stream [`RunEpisodesRequest`](#arealgrpc-v1-runepisodesrequest) → "
        "stream [`RunEpisodesResponse`](#arealgrpc-v1-runepisodesresponse)"
    ) in page


def test_every_field_and_enum_value_has_a_row_with_its_comment(page: str) -> None:
    # A message field: number, type link, label and its comment on one row.
    assert (
        "| `trace_context` | 9 | [`TraceContext`](#arealgrpc-v1-tracecontext) |  | "
        "Trace context of the span that produced this trajectory. |"
    ) in page
    assert "| `seed` | 8 | `uint64` | optional |" in page
    assert "| `FINISH_REASON_STOP` | 1 | A stop token" in page
    # A comment's angle brackets are text, not HTML.
    assert '"00-&lt;trace id&gt;-&lt;span id&gt;-01"' in page
    assert "map&lt;`string`, `double`&gt;" in page


def test_tables_are_well_formed_and_every_link_has_its_target(page: str) -> None:
    ids = set(re.findall(r'<a id="([^"]+)"></a>', page))
    links = set(re.findall(r"\]\(#([^)]+)\)", page))
    assert links and links <= ids, sorted(links - ids)
    for line in page.splitlines():
        if line.startswith("| field |"):
            width = 5
        elif line.startswith("| value |"):
            width = 3
        elif line.startswith("| file |"):
            width = 2
        elif line.startswith("| RPC |"):
            width = 3
        if line.startswith("|"):
            cells = re.split(r"(?<!\\)\|", line)[1:-1]
            assert len(cells) == width, line


def test_a_descriptor_set_without_comments_is_refused(
    image: descriptor_pb2.FileDescriptorSet,
) -> None:
    bare = descriptor_pb2.FileDescriptorSet()
    bare.CopyFrom(image)
    for f in bare.file:
        f.ClearField("source_code_info")
    with pytest.raises(ValueError, match="source info"):
        grpc_reference_markdown(bare)
