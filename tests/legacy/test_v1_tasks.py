"""v1 tasks (2025-11-25) served by the proxy for handshake-era clients, over HTTP and stdio
upstreams (raw wire checks; the SDK clients drive the same flows in test_v1_clients.py), and
status push for v2 clients on subscriptions/listen."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support.clients import AuthClient, ModernClient, envelope
from support.proxy import RunningProxy, Serve, make_config, with_auth
from support.servers import ROOT, ServerProcess
from support.v1_client import V1Client

from proxy.front.auth import hash_token
from proxy.protocol.sse import iter_events
from proxy.tasks.wire_v1 import question_request

RELATED = "io.modelcontextprotocol/related-task"


@pytest.fixture
async def v1(flow_proxy: RunningProxy) -> AsyncIterator[V1Client]:
    client = V1Client(flow_proxy.url())
    await client.initialize()
    yield client
    await client.close()


async def _wait_status(
    client: V1Client, task_id: str, statuses: tuple[str, ...], timeout: float = 10.0
) -> dict:
    async with asyncio.timeout(timeout):
        while True:
            status, message, _ = await client.request("tasks/get", {"taskId": task_id})
            assert status == 200, message
            if message["result"]["status"] in statuses:
                return message["result"]
            await asyncio.sleep(0.02)


async def test_initialize_declares_tasks_and_tools_list_carries_task_support(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    tools = {"failing_job": {"mode": "required"}, "greet": {"mode": "forbidden"}}
    proxy = await serve(make_config(legacy_url, tmp_path / "store", server={"tasks": {"tools": tools}}))
    client = V1Client(proxy.url())
    try:
        result = await client.initialize()
        assert result["capabilities"]["tasks"] == {
            "list": {},
            "cancel": {},
            "requests": {"tools": {"call": {}}},
        }
        assert result["capabilities"]["tools"] is not None  # the upstream's own capabilities stay
        status, message, _ = await client.request("tools/list", {})
        support = {tool["name"]: tool["execution"]["taskSupport"] for tool in message["result"]["tools"]}
        assert (
            support["failing_job"] == "required"
            and support["greet"] == "forbidden"
            and support["slow_compute"] == "optional"
        )
        status, message, _ = await client.request(
            "tools/call", {"name": "greet", "arguments": {"name": "x"}, "task": {"ttl": 1000}}
        )
        # the handshake-era wire: JSON-RPC errors in a 200
        assert status == 200 and message["error"]["code"] == -32601
        status, message, _ = await client.request("tools/call", {"name": "failing_job", "arguments": {}})
        # taskSupport required: never synchronous
        assert status == 200 and message["error"]["code"] == -32601
    finally:
        await client.close()


async def test_without_client_auth_a_session_lists_only_the_tasks_it_created(
    flow_proxy: RunningProxy,
) -> None:
    alice, bob = V1Client(flow_proxy.url()), V1Client(flow_proxy.url())
    try:
        await alice.initialize()
        await bob.initialize()
        mine = (await alice.call_as_task("slow_compute", {"seconds": 0.2}))["taskId"]
        listed = lambda message: [t["taskId"] for t in message["result"]["tasks"]]  # noqa: E731
        assert mine in listed((await alice.request("tasks/list", {}))[1])
        # auth none: everyone is `anonymous`
        assert mine not in listed((await bob.request("tasks/list", {}))[1])
        # the id still works
        assert (await bob.request("tasks/get", {"taskId": mine}))[1]["result"]["taskId"] == mine
    finally:
        await alice.close()
        await bob.close()


async def test_slow_call_as_task_with_progress_status_push_and_blocking_result(v1: V1Client) -> None:
    task = await v1.call_as_task(
        "slow_compute", {"seconds": 0.6, "label": "v1"}, meta={"progressToken": "tok-1"}
    )
    assert task["status"] == "working" and task["ttl"] == 60_000 and task["pollInterval"] == 100
    assert set(task) >= {"taskId", "createdAt", "lastUpdatedAt"}
    status, listed, _ = await v1.request("tasks/list", {})
    assert task["taskId"] in [t["taskId"] for t in listed["result"]["tasks"]]
    status, message, notes = await v1.request("tasks/result", {"taskId": task["taskId"]})
    assert status == 200
    result = message["result"]
    assert result["content"][0]["text"] == "computed v1 after 0.6s"
    assert result["_meta"][RELATED] == {"taskId": task["taskId"]}
    progress = [n for n in notes if n["method"] == "notifications/progress"]
    assert progress and all(n["params"]["progressToken"] == "tok-1" for n in progress)
    assert progress[0]["params"]["_meta"][RELATED] == {"taskId": task["taskId"]}
    pushed = [n["params"]["status"] for n in notes if n["method"] == "notifications/tasks/status"]
    assert pushed[-1:] == ["completed"]
    done = (await v1.request("tasks/get", {"taskId": task["taskId"]}))[1]["result"]
    assert done["status"] == "completed"


async def test_a_blocking_result_for_a_json_only_client_is_one_json_body(v1: V1Client) -> None:
    """A `tasks/result` whose Accept names only JSON, sent while the task runs, got an SSE stream
    (status pushes, progress, the answer), which such a client cannot read; it now waits and gets
    the answer as one JSON body."""
    task = await v1.call_as_task(
        "slow_compute", {"seconds": 0.4, "label": "json-only"}, meta={"progressToken": "t"}
    )
    body = {"jsonrpc": "2.0", "id": 99, "method": "tasks/result", "params": {"taskId": task["taskId"]}}
    headers = {**v1._headers(), "Accept": "application/json"}
    async with v1.http.post(v1.url, json=body, headers=headers) as resp:
        assert resp.status == 200 and resp.content_type == "application/json", resp.headers
        answer = await resp.json()
    assert answer["id"] == 99 and answer["result"]["content"][0]["text"] == "computed json-only after 0.4s"


async def test_task_param_and_client_task_capability_never_reach_the_upstream(v1: V1Client) -> None:
    task = await v1.call_as_task("echo_meta", {}, meta={"acme/trace": "t-1"})
    _, message, _ = await v1.request("tasks/result", {"taskId": task["taskId"]})
    seen = json.loads(message["result"]["content"][0]["text"])
    assert "task" not in seen["paramKeys"]
    assert seen["meta"]["acme/trace"] == "t-1" and RELATED not in seen["meta"]


async def test_is_error_ends_failed_for_v1_and_completed_for_v2(
    flow_proxy: RunningProxy, v1: V1Client
) -> None:
    task = await v1.call_as_task("failing_job", {})
    _, message, _ = await v1.request("tasks/result", {"taskId": task["taskId"]})
    assert message["result"]["isError"] is True and message["result"]["content"][0]["text"] == "job failed"
    assert (await v1.request("tasks/get", {"taskId": task["taskId"]}))[1]["result"]["status"] == "failed"
    modern = ModernClient(flow_proxy.url())
    try:
        v2 = (await modern.get(task["taskId"])).result  # the same record, rendered for v2
        assert v2["status"] == "completed" and v2["result"]["isError"] is True
    finally:
        await modern.close()


async def test_upstream_jsonrpc_error_comes_back_from_tasks_result(v1: V1Client) -> None:
    task = await v1.call_as_task("protocol_error_job", {})
    status, message, _ = await v1.request("tasks/result", {"taskId": task["taskId"]})
    assert message["error"]["message"] == "protocol_error_job exploded"
    assert (await v1.request("tasks/get", {"taskId": task["taskId"]}))[1]["result"]["status"] == "failed"


async def test_input_request_is_answered_through_tasks_result(v1: V1Client) -> None:
    task = await v1.call_as_task("confirm_delete", {"filename": "a.txt", "delay": 0.2})
    await _wait_status(v1, task["taskId"], ("input_required",))
    asked: list[dict] = []

    async def accept(request: dict) -> dict:
        asked.append(request)
        return {"action": "accept", "content": {"confirm": True}}

    status, message, _ = await v1.request("tasks/result", {"taskId": task["taskId"]}, on_request=accept)
    assert message["result"]["content"][0]["text"] == "deleted a.txt"
    assert [q["method"] for q in asked] == ["elicitation/create"]
    assert asked[0]["params"]["_meta"][RELATED] == {"taskId": task["taskId"]}
    assert asked[0]["params"]["message"] == "Delete a.txt?"


async def test_cancel_returns_the_cancelled_task_and_refuses_a_terminal_one(v1: V1Client) -> None:
    task = await v1.call_as_task("slow_compute", {"seconds": 5})
    status, message, _ = await v1.request("tasks/cancel", {"taskId": task["taskId"]})
    assert (
        status == 200
        and message["result"]["status"] == "cancelled"
        and message["result"]["taskId"] == task["taskId"]
    )
    status, message, _ = await v1.request("tasks/cancel", {"taskId": task["taskId"]})
    assert status == 200 and message["error"]["code"] == -32602
    assert (await v1.request("tasks/get", {"taskId": task["taskId"]}))[1]["result"]["status"] == "cancelled"
    status, message, _ = await v1.request("tasks/result", {"taskId": task["taskId"]})
    assert message["error"]["code"] == -32603 and "cancelled" in message["error"]["message"]


async def test_result_is_fetched_from_a_new_session(flow_proxy: RunningProxy, v1: V1Client) -> None:
    task = await v1.call_as_task("slow_compute", {"seconds": 0.3, "label": "later"})
    await v1.close()
    again = V1Client(flow_proxy.url())
    try:
        await again.initialize()
        _, message, _ = await again.request("tasks/result", {"taskId": task["taskId"]})
        assert message["result"]["content"][0]["text"] == "computed later after 0.3s"
    finally:
        await again.close()


async def test_bad_v1_task_requests_get_clear_jsonrpc_errors(v1: V1Client) -> None:
    for method, params in (
        ("tasks/get", {"taskId": "nope"}),
        ("tasks/result", {"taskId": "nope"}),
        ("tasks/cancel", {}),
        ("tasks/list", {"cursor": "not-a-cursor"}),
        ("tasks/list", {"cursor": 5}),
    ):
        status, message, _ = await v1.request(method, params)
        assert status == 200 and message["error"]["code"] == -32602, (method, message)
    status, message, _ = await v1.request(
        "tools/call", {"name": "greet", "arguments": {}, "task": {"ttl": "soon"}}
    )
    assert status == 200 and message["error"]["code"] == -32602
    v1.sid = None
    status, message, _ = await v1.request("tasks/list", {})
    assert status == 400 and message["error"]["code"] == -32600


async def alice_and_bob(legacy_url: str, tmp_path: Path, serve: Serve) -> tuple[V1Client, V1Client]:
    """Two initialized v1 sessions of two principals (bearer tokens) on one proxy; close both."""
    auth = {
        "mode": "bearer",
        "tokens": {"alice": hash_token("alice-secret"), "bob": hash_token("bob-secret")},
    }
    proxy = await serve(with_auth(legacy_url, tmp_path, auth))
    alice, bob = V1Client(proxy.url()), V1Client(proxy.url())
    for client, token in ((alice, "alice-secret"), (bob, "bob-secret")):
        client.http.headers["Authorization"] = f"Bearer {token}"  # type: ignore[index]
        await client.initialize()
    return alice, bob


async def test_v1_tasks_belong_to_their_principal(legacy_url: str, tmp_path: Path, serve: Serve) -> None:
    alice, bob = await alice_and_bob(legacy_url, tmp_path, serve)
    try:
        task = await alice.call_as_task("slow_compute", {"seconds": 0.2})
        for method in ("tasks/get", "tasks/result", "tasks/cancel"):
            status, message, _ = await bob.request(method, {"taskId": task["taskId"]})
            assert status == 200 and message["error"]["code"] == -32602
        assert (await bob.request("tasks/list", {}))[1]["result"]["tasks"] == []
        assert len((await alice.request("tasks/list", {}))[1]["result"]["tasks"]) == 1
    finally:
        await alice.close()
        await bob.close()


async def test_another_principals_response_never_answers_a_v1_question(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """Bob posts a JSON-RPC response under the id of the question Alice's task asked: it is not
    Alice's answer. Her question stays open, and her own answer is the one the upstream gets."""
    alice, bob = await alice_and_bob(legacy_url, tmp_path, serve)
    try:
        task = await alice.call_as_task("confirm_delete", {"filename": "a.txt", "delay": 0.1})
        await _wait_status(alice, task["taskId"], ("input_required",))
        bob_said: list[int] = []

        async def bob_first(question: dict) -> dict:
            declined = {"jsonrpc": "2.0", "id": question["id"], "result": {"action": "decline"}}
            status, _, _ = await asyncio.wait_for(bob.post(declined), 10)
            bob_said.append(status)
            status, message, _ = await asyncio.wait_for(
                alice.request("tasks/get", {"taskId": task["taskId"]}), 10
            )
            assert message["result"]["status"] == "input_required"  # still Alice's to answer
            return {"action": "accept", "content": {"confirm": True}}

        status, message, _ = await asyncio.wait_for(
            alice.request("tasks/result", {"taskId": task["taskId"]}, on_request=bob_first), 20
        )
        assert message["result"]["content"][0]["text"] == "deleted a.txt"
        assert bob_said and bob_said[0] < 500
    finally:
        await alice.close()
        await bob.close()


