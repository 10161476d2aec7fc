"""The command line, one module per subcommand: `serve` (the default: `mcp-tasks-proxy [--config
FILE]`, the bundled demo without one), `check-config`, `tasks`, `hash-token`, `schema`."""

from __future__ import annotations

import sys
from collections.abc import Callable

from proxy.cli import check_config, hash_token, schema, serve, tasks

SUBCOMMANDS: dict[str, Callable[[list[str]], int]] = {
    "check-config": check_config.run,
    "tasks": tasks.run,
    "hash-token": hash_token.run,
    "schema": schema.run,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `mcp-tasks-proxy` console script; returns the exit status.

    Subcommands: `check-config FILE`, `tasks …`, `hash-token [TOKEN]`, `schema`; anything else serves.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    subcommand = SUBCOMMANDS.get(argv[0]) if argv else None
    return subcommand(argv[1:]) if subcommand is not None else serve.run(argv)
