"""OpenTelemetry tracing, in-process with the SDK's in-memory exporter: context read from the
`traceparent` header and from `params._meta` (which wins) on both eras, passed on to the upstream in
both forms, one span per inbound request and per upstream request, a `task` span for a detached
call with its events and links, the trace id on the task record, the console and log lines; and
nothing at all while tracing is off."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import structlog
import yarl
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.clients import LEGACY_INITIALIZE, ModernClient
from support.console import CONSOLE_TOKEN
from support.proxy import RunningProxy, Serve, make_config, stdio_config
from support.servers import run_cli
from support.v1_client import V1Client

from proxy.config import ConfigError, ConsoleConfig, TracingConfig, config_from_data
from proxy.front.auth import hash_token
from proxy.runtime import tracing
from proxy.runtime.logs import configure_logging

ELICIT_CAPS = {"elicitation": {}, "extensions": {"io.modelcontextprotocol/tasks": {}}}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
HEADER_TRACE = "0af7651916cd43dd8448eb211c80319c"
HEADER_SPAN = "b7ad6b7169203331"


def traceparent(trace_id: str, span_id: str) -> str:
    return f"00-{trace_id}-{span_id}-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on for the test, every finished span kept in memory; off again after it."""
    exporter = InMemorySpanExporter()
    assert tracing.install(TracingConfig(), processor=SimpleSpanProcessor(exporter))
    try:
        yield exporter
    finally:
        tracing.shutdown()


class Logs:
    """What the proxy logged on stderr (pytest's capture) since the last look."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys

    def getvalue(self) -> str:
        return self.capsys.readouterr().err


@pytest.fixture
def json_logs(capsys: pytest.CaptureFixture[str]) -> Iterator[Logs]:
    """The proxy's logging as the command line configures it (JSON lines on stderr); structlog's
    defaults again afterwards, and no logger caching meanwhile, so later tests' captures work."""
    configure_logging("info", cache_loggers=False)
    try:
        yield Logs(capsys)
    finally:
        structlog.reset_defaults()


