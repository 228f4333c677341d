"""Shared test set-up: one torch thread per process (CI has 2 cores); an OTLP receiver; the
coordinator command as a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from areal_grpc.server import BackgroundServer, service

torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    """The suite runs on the CPU wherever it runs; ``-m gpu`` selects the GPU tests instead.

    Hiding GPUs (before anything initialises CUDA) keeps every CPU test, and every server
    process it starts, on the CPU even on a GPU machine, where "auto" devices would otherwise
    put two trainer ranks on one GPU.
    """
    if "gpu" not in (config.option.markexpr or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


# -- a real OTLP trace receiver on loopback (tests of tracing) --------------------------------


class OtlpCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC trace receiver (the protocol Jaeger speaks on port 4317)."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.got = threading.Event()
        self.address = ""

    async def Export(self, request, context):
        self.requests.append(request)
        self.got.set()
        return trace_service_pb2.ExportTraceServiceResponse()

    def env(self) -> dict[str, str]:
        """OTEL_* variables that make a child process export its spans here, quickly."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{self.address}",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }

    def spans(self) -> list[tuple[str, Any]]:
        """(service.name, span) for every span received so far."""
        out = []
        for req in list(self.requests):
            for rs in req.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    out.extend((attrs["service.name"], s) for s in ss.spans)
        return out

    @staticmethod
    def attr(span: Any, key: str) -> Any:
        """A span attribute's value (int or string), None when absent."""
        for a in span.attributes:
            if a.key == key:
                return a.value.int_value if a.value.HasField("int_value") else a.value.string_value
        return None


@pytest.fixture
def otlp_collector() -> Iterator[OtlpCollector]:
    """An :class:`OtlpCollector` served on a free loopback port for the test."""
    collector = OtlpCollector()
    svc = service(
        collector, trace_service_pb2_grpc.add_TraceServiceServicer_to_server, trace_service_pb2
    )
    with BackgroundServer([svc]) as receiver:
        collector.address = receiver.address
        yield collector


# -- ``python -m areal_grpc.coordinator`` as a subprocess (tests of whole runs) ----------------


class CoordinatorCommand:
    """Runs ``python -m areal_grpc.coordinator`` as a user does; stops what tests leave running."""

    # A short run on the built-in echo task: small batches, no eval, checkpoints or outputs.
    SMALL_RUN = (
        "data.task=echo",
        "staleness.batch_size=2",
        "staleness.group_size=2",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        "checkpoint.export_hf=false",
        "output.plot=false",
        "output.tensorboard=false",
    )

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[str]] = []
        self._seen: dict[subprocess.Popen[str], str] = {}

    def start(
        self,
        out: Path,
        *overrides: str,
        resume: bool = False,
        env: Mapping[str, str] | None = None,
        unset_env: Sequence[str] = (),
    ) -> subprocess.Popen[str]:
        """The command writing to ``out``; stdout and stderr merged into ``proc.stdout``."""
        argv = [sys.executable, "-m", "areal_grpc.coordinator"]
        if resume:
            argv.append("--resume")
        argv += [f"output.dir={out}", "output.progress_bar=false", *overrides]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        for name in unset_env:
            full_env.pop(name, None)
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env
        )
        self._procs.append(proc)
        return proc

    def address(self, proc: subprocess.Popen[str]) -> str:
        """The address the run serves CoordinatorService at, from its ``COORDINATOR`` line."""
        assert proc.stdout is not None
        # Byte by byte from the pipe: nothing read past the line waits in proc.stdout's buffer,
        # where finish() (communicate reads the pipe itself) would never see it.
        fd = proc.stdout.fileno()
        seen = bytearray()
        line_start = 0
        while byte := os.read(fd, 1):
            seen += byte
            if byte == b"\n":
                line = seen[line_start:].decode()
                line_start = len(seen)
                if line.startswith("COORDINATOR "):
                    self._seen[proc] = seen.decode()
                    return line.split()[1]
        proc.wait()
        raise AssertionError("the run ended before serving:\n" + seen.decode())

    def finish(self, proc: subprocess.Popen[str], timeout: float = 240) -> str:
        """Waits for the run to end; its whole output (printed: pytest shows it on failure)."""
        rest, _ = proc.communicate(timeout=timeout)
        out = self._seen.pop(proc, "") + rest
        print(out)
        return out

    def run(
        self,
        out: Path,
        *overrides: str,
        timeout: float = 300,
        resume: bool = False,
        env: Mapping[str, str] | None = None,
        unset_env: Sequence[str] = (),
    ) -> tuple[int, str]:
        """A whole run: (exit code, output)."""
        proc = self.start(out, *overrides, resume=resume, env=env, unset_env=unset_env)
        log = self.finish(proc, timeout=timeout)
        return proc.returncode, log

    @staticmethod
    def trained_steps(out: Path) -> int:
        """Train records in the run's metrics.jsonl so far (each is flushed as written)."""
        path = out / "metrics.jsonl"
        if not path.is_file():
            return 0
        lines = path.read_text().splitlines()
        return sum(json.loads(line)["kind"] == "train" for line in lines if line.endswith("}"))

    @staticmethod
    @contextlib.contextmanager
    def paused(pid: int, out: Path) -> Iterator[int]:
        """The run's coordinator (``pid``, writing to ``out``) stopped with SIGSTOP for the
        block; yields how many steps it has trained.

        What the block does to the mesh (kill a server, say) then happens at a known step,
        whatever the machine's load. With V steps trained, the staleness rule has let at most
        the groups of ``max_staleness + V + 1`` steps be generated, so a run longer than that
        still needs a rollout server afterwards (:meth:`needs_rollouts_after`).
        """
        os.kill(pid, signal.SIGSTOP)
        try:
            yield CoordinatorCommand.trained_steps(out)
        finally:
            os.kill(pid, signal.SIGCONT)

    @staticmethod
    def needs_rollouts_after(trained: int, total_steps: int, max_staleness: int = 2) -> bool:
        """Whether a run that has trained ``trained`` steps must still generate groups."""
        return total_steps > max_staleness + trained + 1

    def close(self) -> None:
        """Stops every run still going as Ctrl-C does (it stops its mesh too), else kills it."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._procs.clear()
        self._seen.clear()


@pytest.fixture
def coordinator_command() -> Iterator[CoordinatorCommand]:
    """A :class:`CoordinatorCommand`; no run it started outlives the test."""
    command = CoordinatorCommand()
    try:
        yield command
    finally:
        command.close()


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    """Skips (or, with AREAL_REQUIRE_VLLM=1 as CI sets, fails) where vLLM is not installed."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return
    message = "vLLM is not installed (./scripts/setup --vllm installs its CPU build)"
    if os.environ.get("AREAL_REQUIRE_VLLM"):
        pytest.fail(message + ", and AREAL_REQUIRE_VLLM is set")
    pytest.skip(message)


@pytest.fixture(scope="session")
def node_modules() -> Path:
    """The repository's node_modules (``npm ci`` from package-lock.json once, when a package
    the Node tests use is missing)."""
    root = Path(__file__).resolve().parents[1]
    if not all((root / "node_modules" / p).exists() for p in (".bin/tsc", "openai")):
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=root,
            check=True,
            timeout=300,
        )
    return root / "node_modules"
