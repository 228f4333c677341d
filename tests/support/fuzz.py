"""Shared pieces of the fuzz tests: the documented status codes, hypothesis settings, a tally
of malformed inputs.

Every fuzz test sends hypothesis-generated malformed messages to a real server on loopback and
checks that each answer is either a success or one of the status codes the contract documents
for bad input (INTERNAL and UNKNOWN are failures), that nothing hangs, and that a valid request
made afterwards still succeeds against intact state.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from hypothesis import HealthCheck, settings

# Answers a handler may give to bad input (docs/concepts/errors.md and the service docstrings).
DOCUMENTED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.ABORTED,
    }
)


# Settings for every fuzz test: a module-scoped server is shared by the examples, examples are
# derandomized (a failure reproduces on the next run) and nothing is written to .hypothesis/.
def fuzz(max_examples: int) -> settings:
    """Hypothesis settings of a fuzz test running ``max_examples`` examples."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        derandomize=True,
        database=None,
        print_blob=True,
    )


class Tally:
    """How many malformed inputs each RPC got, and what it answered."""

    def __init__(self) -> None:
        self.sent: Counter[str] = Counter()
        self.answers: defaultdict[str, Counter[str]] = defaultdict(Counter)

    def call(
        self,
        rpc: str,
        fn: Callable[[], Any],
        allowed: Iterable[grpc.StatusCode] = DOCUMENTED,
    ) -> tuple[grpc.StatusCode, Any]:
        """Runs one malformed call: (OK, response) or (documented code, the error)."""
        self.sent[rpc] += 1
        allowed = frozenset(allowed)
        try:
            response = fn()
        except grpc.RpcError as err:
            code = err.code()  # type: ignore[attr-defined]
            self.answers[rpc][code.name] += 1
            assert code in allowed, (
                f"{rpc} answered undocumented {code.name}: {err.details()}"  # type: ignore[attr-defined]
            )
            return code, err
        self.answers[rpc]["OK"] += 1
        return grpc.StatusCode.OK, response

    def note(self, rpc: str, outcome: str) -> None:
        """Counts an input whose outcome was checked by the caller (e.g. an episode result)."""
        self.sent[rpc] += 1
        self.answers[rpc][outcome] += 1

    def report(self) -> str:
        lines = ["", "fuzz: malformed inputs per RPC"]
        for rpc in sorted(set(self.sent) | set(self.answers)):
            answers = ", ".join(f"{k} {v}" for k, v in sorted(self.answers[rpc].items()))
            lines.append(f"  {rpc:<40} {self.sent[rpc]:>5}  ({answers})")
        lines.append(f"  {'total':<40} {sum(self.sent.values()):>5}")
        return "\n".join(lines)
