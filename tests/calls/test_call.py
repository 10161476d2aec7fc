"""One upstream call (`proxy.calls.call.Call`) on its own, against the fixture server (official
`mcp` SDK) through the pool of a proxy serving in-process: the promises the fence, the v1 path and
the task service lean on, which no request through the proxy shows alone."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

from support.clients import ModernClient
from support.proxy import Serve, make_config

from proxy.app import POOLS_KEY
from proxy.calls.call import Call


def _slow_call(pool: object, label: str) -> Call:
    arguments = {"seconds": 5, "label": label}
    return Call(
        pool=pool,  # type: ignore[arg-type]
        server="legacy",
        tool="slow_compute",
        params={"name": "slow_compute", "arguments": arguments},
        capabilities={},
        timeout=10,
    )


async def _logged(client: ModernClient, tool: str) -> object:
    return json.loads((await client.call(tool, {})).result["content"][0]["text"])


async def _reasons(client: ModernClient, label: str) -> list[str]:
    """The reasons of the `notifications/cancelled` the upstream received that name `label`."""
    received = await _logged(client, "cancels_received")
    return [c.get("reason") for c in received if label in str(c.get("reason"))]  # type: ignore[union-attr]


async def test_a_call_cancelled_twice_tells_the_upstream_once(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """The first cancel's reason is the outcome's, and one `notifications/cancelled` goes upstream
    (a client leaving as the fence stops its call cancels it twice)."""
    proxy = await serve(make_config(legacy_url, tmp_path))
    plain = ModernClient(proxy.url(), capabilities={})
    label = f"twice-{uuid.uuid4().hex[:8]}"
    call = _slow_call(proxy.app[POOLS_KEY]["legacy"], label)
    try:
        call.start()
        async with asyncio.timeout(5):
            while not call.sent:
                await asyncio.sleep(0.01)
        call.cancel(f"first {label}")
        call.cancel(f"second {label}")
        outcome = await asyncio.wait_for(asyncio.shield(call.outcome), timeout=5)
        assert outcome["error"]["code"] == -32800 and f"first {label}" in outcome["error"]["message"], outcome
        async with asyncio.timeout(5):  # the SDK server answers 202 before it logs a notification
            while not (reasons := await _reasons(plain, label)):
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # room for a second one to show (there is none to wait for)
        assert await _reasons(plain, label) == [f"first {label}"], reasons
    finally:
        await plain.close()


async def test_a_call_cancelled_before_it_started_never_reaches_the_upstream(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """What a v1 task's call does when the fence came while its task was being created: `start`
    ends it with -32800 naming the cancel, and sends nothing."""
    proxy = await serve(make_config(legacy_url, tmp_path))
    plain = ModernClient(proxy.url(), capabilities={})
    label = f"unstarted-{uuid.uuid4().hex[:8]}"
    call = _slow_call(proxy.app[POOLS_KEY]["legacy"], label)
    try:
        call.cancel("fenced")
        call.start()
        assert call.done and not call.sent
        assert call.outcome.result() == {
            "error": {"code": -32800, "message": "the call was cancelled: fenced"}
        }
        assert label not in await _logged(plain, "started_log")  # type: ignore[operator]
    finally:
        await plain.close()


async def test_a_callback_added_to_an_ended_call_is_called_soon(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """As asyncio's futures do: a callback added once the outcome is known is called from the
    event loop (not at once, not never), with the call."""
    proxy = await serve(make_config(legacy_url, tmp_path))
    call = _slow_call(proxy.app[POOLS_KEY]["legacy"], f"ended-{uuid.uuid4().hex[:8]}")
    call.cancel("ended before the callback")
    call.start()
    called: asyncio.Future[Call] = asyncio.get_running_loop().create_future()
    call.add_done_callback(called.set_result)
    assert not called.done()  # not from inside add_done_callback
    assert await asyncio.wait_for(called, timeout=1) is call
