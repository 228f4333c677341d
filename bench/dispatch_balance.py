"""Balance of trainer-rank dispatch: max/mean tokens per rank, per method, M = 2, 4, 8.

Workload (synthetic, seeded): a step's batch is 32 prompt groups of 8 sequences. Per group a
prompt length ~ lognormal(median 150, sigma 0.5) clipped to [16, 2048] and a difficulty
factor ~ lognormal(0, 0.5); per sequence a response length ~ factor * lognormal(median 600,
sigma 1.0) clipped to [1, 8192] (the long tail of reasoning traces, hitting the cap at times).
A group's weight is the sum of its 8 sequences' prompt + response tokens.

Baseline: AReaL's dispatch (``ffd_allocate`` with capacity 1e12 and min_groups = M).
Measured: the default method of ``areal_grpc.dispatch``. All methods (round-robin included)
are printed, with a lower bound no partition can beat: max(1, largest group * M / total).

    .venv/bin/python bench/dispatch_balance.py [--trials N] [--groups G]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

from results import result

from areal_grpc.dispatch import DEFAULT_METHOD, METHODS, balance_ratio, dispatch_groups

GROUP_SIZE = 8


def group_tokens(rng: random.Random) -> int:
    """Total tokens of one group of GROUP_SIZE sequences sharing a prompt."""
    prompt = min(2048, max(16, round(rng.lognormvariate(math.log(150), 0.5))))
    difficulty = rng.lognormvariate(0.0, 0.5)
    total = 0
    for _ in range(GROUP_SIZE):
        response = difficulty * rng.lognormvariate(math.log(600), 1.0)
        total += prompt + min(8192, max(1, round(response)))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--groups", type=int, default=32, help="groups (prompts) per step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    batches = [[group_tokens(rng) for _ in range(args.groups)] for _ in range(args.trials)]
    print(
        f"{args.trials} batches of {args.groups} groups x {GROUP_SIZE} sequences; "
        f"mean tokens/group {statistics.fmean(x for b in batches for x in b):.0f}"
    )
    print(
        f"{'M':>3} {'bound':>7} " + " ".join(f"{m:>13}" for m in METHODS) + "  (mean/p99 max/mean)"
    )
    results: list[tuple[int, float, float]] = []
    for n_ranks in (2, 4, 8):
        means: dict[str, float] = {}
        cells = []
        for method in METHODS:
            start = time.perf_counter()
            ratios = [balance_ratio(b, dispatch_groups(b, n_ranks, method)) for b in batches]
            elapsed_us = (time.perf_counter() - start) / len(batches) * 1e6
            means[method] = statistics.fmean(ratios)
            p99 = sorted(ratios)[int(0.99 * (len(ratios) - 1))]
            cells.append(f"{means[method]:.4f}/{p99:.3f}")
            print(
                f"    M={n_ranks} {method:<11} mean {means[method]:.4f} p99 {p99:.4f} "
                f"({elapsed_us:.0f} us/plan)"
            )
        bound = statistics.fmean(max(1.0, max(b) * n_ranks / sum(b)) for b in batches)
        print(f"{n_ranks:>3} {bound:>7.4f} " + " ".join(f"{c:>13}" for c in cells))
        results.append((n_ranks, means[DEFAULT_METHOD], means["ffd"]))
    print(f"chosen method: {DEFAULT_METHOD}; baseline: ffd (AReaL's variant)")
    for n_ranks, value, baseline in results:
        # Four decimals, not results.py's default .4g: the methods differ in the fourth.
        result(f"dispatch_balance_m{n_ranks}", value, "max_over_mean", baseline, "1.0", spec=".4f")


if __name__ == "__main__":
    main()
