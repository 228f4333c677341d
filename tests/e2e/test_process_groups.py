"""What a killed child leaves in its process group is cleaned up (areal_grpc.launch)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from areal_grpc.launch import kill_group_leftovers

# A group leader whose spawned child holds a POSIX shared-memory segment, as vLLM's engine
# processes hold their message queues (/dev/shm/psm_*), registered with multiprocessing's
# resource tracker.
HOLDER = """
import multiprocessing as mp, sys, time
from multiprocessing import shared_memory

def hold(q):
    shm = shared_memory.SharedMemory(create=True, size=1 << 20)
    q.put(shm.name)
    time.sleep(600)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ctx.Process(target=hold, args=(q,)).start()
    print(q.get(), flush=True)
    time.sleep(600)
"""


def live_members(pgid: int) -> list[int]:
    """The group's processes that are not zombies (init here may be slow to reap those)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def test_a_killed_childs_leftovers_go_and_their_shared_memory_with_them(tmp_path: Path):
    """kill -9 of a server leaves its subprocesses running; the launcher kills them, and the
    shared memory they held is unlinked (the resource tracker goes last, after cleaning up)."""
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    leader = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert leader.stdout is not None
        name = leader.stdout.readline().strip()
        segment = Path("/dev/shm") / name
        assert name and segment.exists()
        leader.send_signal(signal.SIGKILL)
        leader.wait()
        kill_group_leftovers(leader.pid, "holder", grace_s=0.5)
        # Nothing of the group is left, and the segment went with it.
        assert not live_members(leader.pid)
        assert not segment.exists(), f"{segment} was left behind"
    finally:
        if leader.poll() is None:
            leader.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, signal.SIGKILL)