def by_name(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def echoed(reply_text: str) -> tuple[dict, dict]:
    """The `_meta` and headers the fixture's `echo_meta` tool saw."""
    payload = json.loads(reply_text)
    return payload["meta"] or {}, payload["headers"]


def trace_hex(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"{span.context.trace_id:032x}"


async def test_a_modern_call_joins_the_clients_trace_and_the_upstream_gets_it_in_both_forms(
    spans: InMemorySpanExporter, legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    proxy = await serve(make_config(legacy_url, tmp_path / "store"))
    client = ModernClient(proxy.url(), capabilities={})
    try:
        reply = await client.call(
            "echo_meta",
            {},
            meta={"traceparent": traceparent(CLIENT_TRACE, CLIENT_SPAN)},
            headers={"traceparent": traceparent(HEADER_TRACE, HEADER_SPAN)},
        )
    finally:
        await client.close()
    meta, headers = echoed(reply.result["content"][0]["text"])
    (inbound,) = by_name(spans, "tools/call echo_meta")[-1:]
    # _meta wins over the header
    assert trace_hex(inbound) == CLIENT_TRACE and inbound.parent is not None
    assert f"{inbound.parent.span_id:016x}" == CLIENT_SPAN
    assert inbound.attributes is not None
    assert inbound.attributes["mcp.method.name"] == "tools/call"
    assert inbound.attributes["gen_ai.tool.name"] == "echo_meta"
    assert inbound.attributes["mcp_tasks_proxy.server"] == "legacy"
    assert inbound.attributes["mcp_tasks_proxy.era"] == "modern"
    assert inbound.attributes["mcp_tasks_proxy.outcome"] == "sync"
    assert len(str(inbound.attributes["mcp_tasks_proxy.principal_hash"])) == 16
    upstream = [
        s for s in spans.get_finished_spans() if s.kind.name == "CLIENT" and s.name == "tools/call echo_meta"
    ]
    assert upstream and upstream[-1].parent is not None
    assert upstream[-1].parent.span_id == inbound.context.span_id  # type: ignore[union-attr]
    # the upstream received the same trace: in _meta (from the upstream span) and as a header (from
    # the HTTP exchange's span, a child of it)
    assert meta["traceparent"].split("-")[1] == CLIENT_TRACE
    assert meta["traceparent"].split("-")[2] == f"{upstream[-1].context.span_id:016x}"  # type: ignore[union-attr]
    assert headers["traceparent"].split("-")[1] == CLIENT_TRACE
    http = [s for s in spans.get_finished_spans() if s.name == "POST" and trace_hex(s) == CLIENT_TRACE]
    assert http, "the aiohttp client instrumentation traced the HTTP exchange"
    # the call opened the upstream session; its GET stream outlives the request and is in no trace of it
    assert not [s for s in spans.get_finished_spans() if s.name == "GET" and trace_hex(s) == CLIENT_TRACE]
    for span in spans.get_finished_spans():
        for value in (span.attributes or {}).values():
            assert 'echo_meta"' not in str(value)  # no payloads


async def test_the_header_alone_carries_the_context_and_its_baggage_and_meta_wins_on_the_legacy_wire(
    spans: InMemorySpanExporter, legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    proxy = await serve(make_config(legacy_url, tmp_path / "store"))
    client = ModernClient(proxy.url(), capabilities={})
    try:
        header = {"traceparent": traceparent(HEADER_TRACE, HEADER_SPAN), "baggage": "tenant=acme"}
        echo = await client.call("echo_meta", {}, headers=header)
    finally:
        await client.close()
    (inbound,) = [s for s in by_name(spans, "tools/call echo_meta") if s.kind.name == "SERVER"][:1]
    assert trace_hex(inbound) == HEADER_TRACE
    meta, _ = echoed(echo.result["content"][0]["text"])
    assert meta["traceparent"].split("-")[1] == HEADER_TRACE
    assert meta["baggage"] == "tenant=acme"  # the client's baggage goes on with its context

    # the legacy era (2025-11-25): a relayed request's span, and the upstream sees the context;
    # `_meta` wins over the header here too
    spans.clear()

    async with aiohttp.ClientSession() as http:
        head = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
        async with http.post(proxy.url(), json=LEGACY_INITIALIZE, headers=head) as resp:
            sid = resp.headers["Mcp-Session-Id"]
            await resp.read()
        head = {**head, "Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-11-25"}
        async with http.post(
            proxy.url(),
            json={"jsonrpc": "2.0", "method": "notifications/initialized"},
            headers=head,
        ) as resp:
            await resp.read()
        call = {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {
                "name": "echo_meta",
                "arguments": {},
                "_meta": {"traceparent": traceparent(CLIENT_TRACE, CLIENT_SPAN)},
            },
        }
        async with http.post(
            proxy.url(), json=call, headers={**head, "traceparent": traceparent(HEADER_TRACE, HEADER_SPAN)}
        ) as resp:
            text = await resp.text()
    events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    data = next(json.loads(event) for event in events if event) if events else json.loads(text)
    meta, headers = echoed(data["result"]["content"][0]["text"])
    legacy = [s for s in by_name(spans, "tools/call echo_meta") if s.kind.name == "SERVER"]
    assert legacy and trace_hex(legacy[0]) == CLIENT_TRACE
    assert legacy[0].attributes is not None and legacy[0].attributes["mcp_tasks_proxy.era"] == "legacy"
    assert meta["traceparent"].split("-")[1] == CLIENT_TRACE
    assert headers["traceparent"].split("-")[1] == CLIENT_TRACE


async def test_a_detached_call_has_a_task_span_from_creation_to_its_end_linked_to_each_request(
    spans: InMemorySpanExporter, legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    config = make_config(legacy_url, tmp_path / "store")
    config.console = ConsoleConfig.model_validate({"tokens": {"alice": hash_token(CONSOLE_TOKEN)}})
    proxy = await serve(config)
    client = ModernClient(proxy.url(), capabilities=ELICIT_CAPS)
    context = {"traceparent": traceparent(CLIENT_TRACE, CLIENT_SPAN)}
    try:
        await client.warm_up()
        created = (
            await client.call("confirm_delete", {"filename": "a.txt", "delay": 0.2}, meta=context)
        ).result
        task_id = created["taskId"]
        task = await client.wait_status(task_id, ("input_required",), timeout=5)
        ((key, _),) = task["inputRequests"].items()
        answer = {key: {"action": "accept", "content": {"confirm": True}}}
        await client.request("tasks/update", {"taskId": task_id, "inputResponses": answer})
        done = await client.wait_terminal(task_id)
    finally:
        await client.close()
    assert done["status"] == "completed"
    record = await proxy.store.get(task_id)
    assert record is not None and record.trace is not None and record.trace.split("-")[1] == CLIENT_TRACE
    async with aiohttp.ClientSession() as http:  # the console's task detail shows the trace id
        bearer = {"Authorization": f"Bearer {CONSOLE_TOKEN}"}
        async with http.get(f"{proxy.base}/console/api/tasks/{task_id}", headers=bearer) as resp:
            assert resp.status == 200
            assert (await resp.json())["traceId"] == CLIENT_TRACE
    task_spans = [
        s for s in by_name(spans, "task") if (s.attributes or {}).get("mcp_tasks_proxy.task_id") == task_id
    ]
    assert len(task_spans) == 1
    (task_span,) = task_spans
    assert trace_hex(task_span) == CLIENT_TRACE
    events = [event.name for event in task_span.events]
    assert events[0] == "detached" and "input_requested" in events and "input_answered" in events
    assert events[-1] == "completed"
    creator = by_name(spans, "tools/call confirm_delete")
    creator_server = [s for s in creator if s.kind.name == "SERVER"]
    # a trace search by task id finds the request that created it too, not only the task's span
    assert (creator_server[0].attributes or {}).get("mcp_tasks_proxy.task_id") == task_id
    assert task_span.parent is not None and task_span.parent.span_id == creator_server[0].context.span_id  # type: ignore[union-attr]
    # every tasks/get and tasks/update links to the task span
    task_span_id = task_span.context.span_id  # type: ignore[union-attr]
    for name in ("tasks/get", "tasks/update"):
        touching = [
            s for s in by_name(spans, name) if any(link.context.span_id == task_span_id for link in s.links)
        ]
        assert touching, name
    # the task span links back to the tasks/update that answered
    updates = {s.context.span_id for s in by_name(spans, "tasks/update")}  # type: ignore[union-attr]
    assert any(link.context.span_id in updates for link in task_span.links)


async def test_a_v1_task_call_span_names_the_task_it_created(
    spans: InMemorySpanExporter, flow_proxy: RunningProxy
) -> None:
    client = V1Client(flow_proxy.url())
    try:
        await client.initialize()
        task = await client.call_as_task("slow_compute", {"seconds": 0.05})
    finally:
        await client.close()
    server_spans = [s for s in by_name(spans, "tools/call slow_compute") if s.kind.name == "SERVER"]
    assert [(s.attributes or {}).get("mcp_tasks_proxy.task_id") for s in server_spans] == [task["taskId"]]


async def test_log_lines_carry_the_trace_and_the_stdio_upstream_gets_the_context_in_meta(
    spans: InMemorySpanExporter, tmp_path: Path, serve: Serve, json_logs: Logs
) -> None:
    proxy = await serve(stdio_config(tmp_path))
    client = ModernClient(proxy.url(), capabilities={})
    try:
        reply = await client.call(
            "echo_meta", {}, headers={"traceparent": traceparent(HEADER_TRACE, HEADER_SPAN)}
        )
    finally:
        await client.close()
    meta, _ = echoed(reply.result["content"][0]["text"])
    assert meta["traceparent"].split("-")[1] == HEADER_TRACE
    lines = [json.loads(line) for line in json_logs.getvalue().splitlines() if line.startswith("{")]
    request_lines = [
        line for line in lines if line.get("event") == "request" and line.get("tool") == "echo_meta"
    ]
    assert request_lines and request_lines[-1]["trace_id"] == HEADER_TRACE
    assert len(request_lines[-1]["span_id"]) == 16


async def test_tracing_off_changes_nothing_and_starts_no_exporter(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    assert not tracing.enabled()
    assert not tracing.wanted(TracingConfig(), environ={})
    assert tracing.wanted(TracingConfig(), environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert not tracing.wanted(
        TracingConfig(otlp_endpoint="http://127.0.0.1:4318/v1/traces"), environ={"OTEL_SDK_DISABLED": "true"}
    )
    before = {thread.name for thread in threading.enumerate()}
    proxy = await serve(make_config(legacy_url, tmp_path / "store"))
    client = ModernClient(proxy.url(), capabilities={})
    try:
        reply = await client.call(
            "echo_meta", {}, meta={"traceparent": traceparent(CLIENT_TRACE, CLIENT_SPAN)}
        )
    finally:
        await client.close()
    meta, headers = echoed(reply.result["content"][0]["text"])
    assert meta.get("traceparent") == traceparent(CLIENT_TRACE, CLIENT_SPAN)  # passed through untouched
    assert "traceparent" not in headers
    assert not tracing.enabled()
    assert not [
        name for name in {t.name for t in threading.enumerate()} - before if name.startswith("OtelBatch")
    ]
    # the same check sees the exporter's thread once tracing is on
    on = TracingConfig(otlp_endpoint="http://127.0.0.1:9/v1/traces")
    assert tracing.install(on, environ={})
    try:
        assert [t.name for t in threading.enumerate() if t.name.startswith("OtelBatch")]
    finally:
        tracing.shutdown()


async def test_a_tool_name_that_is_no_text_still_exports(
    spans: InMemorySpanExporter, legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """A lone surrogate in a client's tool name (and request id) reaches the spans as text that
    encodes, so the OTLP encoding of the batch holding it does not fail."""
    proxy = await serve(make_config(legacy_url, tmp_path / "store"))
    client = ModernClient(proxy.url(), capabilities={})
    try:
        body = json.dumps(
            {
                "jsonrpc": "2.0",
                "id": "\ud800",
                "method": "tools/call",
                "params": {"name": "\ud800x", "arguments": {}},
            }
        )
        await client.post_raw(body.encode(), client.headers_for("tools/call", {"name": "x"}))
    finally:
        await client.close()
    finished = spans.get_finished_spans()
    assert finished
    encode_spans(finished).SerializeToString()


def test_the_tracing_section_is_checked() -> None:
    with pytest.raises(ConfigError, match="otlp_endpoint"):
        config_from_data(
            {
                "tracing": {"otlp_endpoint": "grpc://collector:4317"},
                "mcpServers": {"a": {"url": "http://127.0.0.1:1/mcp"}},
            }
        )
    with pytest.raises(ConfigError, match="sample_ratio"):
        config_from_data(
            {"tracing": {"sample_ratio": 2}, "mcpServers": {"a": {"url": "http://127.0.0.1:1/mcp"}}}
        )
    assert tracing.sample_ratio(TracingConfig(), environ={"OTEL_TRACES_SAMPLER_ARG": "0.25"}) == 0.25
    assert (
        tracing.sample_ratio(TracingConfig(sample_ratio=0.5), environ={"OTEL_TRACES_SAMPLER_ARG": "0.25"})
        == 0.5
    )


def test_context_in_meta_wins_and_bad_values_are_ignored() -> None:
    header = {"traceparent": traceparent(HEADER_TRACE, HEADER_SPAN)}
    meta = {"_meta": {"traceparent": traceparent(CLIENT_TRACE, CLIENT_SPAN)}}
    assert tracing.extract(header, meta) is not None
    from opentelemetry import trace

    def trace_of(found) -> str:
        return f"{trace.get_current_span(found).get_span_context().trace_id:032x}"

    assert trace_of(tracing.extract(header, meta)) == CLIENT_TRACE
    assert trace_of(tracing.extract(header, meta, prefer_headers=True)) == HEADER_TRACE
    assert trace_of(tracing.extract(header, {"_meta": {"traceparent": "garbage"}})) == HEADER_TRACE
    assert tracing.extract({}, {"_meta": {"traceparent": 7}}) is None
    assert tracing.extract({"traceparent": "00-" + "0" * 32 + "-" + "0" * 16 + "-01"}, None) is None
    assert tracing.span_name("tools/call", "x") == "tools/call x"
    assert tracing.span_name("no spaces allowed here", None) == "jsonrpc"
    assert tracing.trace_id_of(traceparent(CLIENT_TRACE, CLIENT_SPAN)) == CLIENT_TRACE
    assert tracing.with_meta({"a": 1}) == {"a": 1}  # off: untouched
    # URLs in the HTTP spans lose their credentials and query
    found = tracing.safe_url(yarl.URL("http://user:secret@up.example:9000/mcp?api_key=k#x"))
    assert found == "http://up.example:9000/mcp"


def test_check_config_tells_what_tracing_does_and_refuses_what_cannot_work(tmp_path: Path) -> None:
    """check-config prints the tracing line; an invalid OTEL_TRACES_SAMPLER_ARG or an endpoint with a
    query is a config problem (exit 2, one line), at check time and at start, never a traceback."""
    path = tmp_path / "proxy.yaml"
    path.write_text(
        "store: {path: store}\n"
        "tracing: {otlp_endpoint: 'http://127.0.0.1:4318/v1/traces', sample_ratio: 0.25}\n"
        "mcpServers: {a: {url: 'http://127.0.0.1:9/mcp'}}\n"
    )
    done = run_cli("check-config", str(path))
    assert done.returncode == 0, done.stderr
    assert "tracing: OTLP/HTTP to http://127.0.0.1:4318/v1/traces, sample ratio 0.25" in done.stdout
    path.write_text("store: {path: store}\nmcpServers: {a: {url: 'http://127.0.0.1:9/mcp'}}\n")
    assert "tracing: off" in run_cli("check-config", str(path)).stdout
    bad = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_TRACES_SAMPLER_ARG": "abc"}
    for args in (("check-config", str(path)), ("--config", str(path), "--port", "0")):
        done = run_cli(*args, env=bad)
        assert done.returncode == 2 and "OTEL_TRACES_SAMPLER_ARG" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    leaky = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318/?api_key=secret"}
    done = run_cli("check-config", str(path), env=leaky)
    assert done.returncode == 2 and "OTEL_EXPORTER_OTLP_HEADERS" in done.stderr
    assert "secret" not in done.stderr
    with pytest.raises(ConfigError, match="no user, password or query"):
        config_from_data(
            {
                "tracing": {"otlp_endpoint": "http://collector:4318/v1/traces?api_key=s"},
                "mcpServers": {"a": {"url": "http://127.0.0.1:1/mcp"}},
            }
        )


async def test_an_error_in_an_http_200_marks_the_span_and_a_probe_makes_no_trace(
    spans: InMemorySpanExporter, legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    """A tools/call answered with a JSON-RPC error marks its span failed whatever the HTTP status;
    /readyz (which asks the upstream for its tools) and other work outside a request trace nothing."""
    proxy = await serve(make_config(legacy_url, tmp_path / "store"))
    client = ModernClient(proxy.url(), capabilities={})
    try:
        await client.call("instant_error", {})
    finally:
        await client.close()
    (failed,) = [s for s in by_name(spans, "tools/call instant_error") if s.kind.name == "SERVER"]
    assert failed.status.status_code.name == "ERROR"
    assert failed.attributes is not None and failed.attributes["mcp_tasks_proxy.outcome"] == "error"
    spans.clear()
    async with aiohttp.ClientSession() as http, http.get(f"{proxy.base}/readyz") as resp:
        assert resp.status == 200
    assert spans.get_finished_spans() == ()


async def test_an_unsampled_task_stores_no_trace_id_and_logs_carry_none(
    legacy_url: str, tmp_path: Path, serve: Serve, json_logs: Logs
) -> None:
    """At sample_ratio 0 nothing is exported, so no trace id is kept on the record (the console
    would show one that leads nowhere) and no log line carries one."""
    exporter = InMemorySpanExporter()
    assert tracing.install(TracingConfig(sample_ratio=0.0), processor=SimpleSpanProcessor(exporter))
    try:
        proxy = await serve(make_config(legacy_url, tmp_path / "store"))
        client = ModernClient(proxy.url())
        try:
            created = (await client.call("slow_compute", {"seconds": 0.2, "label": "unsampled"})).result
            await client.wait_terminal(created["taskId"])
        finally:
            await client.close()
        record = await proxy.store.get(created["taskId"])
        assert record is not None and record.trace is None
        assert exporter.get_finished_spans() == ()
        assert "trace_id" not in json_logs.getvalue()
    finally:
        tracing.shutdown()


def test_shutdown_is_bounded_behind_a_collector_that_hangs_and_failures_log_as_json(
    json_logs: Logs,
) -> None:
    """A collector that accepts and never answers: shutdown's last flush gives up after its bound,
    and the SDK's complaints come out as one JSON line, not plain text per retry."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    try:
        assert tracing.install(TracingConfig(otlp_endpoint=f"http://127.0.0.1:{port}/v1/traces"), environ={})
        with tracing.tracer().start_as_current_span("one"):
            pass
        started = time.monotonic()
        tracing.shutdown(timeout_s=0.5)
        assert time.monotonic() - started < 2.0
        exporter_log = logging.getLogger("opentelemetry.exporter.otlp.proto.http.trace_exporter")
        for handler in logging.getLogger("opentelemetry.exporter").handlers:
            handler.last = 0.0  # type: ignore[attr-defined]  (a line of an earlier test may have folded this)
        exporter_log.error("export failed: x")
        text = json_logs.getvalue().splitlines()
        lines = [json.loads(line) for line in text if line.startswith("{")]
        assert any(line.get("event") == "tracing_export_failed" for line in lines)
        assert not [line for line in text if "export failed: x" in line and not line.startswith("{")]
    finally:
        listener.close()
