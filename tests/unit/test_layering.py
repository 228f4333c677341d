"""The layering rule (docs/concepts/architecture.md), checked on the source: imports go one
way and never round.

``arealgrpc.v1`` <- ``areal_grpc`` (core) <- ``areal_servers`` / ``areal_clients`` <- entry points
(``areal_grpc.coordinator``). Imports inside functions count: hiding a cycle in a function
body keeps it a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.support.paths import ROOT

# Import name -> directory, as setup.py maps them.
PACKAGES = {"areal_grpc": "areal_grpc", "areal_servers": "servers", "areal_clients": "clients"}


def modules() -> dict[str, Path]:
    """Every module of our three packages by its import name."""
    found: dict[str, Path] = {}
    for name, directory in PACKAGES.items():
        for path in sorted((ROOT / directory).rglob("*.py")):
            parts = list(path.relative_to(ROOT / directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([name, *parts])] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours ``name`` imports anywhere in its file (functions included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            # The longest module of ours the import names (a name imported from a module
            # counts as the module).
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports_of(name, path, known) for name, path in found.items()}


def layer(module: str) -> int:
    """0 core, 1 servers and clients, 2 entry points (the coordinator, the tinker service)."""
    if module.startswith(("areal_grpc.coordinator", "areal_grpc.tinker")):
        return 2
    if module.startswith(("areal_servers", "areal_clients")):
        return 1
    return 0


def test_imports_go_one_way_between_the_layers():
    wrong = sorted(
        f"{m} imports {d}"
        for m, deps in graph().items()
        for d in deps
        if layer(d) > layer(m)
        or (layer(m) == 1 and layer(d) == 1 and m.split(".")[0] != d.split(".")[0])
    )
    assert wrong == []


def test_no_module_imports_itself_round_a_cycle():
    g = graph()
    # Tarjan-free: a module is on a cycle when it reaches itself.
    cycles = []
    for start in sorted(g):
        seen: set[str] = set()
        todo = [d for d in g[start] if not d.startswith(f"{start}.")]
        while todo:
            m = todo.pop()
            if m == start:
                cycles.append(start)
                break
            if m in seen:
                continue
            seen.add(m)
            # A package's __init__ importing its own submodules is how packages re-export.
            todo += [d for d in g.get(m, ()) if not (m and d.startswith(f"{m}."))]
    assert cycles == []


def test_the_coordinator_starts_without_importing_torch_or_transformers():
    """Its children (which need them) start seconds sooner, and it holds none of their memory."""
    code = (
        "import sys\n"
        "import areal_grpc.coordinator.__main__\n"
        "from areal_grpc.coordinator.run import prepared_source\n"
        "assert prepared_source('builtin:micro') == 'builtin:micro'\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
