"""A trainer-group worker that stalls (SIGSTOP) fails nothing by itself: the collective waits.
The group's timeout (tinker.trainer_timeout_s) ends the wait; the worker is killed and
replaced, and the call is rerun. Its own module: it needs a group with a short timeout, and a
process holds one group at a time."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from areal_servers.lora_training.engine import LoraEngine
from areal_servers.lora_training.replicas import GroupEngine

from tests.service.lora_training.test_trainer_group import (
    DTYPE,
    MODEL,
    SPEC,
    assert_same_output,
    both,
    rl_data,
)

torch.set_num_threads(1)


def test_a_stalled_worker_is_replaced_once_the_timeout_passes(tmp_path: Path):
    group = GroupEngine(MODEL, world=2, timeout_s=3, log_dir=tmp_path, dtype=DTYPE)
    alone = LoraEngine(MODEL, dtype=DTYPE)
    try:
        both(group, alone, "create", "stall", SPEC)
        stalled = group.workers[0].process
        os.kill(stalled.pid, signal.SIGSTOP)
        out = both(group, alone, "forward_backward", "stall", rl_data(), "dro", {})
        assert_same_output(*out)
        assert stalled.poll() is not None  # it was killed, not left stopped
        assert [w.alive() for w in group.workers] == [True]
    finally:
        group.close()
