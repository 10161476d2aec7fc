"""The event loop the proxy process serves on: `listen.event_loop` (issue 16).

`asyncio` (the default) is the standard loop. `uvloop` runs on uvloop (a dependency on Linux and
macOS, not on Windows). Out of descriptors, libuv's own accept loop retried `accept()` on every
loop iteration (a whole CPU, no log line), so on uvloop the proxy accepts through
`front.listener.RetryingAcceptor`, which pauses 1 s and logs as asyncio does. Its gain in three
interleaved runs (bench/README.md, "uvloop") was 0.81-1.13x the CPU per call, median ~0.93: not
steady enough to make it the default. `auto` is uvloop when it is installed, else asyncio.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class EventLoopUnavailableError(RuntimeError):
    """`listen.event_loop: uvloop` on a machine without the uvloop package."""


def resolve(choice: str) -> str:
    """The loop `choice` ("auto", "uvloop" or "asyncio") gives on this machine: "uvloop" or
    "asyncio". Raises EventLoopUnavailableError for "uvloop" when uvloop is not installed."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        has_uvloop = False
    else:
        has_uvloop = True
    if choice == "uvloop" and not has_uvloop:
        raise EventLoopUnavailableError(
            "listen.event_loop is uvloop, but the uvloop package is not installed (pip install uvloop), or "
            "set it to auto or asyncio"
        )
    if choice == "asyncio" or not has_uvloop:
        return "asyncio"
    return "uvloop"


def problems(choice: str) -> list[str]:
    """What stops `choice` from running here (for `check-config`): empty, or one sentence."""
    try:
        resolve(choice)
    except EventLoopUnavailableError as exc:
        return [str(exc)]
    return []


def describe(choice: str) -> str:
    """What `choice` runs on here, for `check-config`: "uvloop", "asyncio", or "asyncio (auto:
    uvloop is not installed)". Raises EventLoopUnavailableError as `resolve`."""
    loop = resolve(choice)
    return f"{loop} (auto: uvloop is not installed)" if choice == "auto" and loop == "asyncio" else loop


def running() -> str:
    """The running loop's kind, for the start-up log line: "uvloop" or "asyncio"."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A factory for `asyncio.Runner(loop_factory=...)`: uvloop's when `resolve(choice)` is
    "uvloop", else None (asyncio's default loop). Raises EventLoopUnavailableError as `resolve`."""
    if resolve(choice) == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def run(main: Coroutine[Any, Any, T], choice: str) -> T:
    """Run `main` to its end on the loop `choice` names, as `asyncio.run` does (Ctrl-C cancels
    `main`, then KeyboardInterrupt is raised). Raises EventLoopUnavailableError as `resolve`."""
    try:
        factory = loop_factory(choice)
    except EventLoopUnavailableError:
        main.close()
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
