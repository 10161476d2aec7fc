"""The legacy fixture server (tests/fixtures/legacy_server.py), recording when each call starts and ends.

    MCP_CHAOS_STARTS=/tmp/starts.log python scripts/chaos_upstream.py --port 0 [--keep-alive 0.5]

Same tools and command line as the fixture (`--keep-alive` s: uvicorn closes a connection idle that
long); every tool call carrying a string argument `label` (no whitespace) appends to the file named by
MCP_CHAOS_STARTS one line `<label> <run> start <t>` before the tool runs and one line
`<label> <run> end <t>` once it returned, failed or was cancelled (`run`: a number of its own per
call in this process; `t`: wall-clock time, s; O_APPEND, one write per line). So scripts/chaos.py
can tell a call the upstream ran twice (a request re-sent after a kill, a re-run) from one it ran
once, and two runs of one call that overlapped in time (a call running on two replicas at once)
from one after the other. A run the process was stopped under has no end line. Without
MCP_CHAOS_STARTS nothing is written. Loopback only, like the fixture.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fixtures import legacy_server as fixture  # noqa: E402

_RUNS = itertools.count(1)


def counting(handler: Any, fd: int) -> Any:
    """`handler` that records the start and the end of each call with a `label` (if any) in `fd`."""

    async def run(ctx: Any, args: dict[str, Any]) -> Any:
        label = args.get("label")
        if not isinstance(label, str) or not label or any(c.isspace() for c in label):
            return await handler(ctx, args)
        number = next(_RUNS)
        # one write per line: whole lines under O_APPEND
        os.write(fd, f"{label} {number} start {time.time():.6f}\n".encode())
        try:
            return await handler(ctx, args)
        finally:  # also when cancelled (the proxy's notifications/cancelled, a session ended)
            os.write(fd, f"{label} {number} end {time.time():.6f}\n".encode())

    return run


def main() -> None:
    """Patch the fixture's handler table in place (it is read per call), then run its CLI."""
    path = os.environ.get("MCP_CHAOS_STARTS")
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        for name, handler in list(fixture._HANDLERS.items()):
            fixture._HANDLERS[name] = counting(handler, fd)
    fixture.main(description="Legacy fixture server recording call starts and ends (scripts/chaos.py)")


if __name__ == "__main__":
    main()