async def test_session_get_stream_carries_task_status_notifications(flow_proxy: RunningProxy) -> None:
    client = V1Client(flow_proxy.url())
    frames: list[dict] = []
    opened = asyncio.Event()

    async def read_get_stream() -> None:
        headers = {**client._headers(), "Accept": "text/event-stream"}
        async with client.http.get(client.url, headers=headers) as resp:
            assert resp.status == 200
            opened.set()
            async for event in iter_events(resp.content.iter_any()):
                if event.data:
                    frames.append(json.loads(event.data))
                    if frames[-1].get("params", {}).get("status") == "completed":
                        return

    try:
        await client.initialize()
        reader = asyncio.create_task(read_get_stream())
        async with asyncio.timeout(10):
            await opened.wait()
            task = await client.call_as_task(
                "slow_compute", {"seconds": 0.3}, meta={"progressToken": "tok-get"}
            )
            await reader
        pushed = [f["params"] for f in frames if f.get("method") == "notifications/tasks/status"]
        assert (
            pushed[-1]["taskId"] == task["taskId"]
            and pushed[-1]["status"] == "completed"
            and "ttl" in pushed[-1]
        )
        progress = [f["params"] for f in frames if f.get("method") == "notifications/progress"]
        assert progress and all(
            p["progressToken"] == "tok-get" and p["_meta"][RELATED] == {"taskId": task["taskId"]}
            for p in progress
        )
    finally:
        await client.close()


