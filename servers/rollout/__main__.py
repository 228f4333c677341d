"""``areal-rollout``: serves RolloutService and WeightSyncService on one server.

Its settings come from the run config, as the coordinator reads it (``--config run.yaml``,
``key=value`` overrides: ``model.source=builtin:tiny rollout.engine=hf``); see
areal_grpc.server_config::

    areal-rollout --port 50061 model.source=builtin:micro
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from areal_grpc.cli import base_parser, serve_main, server_options_from_args
from areal_grpc.server import Service
from areal_grpc.server_config import ROLLOUT_SECTIONS, add_run_config_args, run_config_from_args

DEFAULT_PORT = 50061


def add_rollout_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the rollout server's options to ``parser``: its own, then the run config."""
    parser.add_argument(
        "--sglang-url",
        default="",
        help="engine sglang: attach to this SGLang server (unset: launch one)",
    )
    add_run_config_args(parser)
    return parser


async def build(args: argparse.Namespace) -> Sequence[Service]:
    """The services of a rollout server."""
    # The run config is checked before torch is imported: a bad setting answers at once.
    run = run_config_from_args(args, ROLLOUT_SECTIONS)
    from areal_servers.rollout.build import serve_run

    # The side channel follows the server's own TLS, whatever the run config says.
    tls = server_options_from_args(args).tls
    return await serve_run(run, args.sglang_url, args.host, tls)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``areal-rollout``."""
    parser = base_parser("areal-rollout", "Serve a rollout (inference) server.", DEFAULT_PORT)
    return serve_main(add_rollout_args(parser), build, argv)


if __name__ == "__main__":
    raise SystemExit(main())
