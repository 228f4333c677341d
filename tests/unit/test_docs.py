"""The docs cannot rot: what they name exists, what they tell you to run is run somewhere.

Scanned: README.md and the hand-written pages under docs/ (not docs/notes, which are dated
records of what was true that day, and not the generated configuration reference).

* Every config key the docs name (``model.lora.rank`` in prose, ``key=value`` on a command
  line) is a setting or a section of the config tree, and a value given for a setting with a
  fixed set of choices is one of them. Every documented ``python -m areal_grpc.coordinator``
  command line loads, files and overrides together, as the run would load it. On the page
  mapping AReaL's and verl's keys to ours, the first column of its tables is theirs and is not
  checked; every row's second column names keys of ours that exist, or says *none*.
* Every shell block (```bash) of the README, the getting-started and the guide pages carries a
  marker on the line before it saying how we know it works:
  ``<!-- tested: tests/<file>.py::test_name -->`` (that test runs the command),
  ``<!-- bench: bench/<script>.py ... -->`` (a benchmark runs it: longer than a test may take) or
  ``<!-- needs: ... -->`` (hardware or a service the tests lack). A target must exist.
* The README stays a short front page: under 200 lines, no dates, no commit hashes.
* The site builds with ``mkdocs build --strict`` (marked slow: a few seconds).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import pytest

from areal_grpc.config import RunConfig, choices_of, load_config
from tests.support.paths import ROOT

DOCS = ROOT / "docs"
# Not checked for config keys: the generated reference (its generator is tested against the
# fields), and the Tinker SDK's wire format, where ``tinker.types`` and the like are the SDK's
# modules, not our ``tinker`` section.
NOT_SCANNED = {DOCS / "reference" / "config.md", DOCS / "tinker-wire.md"}


def pages() -> list[Path]:
    """The hand-written pages whose config keys must exist."""
    found = [ROOT / "README.md"]
    for path in sorted(DOCS.rglob("*.md")):
        if DOCS / "notes" in path.parents or path in NOT_SCANNED:
            continue
        found.append(path)
    return found


def command_pages() -> list[Path]:
    """The pages whose shell blocks must say how they are known to work."""
    return [
        ROOT / "README.md",
        *sorted((DOCS / "getting-started").glob("*.md")),
        *sorted((DOCS / "guides").glob("*.md")),
    ]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- the config tree --------------------------------------------------------------------------

SECTIONS = tuple(f.name for f in fields(RunConfig))


def lookup(key: str) -> tuple[type, str] | None:
    """(the config class declaring it, the field name) for a dotted key, ``(RunConfig, "")``
    for the root; None when the tree has no such key. Keys below a mapping-valued setting
    (``rollout.workflow_params.accept``) belong to that mapping and are accepted."""
    owner: Any = RunConfig()
    parts = key.split(".")
    for i, part in enumerate(parts):
        names = {f.name for f in fields(owner)}
        if part not in names:
            return None
        value = getattr(owner, part)
        if is_dataclass(value):
            owner = value
            continue
        if i == len(parts) - 1 or isinstance(value, dict):
            return type(owner), part
        return None
    return type(owner), ""  # a section


# Dotted names in the docs that start like a section but are not settings: span names, a
# transformers method, a file name.
NOT_SETTINGS = {
    "model.generate",  # transformers' GenerationMixin.generate, the plain-loop baseline
    "rollout.episode",  # span names (docs/guides/tracing.md)
    "rollout.generate",
    "gateway.completion",
}

FILE_SUFFIXES = {"md", "py", "proto", "yaml", "yml", "json", "jsonl", "png", "jinja", "out"}
# Not a key: one that goes on with an index (a tensor's name, ``model.layers.0.mlp``).
KEY = re.compile(
    r"(?<![\w.$/:-])((?:" + "|".join(SECTIONS) + r")(?:\.[A-Za-z_]\w*)+)(?![\w{*]|\.\d)"
)
OVERRIDE = re.compile(
    r"(?<![\w.$/:-])((?:" + "|".join(SECTIONS) + r")(?:\.\w+)*)=(\[[^\]\s]*\]|[^\s`'\"),]*)"
)


def named_keys(text: str) -> set[str]:
    """The dotted config keys a page names (in prose, code spans, blocks)."""
    found = set()
    for match in KEY.finditer(text):
        key = match.group(1)
        # A key written as the start of a wider pattern (``launcher.ray_*``) is not a key.
        if text[match.end() : match.end() + 1] in ("*", "{"):
            continue
        # Nor is a file name (``weight_sync.proto``, ``staleness.md``).
        if key.rsplit(".", 1)[1] in FILE_SUFFIXES:
            continue
        found.add(key)
    return found - NOT_SETTINGS


def overrides(text: str) -> set[tuple[str, str]]:
    """Every ``key=value`` a page shows (the value as written; "" when cut off)."""
    return {(m.group(1), m.group(2)) for m in OVERRIDE.finditer(text)}


PLACEHOLDER = re.compile(r"[<>{}$]|\.\.\.")


def test_the_key_scan_finds_keys_and_skips_what_is_not_one() -> None:
    text = (
        "set `model.lora.rank=8` and trainer.ppo.rejection.lower; see rollout.vllm.* and\n"
        "launcher.ray_* or trainer.{lr,grad_clip}; areal_grpc.tinker, outputs/model.x, "
        "model.generate, model.layers.0.mlp.up_proj.weight\n"
    )
    assert named_keys(text) == {"model.lora.rank", "trainer.ppo.rejection.lower", "rollout.vllm"}
    assert overrides("`model.lora.rank=8` 'launcher.attach.rollout_addresses=[a:1,b:2]'") == {
        ("model.lora.rank", "8"),
        ("launcher.attach.rollout_addresses", "[a:1,b:2]"),
    }


# Pages whose tables map another project's keys to ours: the first cell of a table row is the
# other project's key (verl's ``data.train_batch_size`` is not ours) and is not scanned; the
# rest of the row, our keys, is.
FOREIGN_KEY_PAGES = {DOCS / "guides" / "coming-from-areal-or-verl.md"}


def table_rows(text: str) -> list[list[str]]:
    """The cells of each body row of the page's Markdown tables (header and rule left out)."""
    rows, in_body = [], False
    for line in text.splitlines():
        if not line.startswith("|"):
            in_body = False
        elif re.fullmatch(r"\|[-|: ]+\|", line.strip()):
            in_body = True
        elif in_body:
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def scanned_text(page: Path) -> str:
    """The text of a page whose config keys must exist (foreign keys taken out)."""
    text = page.read_text(encoding="utf-8")
    if page not in FOREIGN_KEY_PAGES:
        return text
    return "\n".join(
        "|" + line.split("|", 2)[2] if line.startswith("|") else line for line in text.splitlines()
    )


