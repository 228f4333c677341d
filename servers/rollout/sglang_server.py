"""The SGLang server a rollout server launches (``rollout.engine: sglang`` without
``rollout.sglang.urls``): which Python runs it, its command line and environment, and its
process, started, watched and stopped with everything it started.

SGLang runs in a venv of its own (``./scripts/setup --sglang`` builds ``.venv-sglang``): its
pins differ from ours, and the rollout server speaks to it over HTTP only. On a machine
without a GPU it runs SGLang's torch-native CPU path (``SGLANG_USE_CPU_ENGINE=1``,
``--device cpu --attention-backend torch_native``) with the import stand-ins of
``sglang_cpu/`` on its ``PYTHONPATH`` (see the README there), in the dtype ``rollout.dtype``
chooses (always named: SGLang would pick float16 on a CPU), and with
``--sleep-on-idle`` (its idle scheduler spins a whole core otherwise).

The process is started so that it dies with the rollout server (``PR_SET_PDEATHSIG``; SGLang's
scheduler and detokenizer die with it the same way) and leads a process group of its own,
which :meth:`SGLangProcess.stop` ends whole.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from areal_grpc.config import LoraSettings, SglangSettings
from areal_grpc.errors import FieldError
from areal_grpc.launch import dies_with_this_process

__all__ = [
    "SETUP_VENV",
    "STAND_INS",
    "SGLangProcess",
    "launch_argv",
    "launch_env",
    "sglang_python",
]

log = logging.getLogger(__name__)

# The import stand-ins of SGLang's CPU path (sglang_cpu/README.md).
STAND_INS = Path(__file__).with_name("sglang_cpu")
# The SGLang venv ./scripts/setup --sglang builds in this checkout.
SETUP_VENV = Path(__file__).resolve().parents[2] / ".venv-sglang"
# SGLang logs one such line per model architecture it cannot import at start (dozens): not
# copied into the rollout server's log.
_NOISE = ("Ignore import error when loading sglang.srt.models",)
# Lines of its output kept for the error when it exits.
_TAIL_LINES = 40


def sglang_python(settings: SglangSettings) -> str:
    """The Python that launches SGLang: ``rollout.sglang.python``, else this checkout's
    ``.venv-sglang``, else this Python. FieldError naming the setting when it has no SGLang."""
    if settings.python:
        python = settings.python
    elif (SETUP_VENV / "bin" / "python").exists():
        python = str(SETUP_VENV / "bin" / "python")
    else:
        python = sys.executable
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FieldError("rollout.sglang.python", f"{python} does not run: {exc}") from None
    if found != 0:
        raise FieldError(
            "rollout.sglang.python",
            f"{python} has no SGLang (./scripts/setup --sglang installs it in {SETUP_VENV})",
        )
    return python


def launch_argv(
    python: str,
    model_dir: str,
    port: int,
    settings: SglangSettings,
    *,
    seed: int = 0,
    dtype: str = "float32",
    gpu: bool = False,
    lora: LoraSettings | None = None,
    host: str = "127.0.0.1",
) -> list[str]:
    """The command line of an SGLang server for ``model_dir`` on ``host:port``, serving it in
    ``dtype`` (a dtype's name)."""
    argv = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_dir,
        "--host",
        host,
        "--port",
        str(port),
        "--random-seed",
        str(seed),
        # Token ids in and out: SGLang never loads the tokenizer (nothing is decoded and
        # encoded again, and the built-in models have no Hugging Face tokenizer).
        "--skip-tokenizer-init",
        "--skip-server-warmup",
        "--sleep-on-idle",
        # Its HTTP server logs every request at INFO: a line per generation.
        "--log-level-http",
        "warning",
    ]
    argv += ["--dtype", dtype]
    if settings.kv_cache_tokens:
        argv += ["--max-total-tokens", str(settings.kv_cache_tokens)]
    backend = settings.attention_backend or ("" if gpu else "torch_native")
    if backend:
        argv += ["--attention-backend", backend]
    if not gpu:
        # The overlap scheduler runs a CUDA stream of its own.
        argv += ["--device", "cpu", "--disable-overlap-schedule"]
    if lora is not None and lora.rank:
        targets = list(lora.target_modules)
        argv += [
            "--enable-lora",
            "--max-lora-rank",
            str(lora.rank),
            "--lora-target-modules",
            *(["all"] if targets == ["all-linear"] else targets),
        ]
    return [*argv, *settings.extra_args]


def launch_env(gpu: bool) -> dict[str, str]:
    """The environment of an SGLang server: this one, plus on a CPU SGLang's CPU platform and
    the stand-ins on its path."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if not gpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        path = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STAND_INS), path) if p)
    return env


class SGLangProcess:
    """A launched SGLang server process: its output goes to this process's stderr (the last
    lines are kept for errors), and it is stopped with its whole process group."""

    def __init__(self, argv: Sequence[str], env: dict[str, str]) -> None:
        """Starts ``argv`` (see :func:`launch_argv`) with ``env``."""
        log.info("launching %s", " ".join(argv))
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.process = subprocess.Popen(
            dies_with_this_process(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,
        )
        assert self.process.stdout is not None
        self._pump = threading.Thread(
            target=self._copy, args=(self.process.stdout,), daemon=True, name="sglang-output"
        )
        self._pump.start()

    @property
    def pid(self) -> int:
        """The server's process id (its process group's too)."""
        return self.process.pid

    def _copy(self, stream: IO[str]) -> None:
        for line in stream:
            if any(n in line for n in _NOISE):
                continue
            self.tail.append(line.rstrip())
            with contextlib.suppress(ValueError, OSError):
                sys.stderr.write(f"[sglang] {line}")

    def exit_code(self) -> int | None:
        """Its exit code once it has exited (negative: the signal that ended it), else None."""
        return self.process.poll()

    def exited(self) -> str:
        """How it ended, in the words of an engine death ("its server process exited ...")."""
        code = self.process.poll()
        how = f"was killed by signal {-code}" if code is not None and code < 0 else "exited"
        return f"its server process {how} (exit code {code})"

    def last_lines(self, n: int = 3) -> str:
        """Its last ``n`` lines of output, joined (after it exited: why)."""
        self._pump.join(timeout=2.0)
        return " | ".join(list(self.tail)[-n:])

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to its process group, SIGKILL to what is left after ``grace_s``."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)
            try:
                self.process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # Its scheduler and detokenizer share the group and may outlive it by a moment.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self._pump.join(timeout=2.0)
