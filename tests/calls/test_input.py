"""Mid-flight input: legacy elicitation bridged into v2 tasks (`input_required` + `tasks/update`),
MRTR rounds (SEP-2322) for calls not yet detached, and legacy relay with rewritten ids."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import mcp.types as types
import pytest
from mcp.client.session import ClientRequestContext, ClientSession
from mcp.client.streamable_http import streamable_http_client
from support.clients import ModernClient
from support.proxy import RunningProxy, Serve, make_config, stdio_config

ELICIT_CAPS = {"elicitation": {}, "extensions": {"io.modelcontextprotocol/tasks": {}}}
ACCEPT = {"action": "accept", "content": {"confirm": True}}


async def released(client: ModernClient, label: str) -> bool:
    reply = await client.call("cancelled_log")
    return any(
        e["label"] == label and e["reason"].startswith("elicitation released")
        for e in json.loads(reply.result["content"][0]["text"])
    )


# -- detached calls (v2 task input) -----------------------------------------------------------


async def test_detached_call_question_becomes_input_required_and_update_resumes(
    flow_proxy: RunningProxy,
) -> None:
    client = ModernClient(flow_proxy.url(), capabilities=ELICIT_CAPS)
    try:
        await client.warm_up()  # the upstream session for these capabilities is open
        created = (await client.call("confirm_delete", {"filename": "a.txt", "delay": 0.2})).result
        assert created["resultType"] == "task"
        task = await client.wait_status(created["taskId"], ("input_required",), timeout=5)
        ((key, request),) = task["inputRequests"].items()
        assert request["method"] == "elicitation/create"
        assert request["params"]["message"] == "Delete a.txt?"
        assert request["params"]["requestedSchema"]["properties"]["confirm"]["type"] == "boolean"
        assert "_meta" not in request["params"]
        again = (await client.get(created["taskId"])).result
        assert again["inputRequests"] == task["inputRequests"]  # the same key on every poll, no duplicate
        ack = await client.request(
            "tasks/update", {"taskId": created["taskId"], "inputResponses": {key: ACCEPT}}
        )
        assert ack.result == {"resultType": "complete"}
        assert (await client.get(created["taskId"])).result["status"] in ("working", "completed")
        done = await client.wait_terminal(created["taskId"])
        assert done["status"] == "completed" and done["result"]["content"][0]["text"] == "deleted a.txt"
        assert (await flow_proxy.store.get(created["taskId"])).input_requests == {}
    finally:
        await client.close()


async def test_partial_answer_removes_exactly_the_answered_key_before_the_ack(
    flow_proxy: RunningProxy,
) -> None:
    client = ModernClient(flow_proxy.url(), capabilities=ELICIT_CAPS)
    try:
        await client.warm_up()  # the upstream session for these capabilities is open
        created = (await client.call("multi_input", {"delay": 0.2})).result
        async with asyncio.timeout(5):
            while len((task := (await client.get(created["taskId"])).result).get("inputRequests", {})) < 2:
                await asyncio.sleep(0.02)
        first, second = sorted(task["inputRequests"])
        assert first != second
        await client.request(
            "tasks/update",
            {
                "taskId": created["taskId"],
                "inputResponses": {first: {"action": "accept", "content": {"answer": "one"}}},
            },
        )
        after = (await client.get(created["taskId"])).result
        assert after["status"] == "input_required" and list(after["inputRequests"]) == [second]
        # Answering the same key again, or an unknown key, changes nothing.
        await client.request(
            "tasks/update",
            {
                "taskId": created["taskId"],
                "inputResponses": {first: {"action": "decline"}, "bogus": {"action": "accept"}},
            },
        )
        assert list((await client.get(created["taskId"])).result["inputRequests"]) == [second]
        await client.request(
            "tasks/update",
            {
                "taskId": created["taskId"],
                "inputResponses": {second: {"action": "accept", "content": {"answer": "two"}}},
            },
        )
        done = await client.wait_terminal(created["taskId"])
        answers = json.loads(done["result"]["content"][0]["text"])
        assert {answers["first"]["content"]["answer"], answers["second"]["content"]["answer"]} == {
            "one",
            "two",
        }
    finally:
        await client.close()


async def test_cancel_while_waiting_for_input_releases_the_upstream(flow_proxy: RunningProxy) -> None:
    client = ModernClient(flow_proxy.url(), capabilities=ELICIT_CAPS)
    try:
        await client.warm_up()  # the upstream session for these capabilities is open
        created = (await client.call("confirm_delete", {"filename": "cancel-me.txt", "delay": 0.2})).result
        await client.wait_status(created["taskId"], ("input_required",), timeout=5)
        ack = await client.request("tasks/cancel", {"taskId": created["taskId"]})
        assert ack.result == {"resultType": "complete"}
        task = (await client.get(created["taskId"])).result
        assert task["status"] == "cancelled" and "inputRequests" not in task
        async with asyncio.timeout(5):
            while not await released(client, "confirm_delete:cancel-me.txt"):
                await asyncio.sleep(0.05)
    finally:
        await client.close()


async def test_update_with_malformed_answers_is_refused_and_changes_nothing(proxy: RunningProxy) -> None:
    client = ModernClient(proxy.url(), capabilities=ELICIT_CAPS)
    try:
        await client.warm_up()  # the upstream session for these capabilities is open
        created = (await client.call("confirm_delete", {"filename": "m.txt", "delay": 0.2})).result
        task = await client.wait_status(created["taskId"], ("input_required",), timeout=5)
        key = next(iter(task["inputRequests"]))
        for bad in ({key: "yes"}, None, [ACCEPT]):
            reply = await client.request("tasks/update", {"taskId": created["taskId"], "inputResponses": bad})
            assert reply.error["code"] == -32602
        assert (await client.get(created["taskId"])).result["inputRequests"] == task["inputRequests"]
        await client.request("tasks/cancel", {"taskId": created["taskId"]})
    finally:
        await client.close()


async def test_input_timeout_fails_the_task_and_releases_the_upstream(
    legacy_url: str, tmp_path, serve: Serve
) -> None:
    server = {"tasks": {"tools": {"confirm_delete": {"input_timeout": "300ms"}}}}
    proxy = await serve(make_config(legacy_url, tmp_path / "s", server=server))
    client = ModernClient(proxy.url(), capabilities=ELICIT_CAPS)
    try:
        await client.warm_up()  # the upstream session for these capabilities is open
        created = (await client.call("confirm_delete", {"filename": "slow.txt", "delay": 0.2})).result
        done = await client.wait_terminal(created["taskId"], timeout=5)
        assert done["status"] == "failed"
        assert "input timed out" in done["error"]["message"] and "input timed out" in done["statusMessage"]
        async with asyncio.timeout(5):
            while not await released(client, "confirm_delete:slow.txt"):
                await asyncio.sleep(0.05)
    finally:
        await client.close()


# -- MRTR rounds (call not yet detached) ------------------------------------------------------


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_mrtr_round_then_retry_finishes_synchronously(
    transport: str, legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """The retry that answers the round ends the call with its result. The tool's `detach_after` is
    5 s, so that a loaded host cannot turn the retry into a task for the client that declares tasks
    (at the suite's 50 ms it did, once)."""
    patient = {"tasks": {"tools": {"confirm_delete": {"detach_after": "5s"}}}}
    if transport == "http":
        config = make_config(legacy_url, tmp_path / "store", server=patient)
    else:
        config = stdio_config(tmp_path, server=patient)
    proxy = await serve(config)
    for caps in ({"elicitation": {}}, ELICIT_CAPS):
        client = ModernClient(proxy.url(), capabilities=caps)
        try:
            await client.warm_up()  # the upstream session for these capabilities is open
            args = {"filename": "mrtr.txt"}
            first = (await client.call("confirm_delete", args)).result
            assert first["resultType"] == "input_required" and "taskId" not in first
            assert isinstance(first["requestState"], str)
            ((key, request),) = first["inputRequests"].items()
            assert (
                request["method"] == "elicitation/create"
                and request["params"]["message"] == "Delete mrtr.txt?"
            )
            retry = {
                "name": "confirm_delete",
                "arguments": args,
                "inputResponses": {key: ACCEPT},
                "requestState": first["requestState"],
            }
            final = (await client.request("tools/call", retry)).result
            assert final["resultType"] == "complete" and final["content"][0]["text"] == "deleted mrtr.txt"
        finally:
            await client.close()


async def test_mrtr_then_long_work_becomes_a_task(flow_proxy: RunningProxy) -> None:
    client = ModernClient(flow_proxy.url(), capabilities=ELICIT_CAPS)
    try:
        await client.warm_up()  # the upstream session for these capabilities is open
        args = {"seconds": 0.4}
        first = (await client.call("ask_then_work", args)).result
        assert first["resultType"] == "input_required"
        key = next(iter(first["inputRequests"]))
        retry = {
            "name": "ask_then_work",
            "arguments": args,
            "inputResponses": {key: {"action": "accept", "content": {"name": "Alice"}}},
            "requestState": first["requestState"],
        }
        created = (await client.request("tools/call", retry)).result
        assert (
            created["resultType"] == "task"
            and "requestState" not in created
            and "inputRequests" not in created
        )
        done = await client.wait_terminal(created["taskId"])
        assert "Alice" in done["result"]["content"][0]["text"]
    finally:
        await client.close()


async def test_required_tool_asks_in_mrtr_rounds_then_is_a_task_even_when_its_result_comes_first(
    legacy_url: str, tmp_path, serve: Serve
) -> None:
    """`mode: required` composes with MRTR (SEP-2663): a question asked before the task exists is an
    MRTR round, and the final round mints the task, even when the upstream's result is there before
    `detach_after` (never a synchronous result); -32021 without the extension."""
    server = {"tasks": {"tools": {"ask_then_work": {"mode": "required", "detach_after": "2s"}}}}
    proxy = await serve(make_config(legacy_url, tmp_path / "s", server=server))
    client = ModernClient(proxy.url(), capabilities=ELICIT_CAPS)
    try:
        await client.warm_up()  # the upstream session for these capabilities is open
        args = {"seconds": 0, "key_hint": "name"}
        first = (await client.call("ask_then_work", args)).result
        assert (
            first["resultType"] == "input_required"
            and "taskId" not in first
            and list(first["inputRequests"]) == ["name"]
        )
        retry = {
            "name": "ask_then_work",
            "arguments": args,
            "inputResponses": {"name": {"action": "accept", "content": {"name": "Ada"}}},
            "requestState": first["requestState"],
        }
        created = (await client.request("tools/call", retry)).result
        assert (
            created["resultType"] == "task"
            and "requestState" not in created
            and "inputRequests" not in created
        )
        done = await client.wait_terminal(created["taskId"])
        assert (
            done["status"] == "completed"
            and done["result"]["content"][0]["text"] == "Hello Ada, the work took 0s"
        )
        refused = await client.call("ask_then_work", args, capabilities={"elicitation": {}})
        assert refused.status == 400 and refused.error["code"] == -32021
    finally:
        await client.close()


async def test_concurrent_questions_share_one_round_and_partial_answers_get_a_new_round(
    proxy: RunningProxy,
) -> None:
    client = ModernClient(proxy.url(), capabilities={"elicitation": {}})
    try:
        first = (await client.call("multi_input", {})).result
        assert first["resultType"] == "input_required" and len(first["inputRequests"]) == 2
        k1, k2 = sorted(first["inputRequests"])
        retry = {
            "name": "multi_input",
            "arguments": {},
            "inputResponses": {k1: {"action": "accept", "content": {"answer": "one"}}},
            "requestState": first["requestState"],
        }
        second = (await client.request("tools/call", retry)).result
        assert second["resultType"] == "input_required" and list(second["inputRequests"]) == [k2]
        assert second["requestState"] != first["requestState"]
        retry = {
            **retry,
            "inputResponses": {k2: {"action": "accept", "content": {"answer": "two"}}},
            "requestState": second["requestState"],
        }
        final = (await client.request("tools/call", retry)).result
        answers = json.loads(final["content"][0]["text"])
        assert {answers["first"]["content"]["answer"], answers["second"]["content"]["answer"]} == {
            "one",
            "two",
        }
    finally:
        await client.close()


async def test_tampered_foreign_and_replayed_state_are_refused_and_touch_nothing(proxy: RunningProxy) -> None:
    client = ModernClient(proxy.url(), capabilities={"elicitation": {}})
    try:
        args = {"filename": "state.txt"}
        first = (await client.call("confirm_delete", args)).result
        key, state = next(iter(first["inputRequests"])), first["requestState"]
        head, payload, sig = state.split(".")
        flipped = payload[:-2] + ("A" if payload[-2] != "A" else "B") + payload[-1]
        for bad_state, bad_args in (
            (f"{head}.{flipped}.{sig}", args),
            (state[:-3] + "abc", args),
            ("garbage", args),
            (42, args),
            (state, {"filename": "other.txt"}),
        ):
            reply = await client.request(
                "tools/call",
                {
                    "name": "confirm_delete",
                    "arguments": bad_args,
                    "inputResponses": {key: ACCEPT},
                    "requestState": bad_state,
                },
            )
            assert reply.error["code"] == -32602, (bad_state, reply.message)
        # Nothing was touched: the genuine retry still works, once.
        good = {
            "name": "confirm_delete",
            "arguments": args,
            "inputResponses": {key: ACCEPT},
            "requestState": state,
        }
        assert (await client.request("tools/call", good)).result["content"][0]["text"] == "deleted state.txt"
        replay = await client.request("tools/call", good)
        assert replay.error["code"] == -32602
    finally:
        await client.close()


async def test_replayed_state_of_an_earlier_round_is_refused(proxy: RunningProxy) -> None:
    client = ModernClient(proxy.url(), capabilities={"elicitation": {}})
    try:
        first = (await client.call("multi_input", {})).result
        k1, k2 = sorted(first["inputRequests"])
        retry = {
            "name": "multi_input",
            "arguments": {},
            "inputResponses": {k1: {"action": "accept", "content": {"answer": "x"}}},
            "requestState": first["requestState"],
        }
        second = (await client.request("tools/call", retry)).result
        assert second["resultType"] == "input_required"
        replay = await client.request("tools/call", retry)
        assert replay.error["code"] == -32602
        retry = {
            **retry,
            "inputResponses": {k2: {"action": "accept", "content": {"answer": "y"}}},
            "requestState": second["requestState"],
        }
        assert (await client.request("tools/call", retry)).result["resultType"] == "complete"
    finally:
        await client.close()


async def test_unretried_mrtr_round_expires_and_releases_the_upstream(
    legacy_url: str, tmp_path, serve: Serve
) -> None:
    server = {"tasks": {"tools": {"confirm_delete": {"input_timeout": "200ms"}}}}
    proxy = await serve(make_config(legacy_url, tmp_path / "s", server=server))
    client = ModernClient(proxy.url(), capabilities={"elicitation": {}})
    try:
        args = {"filename": "expire.txt"}
        first = (await client.call("confirm_delete", args)).result
        async with asyncio.timeout(5):
            while not await released(client, "confirm_delete:expire.txt"):
                await asyncio.sleep(0.05)
        key = next(iter(first["inputRequests"]))
        late = await client.request(
            "tools/call",
            {
                "name": "confirm_delete",
                "arguments": args,
                "inputResponses": {key: ACCEPT},
                "requestState": first["requestState"],
            },
        )
        assert late.error["code"] == -32602
    finally:
        await client.close()


async def test_answers_supplied_up_front_are_used_by_key_hint(proxy: RunningProxy) -> None:
    client = ModernClient(proxy.url(), capabilities={"elicitation": {}})
    try:
        args = {"filename": "hint.txt", "key_hint": "confirm"}
        reply = await client.request(
            "tools/call",
            {
                "name": "confirm_delete",
                "arguments": args,
                "inputResponses": {"confirm": ACCEPT, "extra": {"x": 1}},
            },
        )
        assert reply.result["content"][0]["text"] == "deleted hint.txt"
        wrong = (
            await client.request(
                "tools/call",
                {"name": "confirm_delete", "arguments": args, "inputResponses": {"nope": ACCEPT}},
            )
        ).result
        assert wrong["resultType"] == "input_required" and list(wrong["inputRequests"]) == ["confirm"]
    finally:
        await client.close()


async def test_question_the_client_cannot_answer_is_missing_capability(proxy: RunningProxy) -> None:
    # The upstream session is opened without elicitation, so the SDK server refuses to ask;
    # the tool then fails upstream, and no question ever reaches this client.
    client = ModernClient(proxy.url(), capabilities={})
    try:
        await client.warm_up()  # the upstream session for these capabilities is open
        reply = await client.call("confirm_delete", {"filename": "nocap.txt"})
        assert reply.status == 400, reply.message
        assert reply.error["code"] == -32021, reply.error
        assert "elicitation" in reply.error["data"]["requiredCapabilities"], reply.error
    finally:
        await client.close()


# -- legacy clients ---------------------------------------------------------------------------


async def test_two_legacy_clients_each_answer_their_own_question(proxy: RunningProxy) -> None:
    seen_ids: list = []

    async def run(answer: bool, filename: str) -> str:
        async def on_elicit(
            context: ClientRequestContext, params: types.ElicitRequestParams
        ) -> types.ElicitResult:
            seen_ids.append(context.request_id)
            await asyncio.sleep(0.1)  # both questions are outstanding at the same time
            return types.ElicitResult(action="accept", content={"confirm": answer})

        async with streamable_http_client(proxy.url()) as (read, write):
            async with ClientSession(read, write, elicitation_callback=on_elicit) as session:
                await session.initialize()
                result = await session.call_tool("confirm_delete", {"filename": filename})
                return result.content[0].text

    results = await asyncio.gather(run(True, "one.txt"), run(False, "two.txt"), run(True, "three.txt"))
    assert results == ["deleted one.txt", "kept two.txt", "deleted three.txt"]
    # The upstream numbers its questions 1, 2, … per session; clients see distinct proxy-minted ids.
    assert len(set(seen_ids)) == 3 and all(str(i).startswith("mtp-") for i in seen_ids)


async def test_request_state_is_bound_to_principal_and_server(
    legacy_url: str, tmp_path, serve: Serve
) -> None:
    from support.clients import AuthClient

    from proxy.config import config_from_data
    from proxy.front.auth import hash_token

    config = config_from_data(
        {
            "store": {"path": str(tmp_path / "store"), "durable": False},
            "auth": {
                "mode": "bearer",
                "tokens": {
                    "alice": hash_token("alice-token-for-tests"),
                    "bob": hash_token("bob-token-for-tests"),
                },
            },
            "mcpServers": {"x": {"url": legacy_url}, "y": {"url": legacy_url}},
        }
    )
    proxy = await serve(config)
    alice = AuthClient(
        proxy.url("x"), {"Authorization": "Bearer alice-token-for-tests"}, capabilities={"elicitation": {}}
    )
    bob = AuthClient(
        proxy.url("x"), {"Authorization": "Bearer bob-token-for-tests"}, capabilities={"elicitation": {}}
    )
    alice_on_y = AuthClient(
        proxy.url("y"), {"Authorization": "Bearer alice-token-for-tests"}, capabilities={"elicitation": {}}
    )
    try:
        args = {"filename": "owned.txt"}
        first = (await alice.call("confirm_delete", args)).result
        key = next(iter(first["inputRequests"]))
        retry = {
            "name": "confirm_delete",
            "arguments": args,
            "inputResponses": {key: ACCEPT},
            "requestState": first["requestState"],
        }
        assert (await bob.request("tools/call", retry)).error["code"] == -32602  # another principal
        assert (await alice_on_y.request("tools/call", retry)).error["code"] == -32602  # another server
        assert (await alice.request("tools/call", retry)).result["content"][0]["text"] == "deleted owned.txt"
    finally:
        for c in (alice, bob, alice_on_y):
            await c.close()


async def test_request_state_key_is_generated_once_beside_the_store(
    legacy_url: str, tmp_path, serve: Serve
) -> None:
    import stat

    key_file = tmp_path / "store" / "request_state.key"
    _proxy = await serve(make_config(legacy_url, tmp_path / "store"))
    first = key_file.read_text()
    await _proxy.stop()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and len(bytes.fromhex(first)) == 32
    _proxy = await serve(make_config(legacy_url, tmp_path / "store"))
    assert key_file.read_text() == first  # kept across restarts
    await _proxy.stop()
    config = make_config(legacy_url, tmp_path / "other")
    config.request_state.secret = "s" * 32
    _proxy = await serve(config)
    assert not (tmp_path / "other" / "request_state.key").exists()  # the configured secret is used


async def test_a_lone_surrogate_in_request_state_or_arguments_is_an_error_not_a_500(
    proxy: RunningProxy,
) -> None:
    """A `requestState` and arguments that do not encode as UTF-8 (a lone surrogate, a valid JSON
    escape) get a JSON-RPC error, never a 500: the state is refused as not issued here (-32602)."""
    client = ModernClient(proxy.url(), capabilities={"elicitation": {}})
    try:
        retry = {
            "name": "confirm_delete",
            "arguments": {"filename": "x"},
            "inputResponses": {"k": ACCEPT},
            "requestState": "\ud800",
        }
        reply = await client.request("tools/call", retry)
        assert reply.status == 400 and reply.error["code"] == -32602, reply
        # The arguments pass on as they came (the upstream's parser refuses them): an error, not a 500.
        odd = await client.call("confirm_delete", {"filename": "\ud800"})
        assert odd.status < 500 and "error" in odd.message, odd
    finally:
        await client.close()