def test_every_config_key_the_docs_name_exists() -> None:
    missing = []
    for page in pages():
        text = scanned_text(page)
        for key in sorted(named_keys(text) | {k for k, _ in overrides(text)}):
            if lookup(key) is None:
                missing.append(f"{rel(page)}: {key}")
    assert not missing, "keys the config tree does not have:\n" + "\n".join(missing)


def test_every_value_the_docs_give_a_setting_with_choices_is_one_of_them() -> None:
    wrong = []
    for page in pages():
        for key, raw in sorted(overrides(scanned_text(page))):
            found = lookup(key)
            if found is None or not found[1] or not raw or PLACEHOLDER.search(raw):
                continue  # a missing key is the test above's; a placeholder says nothing
            owner, name = found
            if name not in {f.name for f in fields(owner)}:
                continue  # a key inside a mapping-valued setting
            choices = choices_of(owner, name)
            if not choices:
                continue
            values = raw.strip("[]").split(",") if raw.startswith("[") else [raw]
            bad = [v for v in values if v not in choices]
            if bad:
                wrong.append(f"{rel(page)}: {key}={raw} (one of {', '.join(choices)})")
    assert not wrong, "values outside the setting's choices:\n" + "\n".join(wrong)


CODE = re.compile(r"`([^`]+)`")