# --- status push for v2: subscriptions/listen with taskIds ---------------------------------------


async def _listen(
    client: ModernClient, task_ids: list[str], frames: list[dict], ready: asyncio.Event, count: int
) -> None:
    params = {"notifications": {"taskIds": task_ids}, "_meta": envelope(client.capabilities)}
    body = json.dumps(
        {"jsonrpc": "2.0", "id": "listen-1", "method": "subscriptions/listen", "params": params}
    )
    async with client.http.post(
        client.url, data=body, headers=client.headers_for("subscriptions/listen", params)
    ) as resp:
        assert resp.status == 200
        async for event in iter_events(resp.content.iter_any()):
            if event.data:
                frames.append(json.loads(event.data))
                ready.set()
                if len(frames) >= count:
                    return


async def test_listen_pushes_own_task_transitions_and_nothing_for_another_principal(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    auth = {
        "mode": "bearer",
        "tokens": {"alice": hash_token("alice-secret"), "bob": hash_token("bob-secret")},
    }
    proxy = await serve(with_auth(legacy_url, tmp_path, auth))
    caps = {"elicitation": {}, "extensions": {"io.modelcontextprotocol/tasks": {}}}
    alice = AuthClient(proxy.url(), {"Authorization": "Bearer alice-secret"}, capabilities=caps)
    bob = AuthClient(proxy.url(), {"Authorization": "Bearer bob-secret"}, capabilities=caps)
    try:
        # asks after 1 s: both listeners are subscribed by then, even on a loaded host
        mine = (await alice.call("confirm_delete", {"filename": "f", "delay": 1.0})).result["taskId"]
        theirs = (await bob.call("slow_compute", {"seconds": 0.4})).result["taskId"]
        frames: list[dict] = []
        bob_frames: list[dict] = []
        ready, bob_ready = asyncio.Event(), asyncio.Event()
        listener = asyncio.create_task(_listen(alice, [mine, theirs], frames, ready, count=4))
        spy = asyncio.create_task(_listen(bob, [mine], bob_frames, bob_ready, count=2))
        async with asyncio.timeout(10):
            await ready.wait()
            await bob_ready.wait()
            ack = frames[0]
            assert ack["method"] == "notifications/subscriptions/acknowledged" and ack["params"][
                "notifications"
            ] == {"taskIds": [mine]}
            asked = await alice.wait_status(mine, ("input_required",))
            key = next(iter(asked["inputRequests"]))
            await alice.request(
                "tasks/update",
                {
                    "taskId": mine,
                    "inputResponses": {key: {"action": "accept", "content": {"confirm": True}}},
                },
            )
            await listener
        pushed = [f for f in frames[1:] if f["method"] == "notifications/tasks"]
        assert [f["params"]["status"] for f in pushed] == ["input_required", "working", "completed"]
        assert all(
            f["params"]["taskId"] == mine
            and f["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == "listen-1"
            for f in pushed
        )
        assert (
            "inputRequests" in pushed[0]["params"]
            and pushed[-1]["params"]["result"]["content"][0]["text"] == "deleted f"
        )
        await bob.wait_terminal(theirs)
        assert bob_frames[0]["params"]["notifications"] == {"taskIds": []} and len(bob_frames) == 1
        spy.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await spy
    finally:
        await alice.close()
        await bob.close()


# --- rendering: one record, two dialects ---------------------------------------------------------


def test_one_record_renders_per_dialect() -> None:
    from support.records import make_record

    from proxy.tasks.model import TaskStatus
    from proxy.tasks.wire_v1 import create_task_result_v1, task_outcome_v1, tool_with_task_support, v1_task
    from proxy.tasks.wire_v2 import detailed_task

    failed_tool = make_record(
        status=TaskStatus.COMPLETED, outcome={"result": {"content": [], "isError": True, "extra": 1}}
    )
    assert v1_task(failed_tool)["status"] == "failed" and detailed_task(failed_tool)["status"] == "completed"
    result, error = task_outcome_v1(failed_tool)
    assert (
        error is None
        and result is not None
        and result["extra"] == 1
        and result["_meta"][RELATED] == {"taskId": "task-1"}
    )
    running = make_record(status_message="3/5")
    created = create_task_result_v1(running)["task"]
    assert (
        created["ttl"] == 60_000
        and created["pollInterval"] == 500
        and created["statusMessage"] == "3/5"
        and "ttlMs" not in created
    )
    upstream_error = make_record(
        status=TaskStatus.FAILED, outcome={"error": {"code": -32000, "message": "boom", "data": {"x": 1}}}
    )
    assert task_outcome_v1(upstream_error) == (None, {"code": -32000, "message": "boom", "data": {"x": 1}})
    assert tool_with_task_support({"name": "t", "execution": {"other": 1}}, "required")["execution"] == {
        "other": 1,
        "taskSupport": "required",
    }
    assert tool_with_task_support({"name": "t"}, "optional")["execution"] == {"taskSupport": "optional"}


def test_a_url_mode_question_reaches_a_v1_client_with_an_elicitation_id() -> None:
    """2025-11-25 requires `elicitationId` on a URL-mode elicitation; the stored question has none
    (the 2026-07-28 shape), so the v1 client gets the input key; a form question gets none."""
    url_mode = {
        "method": "elicitation/create",
        "params": {"mode": "url", "message": "Sign in", "url": "https://x"},
    }
    asked = question_request("mtp-1", "in_abc", url_mode, "task-1")
    assert asked["id"] == "mtp-1" and asked["params"]["elicitationId"] == "in_abc"
    assert asked["params"]["_meta"]["io.modelcontextprotocol/related-task"] == {"taskId": "task-1"}
    form = {"method": "elicitation/create", "params": {"message": "Sure?", "requestedSchema": {}}}
    assert "elicitationId" not in question_request("mtp-2", "in_def", form, "task-1")["params"]


async def test_a_v1_session_gets_its_status_stream_when_the_upstream_has_no_get_stream(
    tmp_path: Path, serve: Serve
) -> None:
    """An upstream that answers GET with 405: a 2025-11-25 session's GET still opens a stream, the
    proxy's own, carrying its v1 tasks' `notifications/tasks/status`."""
    upstream = ServerProcess(
        [sys.executable, str(ROOT / "tests" / "fixtures" / "hostile_upstream.py"), "--port", "0"]
    )
    try:
        proxy = await serve(make_config(f"{upstream.url}/ok/mcp", tmp_path / "store"))
        client = V1Client(proxy.url())
        try:
            await client.initialize()
            headers = {**client._headers(), "Accept": "text/event-stream"}
            async with client.http.get(proxy.url(), headers=headers) as stream:
                assert stream.status == 200 and stream.headers["Content-Type"].startswith("text/event-stream")
                task = await client.call_as_task("slow", {"seconds": 0.2})
                statuses = []
                async with asyncio.timeout(5):
                    async for event in iter_events(stream.content.iter_any()):
                        message = json.loads(event.data) if event.data else {}
                        if message.get("method") == "notifications/tasks/status":
                            assert message["params"]["taskId"] == task["taskId"]
                            statuses.append(message["params"]["status"])
                            if statuses[-1] == "completed":
                                break
            assert statuses[-1] == "completed", statuses
        finally:
            await client.close()
    finally:
        upstream.stop()


async def test_a_question_asked_before_the_get_stream_opens_is_offered_when_it_does(
    proxy: RunningProxy,
) -> None:
    """A v1 task already waiting for input when its session opens the GET stream (the client's GET
    started late, or reconnected): the question is offered on it, and the answer completes the task."""
    client = V1Client(proxy.url())
    try:
        await client.initialize()
        task = await client.call_as_task("confirm_delete", {"filename": "late.txt"})
        async with asyncio.timeout(5):
            while (await client.request("tasks/get", {"taskId": task["taskId"]}))[1]["result"]["status"] != (
                "input_required"
            ):
                await asyncio.sleep(0.05)
        headers = {**client._headers(), "Accept": "text/event-stream"}
        async with client.http.get(proxy.url(), headers=headers) as stream:
            async with asyncio.timeout(5):
                async for event in iter_events(stream.content.iter_any()):
                    message = json.loads(event.data) if event.data else {}
                    if message.get("method") == "elicitation/create":
                        break
            related = message["params"]["_meta"]["io.modelcontextprotocol/related-task"]
            assert related == {"taskId": task["taskId"]}
            answer = {"jsonrpc": "2.0", "id": message["id"], "result": {"action": "accept", "content": {}}}
            status, _, _ = await client.post(answer)
            assert status == 202
        async with asyncio.timeout(5):
            while (done := (await client.request("tasks/get", {"taskId": task["taskId"]}))[1]["result"])[
                "status"
            ] != "completed":
                await asyncio.sleep(0.05)
        assert done["status"] == "completed"
    finally:
        await client.close()


async def test_a_question_whose_get_stream_lost_its_reader_is_asked_again_on_tasks_result(
    proxy: RunningProxy,
) -> None:
    """The GET stream carried the question, then its connection dropped unanswered: a `tasks/result`
    asks it again at once (under a new id) instead of after the stream's 60 s linger."""
    client = V1Client(proxy.url())
    try:
        await client.initialize()
        headers = {**client._headers(), "Accept": "text/event-stream"}
        stream = await client.http.get(proxy.url(), headers=headers).__aenter__()
        task = await client.call_as_task("confirm_delete", {"filename": "dropped.txt"})
        async with asyncio.timeout(5):
            async for event in iter_events(stream.content.iter_any()):
                if event.data and json.loads(event.data).get("method") == "elicitation/create":
                    break
        stream.close()  # the reader is gone, the question unanswered
        asked: list[str] = []

        async def answer(question: dict) -> dict:
            asked.append(question["params"]["message"])
            return {"action": "accept", "content": {"confirm": True}}

        async with asyncio.timeout(8):
            status, final, _ = await client.request(
                "tasks/result", {"taskId": task["taskId"]}, on_request=answer
            )
        assert status == 200 and asked == ["Delete dropped.txt?"], (asked, final)
        assert final["result"]["content"][0]["text"] == "deleted dropped.txt"
    finally:
        await client.close()
