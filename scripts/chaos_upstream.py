"""The legacy fixture server (tests/fixtures/legacy_server.py), counting how often each call starts.

    MCP_CHAOS_STARTS=/tmp/starts.log python scripts/chaos_upstream.py --port 0

Same tools and command line as the fixture; every tool call carrying a string argument `label`
appends one line `<label>` to the file named by MCP_CHAOS_STARTS (O_APPEND, one write per start,
written before the tool runs), so scripts/chaos.py can tell a call the upstream ran twice (a
request re-sent after a kill, a re-run) from one it ran once. Without MCP_CHAOS_STARTS nothing is
written. Loopback only, like the fixture.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fixtures import legacy_server as fixture  # noqa: E402


def counting(handler: Any, fd: int) -> Any:
    """`handler` that first records the call's `label` (if any) as one line in `fd`."""

    async def run(ctx: Any, args: dict[str, Any]) -> Any:
        label = args.get("label")
        if isinstance(label, str):
            os.write(fd, f"{label}\n".encode())  # one write per line: whole lines under O_APPEND
        return await handler(ctx, args)

    return run


def main() -> None:
    """Patch the fixture's handler table in place (it is read per call), then run its CLI."""
    path = os.environ.get("MCP_CHAOS_STARTS")
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        for name, handler in list(fixture._HANDLERS.items()):
            fixture._HANDLERS[name] = counting(handler, fd)
    fixture.main(description="Legacy fixture server counting call starts (scripts/chaos.py)")


if __name__ == "__main__":
    main()