def test_each_row_mapping_a_foreign_key_names_ours_or_says_none() -> None:
    """On the AReaL / verl page every row names their key and, in its second cell, keys of
    ours that exist (bare ones like ``total_steps`` too, which the dotted scan misses), or
    says *none*; what the first cell names is not taken for ours."""
    for page in FOREIGN_KEY_PAGES:
        rows = table_rows(page.read_text(encoding="utf-8"))
        assert len(rows) >= 40, f"{rel(page)}: only {len(rows)} rows"
        problems = []
        for theirs, ours, *_ in rows:
            if not CODE.search(theirs):
                problems.append(f"no key of theirs: {theirs!r}")
            keys = [k.split("=", 1)[0] for k in CODE.findall(ours)]
            if not keys and "*none*" not in ours:
                problems.append(f"{theirs}: neither a key of ours nor *none*: {ours!r}")
            problems += [f"{theirs}: {k} is not a key of ours" for k in keys if lookup(k) is None]
        assert not problems, f"{rel(page)}:\n" + "\n".join(problems)
    text = scanned_text(next(iter(FOREIGN_KEY_PAGES)))
    assert "data.train_batch_size" not in text and "staleness.batch_size" in text


# --- shell blocks ---------------------------------------------------------------------------

FENCE = re.compile(r"^```(\w*)\s*$")
SHELLS = {"bash", "sh", "shell", "console"}


def shell_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number, the marker line before it or "", the block's text) of each shell block."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if m.group(1) in SHELLS:
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = before.strip() if before.strip().startswith("<!--") else ""
            blocks.append((i + 1, marker, "\n".join(lines[i + 1 : end])))
        i = end + 1
    return blocks


MARKER = re.compile(r"<!--\s*(.*?)\s*-->")


def marker_problems(marker: str) -> list[str]:
    """What is wrong with one block's marker; [] when it is sound."""
    m = MARKER.fullmatch(marker)
    if not m:
        return ["no <!-- tested: / bench: / needs: --> line before it"]
    problems = []
    kinds = {}
    # Notes in parentheses may say anything (even a ";"): only what is outside them counts.
    for part in re.sub(r"\([^)]*\)", "", m.group(1)).split(";"):
        kind, _, what = part.strip().partition(":")
        kinds[kind.strip()] = what.strip()
    if not kinds.keys() & {"tested", "bench", "needs"}:
        return [f"the marker {marker!r} says neither tested:, bench: nor needs:"]
    if "needs" in kinds and not kinds["needs"]:
        problems.append("needs: says nothing")
    for kind in ("tested", "bench"):
        if kind not in kinds:
            continue
        # Targets, comma-separated, each its first word (a note in parentheses may follow).
        targets = [t.split()[0] for t in kinds[kind].split(",") if t.strip()]
        if not targets:
            problems.append(f"{kind}: names nothing")
        for target in targets:
            path, _, name = target.partition("::")
            file = ROOT / path
            if not file.is_file():
                problems.append(f"{kind}: {path} does not exist")
            elif name and not re.search(
                rf"^(async )?def {re.escape(name)}\(", file.read_text(), re.M
            ):
                problems.append(f"{kind}: {path} has no {name}")
            if kind == "bench" and not path.startswith("bench/"):
                problems.append(f"bench: {path} is not a benchmark")
    return problems


def test_the_marker_check_accepts_what_exists_and_refuses_the_rest() -> None:
    assert (
        marker_problems(
            "<!-- tested: tests/unit/test_docs.py::test_readme_is_a_short_front_page -->"
        )
        == []
    )
    assert marker_problems("<!-- needs: gpu; tested: .ci/run (setup and tests) -->") == []
    assert marker_problems("<!-- bench: bench/examples.py (ten minutes) -->") == []
    assert marker_problems("") != []
    assert marker_problems("<!-- tested: tests/unit/test_docs.py::test_nothing -->") != []
    assert marker_problems("<!-- tested: tests/nowhere.py -->") != []
    assert marker_problems("<!-- bench: tests/unit/test_docs.py -->") != []
    assert marker_problems("<!-- fine -->") != []


