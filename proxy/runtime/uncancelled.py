"""Work that a cancel of the task awaiting it must not cut in two.

A client whose connection closes cancels the handler serving it (the listener runs aiohttp with
`handler_cancellation`). Most of what a handler awaits may stop there, but not a step that hands
something over to the proxy: a task being committed for a running call, for one, may be in the
store already when the cancel comes, and then the call must become that task's, or the task reads
`working` for good with nothing behind it. Such a step runs in a task of its own, which the
handler's cancel leaves running (`asyncio.shield`); the handler itself still stops at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from functools import partial
from typing import Any, TypeVar

import structlog

log = structlog.get_logger("proxy.runtime")

T = TypeVar("T")

# Steps whose caller has gone, kept referenced until they end (the loop holds tasks only weakly).
_WITHOUT_CALLER: set[asyncio.Task[Any]] = set()


async def uncancelled(
    coro: Coroutine[Any, Any, T], *, what: str, expected: tuple[type[Exception], ...] = ()
) -> T:
    """Await `coro`, run in a task of its own that a cancel of the caller does not stop: the caller
    gets CancelledError at once, and `coro` goes on to its end (each of its waits carries its own
    bound). Returns what `coro` returns and raises what it raises while the caller waits; once the
    caller has gone, an exception of `coro` is logged, not raised anywhere: one of the `expected`
    kinds (a refusal the caller would have answered with) as `ended_without_caller` at info level,
    naming `what`; any other at error level with its traceback (`failed_without_caller`)."""
    task = asyncio.ensure_future(coro)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        _WITHOUT_CALLER.add(task)
        task.add_done_callback(partial(_ended, what, expected))
        raise


def _ended(what: str, expected: tuple[type[Exception], ...], task: asyncio.Task[Any]) -> None:
    """A step whose caller had gone is over: let it go, and log what it raised."""
    _WITHOUT_CALLER.discard(task)
    if task.cancelled() or (exc := task.exception()) is None:
        return
    if isinstance(exc, expected):
        log.info("ended_without_caller", what=what, reason=f"{exc.__class__.__name__}: {exc}")
    else:
        log.error("failed_without_caller", what=what, exc_info=exc)
