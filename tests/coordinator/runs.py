"""Helpers of the tests that run a whole coordinator process and watch its children."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists (a zombie not yet reaped counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def mesh_children(out: Path) -> list[dict]:
    """The children listed in ``out/mesh.json`` (read again while the file is rewritten)."""
    while True:
        try:
            return json.loads((out / "mesh.json").read_text())["children"]
        except ValueError:
            time.sleep(0.1)
