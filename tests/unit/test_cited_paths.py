"""Every repository path the code and docs cite exists.

Scanned: the tracked Python, Markdown and YAML files (the docs site's pages and mkdocs.yml
among them). A citation is a repository-relative
path under one of the top-level directories below (a figure under docs, a config under
examples, a benchmark script, a proto file...), optionally written with a leading ``./``.
Not citations: anything inside a URL, a path that continues another one (``a/docs/x``),
placeholders (a path with ``<``, ``{``, ``*`` or ``$`` in it), and the few paths of another
repository cited as its own (``ELSEWHERE``). A docs page's relative link (``reference/<page>.md``
from docs/index.md) and a page in mkdocs.yml's nav resolve as the site does.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.support.paths import ROOT

URL = re.compile(r"[A-Za-z][\w+.-]*://\S+")
# The path characters, plus the placeholder ones so that a placeholder is matched whole (and
# then skipped) rather than cut short into a path that looks real.
PATH = r"[\w./<>{}*$-]*[\w>}*]"
CITED = re.compile(
    r"(?<![\w./-])(?:\./)?("
    rf"(?:docs|examples|scripts|configs)/{PATH}"
    rf"|bench/{PATH}\.py"
    rf"|protos/{PATH}\.proto"
    rf"|reference/{PATH}\.md"
    r")(?![\w/])"
)
PLACEHOLDER = re.compile(r"[<>{}*$]")
# Paths of another repository cited as such, which this one need not have (none today: cite
# another repository's file by its URL).
ELSEWHERE: set[str] = set()


def scanned_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--", "*.py", "*.md", "*.yaml", "*.yml"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [name for name in out.split("\0") if name]


def citation_bases(name: str) -> list[Path]:
    """Where a path cited in file ``name`` may be: the repository root, and for a docs page
    also its own directory (a relative link), for mkdocs.yml the docs directory (its nav)."""
    bases = [ROOT]
    if name.startswith("docs/") and name.endswith(".md"):
        bases.append((ROOT / name).parent)
    if name == "mkdocs.yml":
        bases.append(ROOT / "docs")
    return bases


def citations(text: str) -> list[tuple[int, str]]:
    """(line number, path) of each repository path ``text`` cites."""
    found = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        for match in CITED.finditer(URL.sub(" ", line)):
            path = match.group(1)
            if not PLACEHOLDER.search(path) and path not in ELSEWHERE:
                found.append((lineno, path))
    return found


def test_the_scan_finds_citations_and_skips_what_is_not_one() -> None:
    text = (
        "see docs/algorithms.png, `./scripts/setup --vllm` and bench/soak.py.\n"
        "https://github.com/o/r/blob/main/docs/x.md outputs/run/configs/a.yaml\n"
        "bench/{name}.py docs/<figure>.png examples/*.yaml reference/x.mdx\n"
    )
    assert citations(text) == [
        (1, "docs/algorithms.png"),
        (1, "scripts/setup"),
        (1, "bench/soak.py"),
    ]


def test_every_cited_path_exists() -> None:
    files = scanned_files()
    assert files, "git ls-files found nothing to scan"
    dangling = []
    for name in files:
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, not yet in git
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        bases = citation_bases(name)
        for lineno, cited in citations(text):
            if not any((base / cited).exists() for base in bases):
                dangling.append(f"{name}:{lineno}: {cited}")
    assert not dangling, "cited paths that do not exist:\n" + "\n".join(dangling)