def test_every_shell_block_says_how_it_is_known_to_work() -> None:
    problems = []
    for page in command_pages():
        for lineno, marker, _ in shell_blocks(page.read_text(encoding="utf-8")):
            problems += [f"{rel(page)}:{lineno}: {p}" for p in marker_problems(marker)]
    assert not problems, "\n".join(problems)


COORDINATOR = ("areal_grpc.coordinator", "areal_grpc.coordinator.submit")


def coordinator_commands(text: str) -> list[tuple[list[str], list[str]]]:
    """(config files, overrides) of each ``python -m areal_grpc.coordinator`` command line in
    the shell blocks of a page."""
    found = []
    for _, _, block in shell_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            if "-m" not in words:
                continue
            module = words[words.index("-m") + 1] if words.index("-m") + 1 < len(words) else ""
            if module not in COORDINATOR:
                continue
            args = words[words.index("-m") + 2 :]
            configs = [args[i + 1] for i, a in enumerate(args) if a == "--config"]
            sets = [a for a in args if "=" in a and not a.startswith("-")]
            found.append((configs, sets))
    return found


def test_every_documented_override_loads() -> None:
    """Each documented coordinator command's settings load as the run loads them: its
    config files (those in this repository; ``run.yaml`` stands for yours) and overrides
    together, with the run's validation."""
    checked, failed = 0, []
    for page in pages():
        for configs, sets in coordinator_commands(page.read_text(encoding="utf-8")):
            files = [str(ROOT / c) for c in configs if (ROOT / c).is_file()]
            sets = [s for s in sets if not PLACEHOLDER.search(s)]
            try:
                load_config(files or None, sets)
            except Exception as exc:  # reported with the command that raised it
                failed.append(f"{rel(page)}: {configs} {sets}: {exc}")
            checked += 1
    assert checked >= 10, f"only {checked} documented commands found"
    assert not failed, "\n".join(failed)


def test_the_algorithm_guides_commands_resolve() -> None:
    """docs/guides/algorithms.md: ``algorithm=rloo --print-config`` shows RLOO's
    normalisation, and the dapo line's overrides reach the resolved config."""
    text = (DOCS / "guides" / "algorithms.md").read_text(encoding="utf-8")
    assert "algorithm=rloo --print-config | grep -A5 reward_norm" in text
    out = subprocess.run(
        [sys.executable, "-m", "areal_grpc.coordinator", "algorithm=rloo", "--print-config"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    norm = out.stdout[out.stdout.index("reward_norm:") :].splitlines()[:6]
    assert any("mean_leave1out: true" in line for line in norm), norm
    assert any("std_level: none" in line for line in norm), norm
    dapo = load_config(
        None,
        ["algorithm=dapo", "trainer.ppo.overlong_max_len=16", "trainer.ppo.overlong_cache=4"],
    )
    assert dapo.trainer.ppo.eps_clip_higher == 0.28
    assert dapo.rollout.workflow_params["accept"] == "nonuniform"
    assert (dapo.trainer.ppo.overlong_max_len, dapo.trainer.ppo.overlong_cache) == (16, 4)


# --- the README and the site ----------------------------------------------------------------


def test_readme_is_a_short_front_page() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) < 200
    # History and run logs live in CHANGELOG.md and docs/notes, not here.
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", text)
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", h)]
    assert not hashes, hashes
    # Its two commands are still the quick start.
    assert ".venv/bin/python -m areal_grpc.coordinator" in text and "./scripts/test" in text


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """A broken link, a page missing from the nav or a snippet that does not resolve fails
    the build (mkdocs.yml: strict, every validation a warning)."""
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARNING" not in out.stderr, out.stderr
    assert (tmp_path / "index.html").is_file()
    # The changelog page holds CHANGELOG.md itself, through the snippets extension.
    changelog = (tmp_path / "changelog" / "index.html").read_text(encoding="utf-8")
    assert "Changelog" in changelog and "mmap threshold" in changelog
