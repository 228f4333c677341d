"""The gRPC API reference page, written from the contract's own comments.

``scripts/gen-docs`` runs ``buf build -o <file>.binpb`` (buf's image keeps each file's source
info, so the comments travel with the descriptors) and then::

    python -m areal_grpc.docs_gen <file>.binpb docs/reference/grpc-api.md

:func:`grpc_reference_markdown` renders every file of our package (``arealgrpc.v1``): each
service with its RPCs (request -> response, streaming marked, the leading comment), each
message with a table of its fields and each enum with its values. Every type of ours links to
its definition on the page; the well-known and googleapis types link to their own docs. Only
``google.protobuf`` is imported, so the page can be built without the generated stubs.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import descriptor_pb2

__all__ = ["grpc_reference_markdown", "load_descriptor_set", "main"]

# The package the page documents; vendored files (google.*, grpc.*) are linked, not copied.
PACKAGE = "arealgrpc.v1"

# Field numbers of the descriptor messages, as SourceCodeInfo.Location.path spells them
# (descriptor.proto): FileDescriptorProto.message_type = 4, .enum_type = 5, .service = 6;
# DescriptorProto.field = 2, .nested_type = 3, .enum_type = 4; EnumDescriptorProto.value = 2;
# ServiceDescriptorProto.method = 2.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 4, 5, 6
_MESSAGE_FIELD, _MESSAGE_NESTED, _MESSAGE_ENUM = 2, 3, 4
_ENUM_VALUE = 2
_SERVICE_METHOD = 2

FDP = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    FDP.TYPE_DOUBLE: "double",
    FDP.TYPE_FLOAT: "float",
    FDP.TYPE_INT64: "int64",
    FDP.TYPE_UINT64: "uint64",
    FDP.TYPE_INT32: "int32",
    FDP.TYPE_FIXED64: "fixed64",
    FDP.TYPE_FIXED32: "fixed32",
    FDP.TYPE_BOOL: "bool",
    FDP.TYPE_STRING: "string",
    FDP.TYPE_BYTES: "bytes",
    FDP.TYPE_UINT32: "uint32",
    FDP.TYPE_SFIXED32: "sfixed32",
    FDP.TYPE_SFIXED64: "sfixed64",
    FDP.TYPE_SINT32: "sint32",
    FDP.TYPE_SINT64: "sint64",
}

# Where the types we import from others are documented.
_EXTERNAL_DOCS = {
    "google.protobuf.": "https://protobuf.dev/reference/protobuf/google.protobuf/#{anchor}",
    "google.rpc.": "https://github.com/googleapis/googleapis/blob/master/google/rpc/{file}",
}


def load_descriptor_set(path: str | Path) -> descriptor_pb2.FileDescriptorSet:
    """The ``FileDescriptorSet`` (a buf image) stored at ``path``."""
    fds = descriptor_pb2.FileDescriptorSet()
    fds.ParseFromString(Path(path).read_bytes())
    return fds


def anchor(full_name: str) -> str:
    """The page anchor of a type's definition: ``arealgrpc.v1.Trajectory`` ->
    ``arealgrpc-v1-trajectory``."""
    return full_name.lower().replace(".", "-")


@dataclass(frozen=True)
class _Type:
    """A message or enum by its full name (no leading dot), with the file defining it."""

    full_name: str
    file: str
    map_entry: descriptor_pb2.DescriptorProto | None = None


def _index(fds: descriptor_pb2.FileDescriptorSet) -> dict[str, _Type]:
    """Every message and enum of the set by full name (map entries keep their descriptor, so
    a map field can be shown as ``map<K, V>``)."""
    types: dict[str, _Type] = {}

    def messages(prefix: str, file: str, items: Iterable[descriptor_pb2.DescriptorProto]) -> None:
        for m in items:
            name = f"{prefix}.{m.name}"
            types[name] = _Type(name, file, m if m.options.map_entry else None)
            messages(name, file, m.nested_type)
            for e in m.enum_type:
                types[f"{name}.{e.name}"] = _Type(f"{name}.{e.name}", file)

    for f in fds.file:
        messages(f.package, f.name, f.message_type)
        for e in f.enum_type:
            types[f"{f.package}.{e.name}"] = _Type(f"{f.package}.{e.name}", f.name)
    return types


class _Renderer:
    """Writes one page from a descriptor set; holds the type index and each file's comments."""

    def __init__(self, fds: descriptor_pb2.FileDescriptorSet) -> None:
        self.fds = fds
        self.types = _index(fds)
        self.out: list[str] = []

    # -- text ------------------------------------------------------------------------------

    @staticmethod
    def _comments(f: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
        found = {}
        for loc in f.source_code_info.location:
            text = loc.leading_comments or loc.trailing_comments
            if text.strip():
                found[tuple(loc.path)] = text
        return found

    @staticmethod
    def _escape(text: str) -> str:
        """Markdown-safe prose: ``<``/``>`` outside code spans are entities (a comment's
        ``<trace id>`` is not an HTML tag)."""
        parts = text.split("`")
        for i in range(0, len(parts), 2):  # even parts lie outside backticks
            parts[i] = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        return "`".join(parts)

    def block(self, comment: str) -> str:
        """A multi-line comment as Markdown paragraphs (lists keep their lines)."""
        lines = [line[1:] if line.startswith(" ") else line for line in comment.splitlines()]
        out: list[str] = []
        item = re.compile(r"^(\d+\.|[-*]) ")
        for line in lines:
            prev = out[-1] if out else ""
            # A list needs a blank line before it, which comments do not write.
            if item.match(line) and prev.strip() and not item.match(prev) and prev[:1] != " ":
                out.append("")
            # A line starting with '#' would be a heading.
            out.append(self._escape(re.sub(r"^#", r"\\#", line)))
        return "\n".join(out).strip()

    def cell(self, comment: str) -> str:
        """A comment as one table cell."""
        text = " ".join(line.strip() for line in comment.splitlines() if line.strip())
        return self._escape(text).replace("|", "\\|")

    # -- names -----------------------------------------------------------------------------

    def link(self, type_name: str) -> str:
        """A reference to a message or enum type (``.pkg.Name`` as descriptors write it)."""
        name = type_name.lstrip(".")
        t = self.types.get(name)
        if t is not None and t.file.startswith(PACKAGE.replace(".", "/") + "/"):
            return f"[`{name.removeprefix(PACKAGE + '.')}`](#{anchor(name)})"
        for prefix, url in _EXTERNAL_DOCS.items():
            if name.startswith(prefix):
                short = name.removeprefix(prefix)
                target = url.format(anchor=short.lower(), file=t.file.split("/")[-1] if t else "")
                return f"[`{name}`]({target})"
        return f"`{name}`"

    def field_type(self, field: descriptor_pb2.FieldDescriptorProto) -> str:
        if field.type in (FDP.TYPE_MESSAGE, FDP.TYPE_ENUM):
            t = self.types.get(field.type_name.lstrip("."))
            if t is not None and t.map_entry is not None:
                key, value = t.map_entry.field
                return f"map&lt;{self.field_type(key)}, {self.field_type(value)}&gt;"
            return self.link(field.type_name)
        return f"`{_SCALARS[field.type]}`"

    def label(
        self, message: descriptor_pb2.DescriptorProto, field: descriptor_pb2.FieldDescriptorProto
    ) -> str:
        t = self.types.get(field.type_name.lstrip("."))
        if t is not None and t.map_entry is not None:
            return ""  # the type says map<K, V>
        if field.label == FDP.LABEL_REPEATED:
            return "repeated"
        if field.proto3_optional:
            return "optional"
        if field.HasField("oneof_index"):
            return f"oneof `{message.oneof_decl[field.oneof_index].name}`"
        return ""

    # -- sections --------------------------------------------------------------------------

    def heading(self, level: int, full_name: str, title: str) -> None:
        self.out += [f'<a id="{anchor(full_name)}"></a>', "", f"{'#' * level} {title}", ""]

    def paragraph(self, comments: dict[tuple[int, ...], str], path: tuple[int, ...]) -> None:
        if path in comments:
            self.out += [self.block(comments[path]), ""]

    def service(
        self,
        f: descriptor_pb2.FileDescriptorProto,
        comments: dict[tuple[int, ...], str],
        i: int,
        s: descriptor_pb2.ServiceDescriptorProto,
    ) -> None:
        full = f"{f.package}.{s.name}"
        self.heading(3, full, f"service `{s.name}`")
        self.paragraph(comments, (_FILE_SERVICE, i))
        signatures = []
        for m in s.method:
            request = ("stream " if m.client_streaming else "") + self.link(m.input_type)
            response = ("stream " if m.server_streaming else "") + self.link(m.output_type)
            signatures.append((request, response))
        # A summary first: every RPC of the service on one screen.
        self.out += ["| RPC | request | response |", "|---|---|---|"]
        for m, (request, response) in zip(s.method, signatures, strict=True):
            link = f"[`{m.name}`](#{anchor(f'{full}.{m.name}')})"
            self.out.append(f"| {link} | {request} | {response} |")
        self.out.append("")
        for j, (m, (request, response)) in enumerate(zip(s.method, signatures, strict=True)):
            self.heading(4, f"{full}.{m.name}", f"`{s.name}.{m.name}`")
            line = f"{request} → {response}"
            level = m.options.idempotency_level
            if level:
                # The retry contract a client may rely on (descriptor.proto's MethodOptions).
                words = {1: "no side effects", 2: "idempotent"}.get(level, "")
                line += f" · {words}" if words else ""
            self.out += [line, ""]
            self.paragraph(comments, (_FILE_SERVICE, i, _SERVICE_METHOD, j))

    def message(
        self,
        comments: dict[tuple[int, ...], str],
        prefix: str,
        path: tuple[int, ...],
        m: descriptor_pb2.DescriptorProto,
    ) -> None:
        if m.options.map_entry:
            return  # shown as map<K, V> in the field that holds it
        full = f"{prefix}.{m.name}"
        self.heading(3, full, f"message `{full.removeprefix(PACKAGE + '.')}`")
        self.paragraph(comments, path)
        if m.field:
            self.out += ["| field | number | type | label | description |", "|---|---|---|---|---|"]
            for k, field in enumerate(m.field):
                comment = comments.get((*path, _MESSAGE_FIELD, k), "")
                self.out.append(
                    f"| `{field.name}` | {field.number} | {self.field_type(field)} | "
                    f"{self.label(m, field)} | {self.cell(comment)} |"
                )
        else:
            self.out.append("No fields.")
        self.out.append("")
        for k, e in enumerate(m.enum_type):
            self.enum(comments, full, (*path, _MESSAGE_ENUM, k), e)
        for k, nested in enumerate(m.nested_type):
            self.message(comments, full, (*path, _MESSAGE_NESTED, k), nested)

    def enum(
        self,
        comments: dict[tuple[int, ...], str],
        prefix: str,
        path: tuple[int, ...],
        e: descriptor_pb2.EnumDescriptorProto,
    ) -> None:
        full = f"{prefix}.{e.name}"
        self.heading(3, full, f"enum `{full.removeprefix(PACKAGE + '.')}`")
        self.paragraph(comments, path)
        self.out += ["| value | number | description |", "|---|---|---|"]
        for k, v in enumerate(e.value):
            comment = comments.get((*path, _ENUM_VALUE, k), "")
            self.out.append(f"| `{v.name}` | {v.number} | {self.cell(comment)} |")
        self.out.append("")

    def file(self, f: descriptor_pb2.FileDescriptorProto) -> None:
        comments = self._comments(f)
        self.out += [f"## `{f.name}`", ""]
        for i, s in enumerate(f.service):
            self.service(f, comments, i, s)
        for i, m in enumerate(f.message_type):
            self.message(comments, f.package, (_FILE_MESSAGE, i), m)
        for i, e in enumerate(f.enum_type):
            self.enum(comments, f.package, (_FILE_ENUM, i), e)

    def page(self) -> str:
        ours = sorted((f for f in self.fds.file if f.package == PACKAGE), key=lambda f: f.name)
        self.out = [
            "# gRPC API reference",
            "",
            f"The contract of package `{PACKAGE}`, generated from the comments in `protos/` by "
            "`scripts/gen-docs` (`buf build`, then `python -m areal_grpc.docs_gen`); do not "
            "edit. Streaming RPCs are marked `stream`. Every server also serves "
            "`grpc.health.v1.Health` and server reflection.",
            "",
            "| file | services |",
            "|---|---|",
        ]
        for f in ours:
            services = ", ".join(
                f"[`{s.name}`](#{anchor(f'{f.package}.{s.name}')})" for s in f.service
            )
            self.out.append(f"| `{f.name}` | {services or '(messages only)'} |")
        self.out.append("")
        for f in ours:
            self.file(f)
        return "\n".join(self.out).rstrip() + "\n"


def grpc_reference_markdown(fds: descriptor_pb2.FileDescriptorSet) -> str:
    """The gRPC API reference page (Markdown) of ``fds``'s ``arealgrpc.v1`` files."""
    if not any(loc.leading_comments for f in fds.file for loc in f.source_code_info.location):
        raise ValueError("the descriptor set has no comments: build it with source info")
    return _Renderer(fds).page()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m areal_grpc.docs_gen IMAGE OUT``: writes the page from a buf image."""
    parser = argparse.ArgumentParser(prog="python -m areal_grpc.docs_gen", description=__doc__)
    parser.add_argument("image", help="a FileDescriptorSet with source info (buf build -o)")
    parser.add_argument("out", help="the Markdown file to write")
    args = parser.parse_args(argv)
    text = grpc_reference_markdown(load_descriptor_set(args.image))
    Path(args.out).write_text(text)
    print(f"generated: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
