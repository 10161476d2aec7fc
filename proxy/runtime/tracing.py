"""OpenTelemetry tracing: one provider per process, off unless configured (`tracing:` or `OTEL_*`).

Trace context travels the two ways the 2026-07-28 revision allows (SEP-414): the W3C
`traceparent` / `tracestate` / `baggage` HTTP headers, and the same three keys in a request's
`params._meta`, where `_meta` wins. The proxy reads both on every inbound JSON-RPC request and writes
both on every upstream request (the `_meta` keys from its upstream span, the headers from the HTTP
exchange's span, made by OpenTelemetry's aiohttp client instrumentation), so an upstream that traces
joins the client's trace.

Everything here is a no-op while tracing is off: callers test `enabled()` first on hot paths, no
exporter thread runs, and no message is changed (`_meta` is only written when on). Attributes never
hold a payload or a secret: methods, tool names, server names, the principal's salted hash, task
ids and outcomes only.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any, Concatenate, ParamSpec, TypeVar

import aiohttp
import structlog
import yarl
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.aiohttp_client import create_trace_config
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy.config import TracingConfig
from proxy.runtime.running import bind

SHUTDOWN_FLUSH_S = 3.0  # bound (s) on the last export at shutdown
EXPORT_TIMEOUT_S = 5.0  # bound (s) on one export to the collector, retries included
EXPORT_LOG_EVERY_S = 60.0  # at most one log line (s apart) about failing exports, with a count
META_KEYS = ("traceparent", "tracestate", "baggage")  # the `_meta` keys SEP-414 reserves
PROPAGATOR = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
SCOPE = "mcp-tasks-proxy"

# Attribute names: the MCP semantic conventions where they have one, `mcp_tasks_proxy.*` for ours.
METHOD = "mcp.method.name"
TOOL = "gen_ai.tool.name"
REQUEST_ID = "jsonrpc.request.id"
ERROR_CODE = "rpc.response.status_code"
HTTP_STATUS = "http.response.status_code"
SERVER = "mcp_tasks_proxy.server"
ERA = "mcp_tasks_proxy.era"
PRINCIPAL = "mcp_tasks_proxy.principal_hash"
OUTCOME = "mcp_tasks_proxy.outcome"
TASK_ID = "mcp_tasks_proxy.task_id"
REPLICA = "mcp_tasks_proxy.replica"

_NAMED = frozenset({"tools/call", "prompts/get"})  # methods whose span name carries the target
_METHOD_SHAPE = re.compile(r"^[A-Za-z0-9_./-]{1,64}$")
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


class _Tracing:
    """The process's tracing state: a provider and its tracers while on, None while off."""

    provider: TracerProvider | None = None
    tracer: trace.Tracer | None = None
    # spans of HTTP exchanges: sampled only inside a traced request (never a root of their own)
    http_provider: TracerProvider | None = None


_Session = TypeVar("_Session")
_Params = TypeVar("_Params")
_Rest = ParamSpec("_Rest")
_state = _Tracing()
log = structlog.get_logger("proxy.tracing")


def enabled() -> bool:
    """True while tracing is on in this process."""
    return _state.tracer is not None


def wanted(config: TracingConfig, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether `config` and the `OTEL_*` variables in `environ` turn tracing on: an `otlp_endpoint`
    or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`, unless
    `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(
        config.otlp_endpoint
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def sample_ratio(config: TracingConfig, environ: Mapping[str, str] = os.environ) -> float:
    """The share (0..1) of new traces kept: the config's, else `OTEL_TRACES_SAMPLER_ARG`, else 1.0.
    Raises ValueError for an `OTEL_TRACES_SAMPLER_ARG` that is not a number in 0..1."""
    if config.sample_ratio is not None:
        return config.sample_ratio
    raw = environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if not raw:
        return 1.0
    try:
        ratio = float(raw)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"OTEL_TRACES_SAMPLER_ARG {raw[:32]!r} must be a number in 0..1")
    return ratio


def problems(config: TracingConfig, environ: Mapping[str, str] = os.environ) -> list[str]:
    """What keeps the tracing settings from working, one sentence each (empty when none): an
    `OTEL_TRACES_SAMPLER_ARG` that is not a number in 0..1 (when the config sets no ratio), an
    `OTEL_EXPORTER_OTLP_*ENDPOINT` that is not an http(s) URL or holds a user, password or query
    (the exporter would log it; send credentials in `OTEL_EXPORTER_OTLP_HEADERS`)."""
    found = []
    if wanted(config, environ):
        try:
            sample_ratio(config, environ)
        except ValueError as exc:
            found.append(str(exc))
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        value = environ.get(name, "").strip()
        if value and (problem := endpoint_problem(value)):
            found.append(f"{name}: {problem}")
    return found


def endpoint_problem(url: str) -> str | None:
    """Why `url` cannot be an OTLP/HTTP endpoint, or None: not http(s), or a user, password or
    query in it (the exporter's error messages would log them)."""
    try:
        parts = yarl.URL(url)
    except ValueError:
        return "not a URL"
    if parts.scheme not in ("http", "https") or not parts.host:
        return "must be an http:// or https:// URL with a host (OTLP over HTTP)"
    if parts.user or parts.password or parts.query_string:
        return (
            "must hold no user, password or query (they would reach the logs); "
            "send credentials in OTEL_EXPORTER_OTLP_HEADERS"
        )
    return None


def describe(config: TracingConfig, environ: Mapping[str, str] = os.environ) -> str:
    """One line on what tracing will do (for check-config and the start-up log)."""
    if not wanted(config, environ):
        return "tracing: off"
    where = config.otlp_endpoint or (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").rstrip("/") + "/v1/traces"
    )
    if config.sample_ratio is None and environ.get("OTEL_TRACES_SAMPLER", "").strip():
        sampling = f"sampler {environ['OTEL_TRACES_SAMPLER'].strip()[:64]} (OTEL_TRACES_SAMPLER)"
    else:
        try:
            sampling = f"sample ratio {sample_ratio(config, environ):g} (parent-based)"
        except ValueError:
            sampling = "an invalid OTEL_TRACES_SAMPLER_ARG"
    return f"tracing: OTLP/HTTP to {where}, {sampling}"


def sampler(config: TracingConfig, environ: Mapping[str, str] = os.environ) -> Sampler | None:
    """Parent-based with `sample_ratio` (the config's, else `OTEL_TRACES_SAMPLER_ARG`, else 1.0);
    None (the SDK reads `OTEL_TRACES_SAMPLER` and its argument itself) when the config sets no
    ratio and that variable names a sampler."""
    if config.sample_ratio is None and environ.get("OTEL_TRACES_SAMPLER", "").strip():
        return None
    return ParentBased(TraceIdRatioBased(sample_ratio(config, environ)))


def install(
    config: TracingConfig,
    *,
    processor: SpanProcessor | None = None,
    environ: Mapping[str, str] = os.environ,
) -> bool:
    """Turn tracing on when `config` or the environment asks (`wanted`), exporting over OTLP/HTTP
    through a batching processor (one background thread), or always with `processor` (the tests'
    in-memory exporter). Returns whether tracing is on. Raises ValueError for a bad sample ratio."""
    if processor is None and not wanted(config, environ):
        return False
    shutdown()
    resource = Resource.create({SERVICE_NAME: environ.get("OTEL_SERVICE_NAME") or config.service_name})
    provider = TracerProvider(sampler=sampler(config, environ), resource=resource)
    http_provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF), resource=resource)
    if processor is None:
        protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get(
            "OTEL_EXPORTER_OTLP_PROTOCOL"
        )
        if protocol and protocol.strip() != "http/protobuf":
            log.warning("tracing_protocol_ignored", protocol=protocol[:64], used="http/protobuf")
        exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint, timeout=EXPORT_TIMEOUT_S)
        processor = BatchSpanProcessor(exporter)
        _quiet_exporter_logs()
        log.info("tracing_on", detail=describe(config, environ))
    provider.add_span_processor(processor)
    http_provider.add_span_processor(processor)
    _state.provider, _state.http_provider = provider, http_provider
    _state.tracer = provider.get_tracer(SCOPE)
    return True


def shutdown(timeout_s: float = SHUTDOWN_FLUSH_S) -> None:
    """Turn tracing off, and flush and stop the exporter for at most `timeout_s` (s): the flush runs
    in a daemon thread, so a collector that is down or hangs costs a stopping proxy no more than
    that (its last spans are lost then)."""
    provider = _state.provider
    _state.provider = _state.http_provider = None
    _state.tracer = None
    if provider is not None:
        flushing = threading.Thread(target=provider.shutdown, name="tracing-shutdown", daemon=True)
        flushing.start()
        flushing.join(timeout_s)


def tracer() -> trace.Tracer:
    """The proxy's tracer (a no-op one while tracing is off)."""
    return _state.tracer or trace.NoOpTracer()


def leave_trace() -> None:
    """For a long-lived task started inside a request (an upstream session's GET stream): what it
    does later belongs to no request's trace (nothing while off)."""
    if enabled():
        otel_context.attach(Context())


def client_trace_configs() -> list[aiohttp.TraceConfig]:
    """aiohttp trace configs for a client session toward an upstream or a peer replica: while on,
    OpenTelemetry's aiohttp client instrumentation (one CLIENT span per HTTP exchange inside a
    traced request, and the `traceparent` header written from it); none while off. URLs in span
    attributes lose their user, password and query."""
    if _state.http_provider is None:
        return []
    return [create_trace_config(url_filter=safe_url, tracer_provider=_state.http_provider)]


def safe_url(url: yarl.URL) -> str:
    """`url` for an attribute: without user, password, query or fragment."""
    return str(url.with_user(None).with_query(None).with_fragment(None))


# -- context in and out -------------------------------------------------------------------------


def extract(headers: Mapping[str, str], params: Any, *, prefer_headers: bool = False) -> Context | None:
    """The trace context a request arrived with: from `params._meta` when it holds a valid
    `traceparent` (it wins), else from the HTTP headers; with `prefer_headers` (a request relayed by
    another replica, whose headers carry that replica's span) the headers first. None when neither
    holds a valid one."""
    from_headers = _extracted(headers)
    meta = params.get("_meta") if isinstance(params, dict) else None
    from_meta = _extracted(meta) if isinstance(meta, dict) else None
    if prefer_headers:
        return from_headers or from_meta
    return from_meta or from_headers


def _extracted(carrier: Mapping[str, Any]) -> Context | None:
    values = {
        key: value for key in META_KEYS if isinstance(value := carrier.get(key), str) and len(value) <= 8192
    }
    if "traceparent" not in values:
        return None
    found = PROPAGATOR.extract(values)
    return found if trace.get_current_span(found).get_span_context().is_valid else None


def with_meta(params: Any) -> Any:
    """`params` (a JSON-RPC request's params, or None) with the current span's context in
    `_meta` (`traceparent`, and `tracestate` / `baggage` when there are any): a new dict, the
    caller's left as it was. `params` as it was while off, outside a span, or when not a dict."""
    if not enabled() or (params is not None and not isinstance(params, dict)):
        return params
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier)
    if "traceparent" not in carrier:
        return params
    out = dict(params or {})
    meta = out.get("_meta")
    out["_meta"] = {**(meta if isinstance(meta, dict) else {}), **carrier}
    return out


def without_context(headers: MutableMapping[str, str]) -> None:
    """Drop the trace headers from `headers` (copied from a client) before the instrumentation
    writes the proxy's own."""
    for key in {name for name in headers if name.lower() in META_KEYS}:  # (a multidict repeats names)
        headers.pop(key, None)


def traceparent(span: Span | None = None) -> str | None:
    """`span`'s (or the current span's) context as a `traceparent` value; None when invalid."""
    span_context = (span or trace.get_current_span()).get_span_context()
    if not span_context.is_valid:
        return None
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{int(span_context.trace_flags):02x}"


def sampled_traceparent(span: Span) -> str | None:
    """`traceparent(span)` when the span is sampled (exported), else None: a stored trace id must
    lead to a trace."""
    return traceparent(span) if span.get_span_context().trace_flags.sampled else None


def span_context(value: str | None) -> SpanContext | None:
    """The span context a stored `traceparent` names (remote), or None for an invalid one."""
    match = _TRACEPARENT.match(value or "")
    if match is None:
        return None
    found = SpanContext(
        trace_id=int(match[1], 16),
        span_id=int(match[2], 16),
        is_remote=True,
        trace_flags=trace.TraceFlags(int(match[3], 16)),
    )
    return found if found.is_valid else None


def trace_id_of(value: str | None) -> str | None:
    """The 32-hex trace id in a `traceparent` value, or None."""
    match = _TRACEPARENT.match(value or "")
    return match[1] if match else None


# -- spans ----------------------------------------------------------------------------------------


def span_name(method: Any, target: Any) -> str:
    """`{method} {target}` for `tools/call` and `prompts/get` with a name, else the method; a
    method that does not look like one (client-chosen text) names the span `jsonrpc`."""
    if not isinstance(method, str) or not _METHOD_SHAPE.match(method):
        return "jsonrpc"
    if method in _NAMED and isinstance(target, str) and target:
        return f"{method} {_text(target, 128)}"
    return method


def request_attributes(body: Any) -> dict[str, Any]:
    """Span attributes of a JSON-RPC request `body`: method, tool (or prompt) name, request id."""
    if not isinstance(body, dict):
        return {}
    attributes: dict[str, Any] = {}
    method = body.get("method")
    if isinstance(method, str) and _METHOD_SHAPE.match(method):
        attributes[METHOD] = method
    params = body.get("params")
    name = params.get("name") if isinstance(params, dict) else None
    if method in _NAMED and isinstance(name, str):
        attributes[TOOL] = _text(name, 256)
    task_id = params.get("taskId") if isinstance(params, dict) else None
    if isinstance(task_id, str):
        attributes[TASK_ID] = _text(task_id, 128)
    request_id = body.get("id")
    if isinstance(request_id, (str, int)) and not isinstance(request_id, bool):
        attributes[REQUEST_ID] = _text(str(request_id), 128)
    return attributes


def _text(value: str, limit: int) -> str:
    """Client-chosen text fit for an attribute: at most `limit` characters that encode as UTF-8
    (a lone surrogate would fail the whole export batch)."""
    return value[:limit].encode("utf-8", "replace").decode("utf-8")


@contextmanager
def inbound_span(
    headers: Mapping[str, str], body: Any, attributes: Mapping[str, Any], *, prefer_headers: bool = False
) -> Iterator[Span]:
    """A SERVER span for one inbound JSON-RPC request, current for the block, child of the context
    the request carried (`extract`: its baggage stays current too, so it goes on upstream); its ids
    are bound to the request's log context. Only call while `enabled()`."""
    params = body.get("params") if isinstance(body, dict) else None
    parent = extract(headers, params, prefer_headers=prefer_headers)
    target = params.get("name") if isinstance(params, dict) else None
    name = span_name(body.get("method"), target) if isinstance(body, dict) else "jsonrpc"
    token = otel_context.attach(parent) if parent is not None else None
    try:
        with tracer().start_as_current_span(
            name,
            kind=SpanKind.SERVER,
            attributes={**request_attributes(body), **attributes},
            record_exception=False,
            set_status_on_exception=True,
        ) as span:
            ids = span.get_span_context()
            if ids.is_valid and ids.trace_flags.sampled:  # also on the request's own log line, once ended
                bind(trace_id=f"{ids.trace_id:032x}", span_id=f"{ids.span_id:016x}")
            yield span
    finally:
        if token is not None:
            otel_context.detach(token)


@contextmanager
def hop_span(headers: Mapping[str, str], op: str) -> Iterator[None]:
    """A SERVER span for one replica-to-replica hop (`op`: `tasks/cancel`, `tasks/answer`), child
    of the span the hopping replica sent in its headers. Nothing while off."""
    if not enabled():
        yield
        return
    with tracer().start_as_current_span(
        f"replica {op}",
        context=_extracted(headers),
        kind=SpanKind.SERVER,
        attributes={"mcp_tasks_proxy.hop": op},
    ):
        yield


@contextmanager
def upstream_span(server: str, method: str, params: Any) -> Iterator[Any]:
    """A CLIENT span for one request to upstream `server`, current for the block; yields `params`
    with the span's context in `_meta` (see `with_meta`). Yields `params` as they are while off and
    outside a traced request (a readiness probe, a sweep's re-run: no trace of their own)."""
    if not enabled() or not trace.get_current_span().is_recording():
        yield params
        return
    name = span_name(method, params.get("name") if isinstance(params, dict) else None)
    attributes = {**request_attributes({"method": method, "params": params}), SERVER: server}
    with tracer().start_as_current_span(
        name, kind=SpanKind.CLIENT, attributes=attributes, record_exception=False
    ) as span:
        try:
            yield with_meta(params)
        except Exception as exc:
            span.set_status(Status(StatusCode.ERROR, exc.__class__.__name__))
            raise


async def upstream_request(
    server: str, method: str, params: Any, send: Callable[[Any], Awaitable[dict[str, Any]]]
) -> dict[str, Any]:
    """`send(params)` (one request to upstream `server`, returning its JSON-RPC reply) inside an
    `upstream_span`, with the span's context in `params._meta`; a JSON-RPC error reply marks the
    span. Raises what `send` raises."""
    with upstream_span(server, method, params) as traced:
        reply = await send(traced)
        reply_status(reply)
        return reply


def traced_request(
    send: Callable[Concatenate[_Session, str, _Params, _Rest], Coroutine[Any, Any, dict[str, Any]]],
) -> Callable[Concatenate[_Session, str, _Params, _Rest], Coroutine[Any, Any, dict[str, Any]]]:
    """Decorator for an upstream session's `request(self, method, params, *, ...)` (its `server`
    attribute names the upstream): while tracing is on, the request is an `upstream_request` (a
    CLIENT span, its context in `params._meta`); while off, the method as it is."""

    @functools.wraps(send)
    def request(
        session: _Session, method: str, params: _Params, /, *args: _Rest.args, **kwargs: _Rest.kwargs
    ) -> Coroutine[Any, Any, dict[str, Any]]:
        if not enabled():  # the method's own coroutine: no frame more while off
            return send(session, method, params, *args, **kwargs)
        return upstream_request(
            getattr(session, "server", "?"),
            method,
            params,
            lambda traced: send(session, method, traced, *args, **kwargs),
        )

    return request


def reply_status(reply: Any, span: Span | None = None) -> None:
    """Mark `span` (or the current span) with a JSON-RPC reply's error code, as an error."""
    if not enabled() or not isinstance(reply, dict):
        return
    error = reply.get("error")
    if isinstance(error, dict):
        target = span or trace.get_current_span()
        code = error.get("code")
        if isinstance(code, int) and not isinstance(code, bool):
            target.set_attribute(ERROR_CODE, str(code))
        target.set_status(Status(StatusCode.ERROR, f"JSON-RPC error {code}"))


def set_attribute(key: str, value: str | int | bool) -> None:
    """Set an attribute on the current span (nothing while off)."""
    if enabled():
        trace.get_current_span().set_attribute(key, value)


def bind_task_id(task_id: str) -> None:
    """A request just created task `task_id` (or, v1, was given it): bind it to the request's log context and
    running entry (`running.bind`), and set it on the current span (the request's server span), so
    a trace search by task id finds the request that created the task, not only its `task` span."""
    bind(task_id=task_id)
    set_attribute(TASK_ID, _text(task_id, 128))


def set_outcome(outcome: str) -> None:
    """Record a `tools/call`'s outcome (`sync`, `detached`, `error`, `joined`) on the current span;
    `error` also marks the span as failed (a JSON-RPC error can come in an HTTP 200)."""
    if not enabled():
        return
    span = trace.get_current_span()
    span.set_attribute(OUTCOME, outcome)
    if outcome == "error":
        span.set_status(Status(StatusCode.ERROR, "tools/call answered with an error"))


def link_current(value: str | None, **attributes: str) -> None:
    """Link the current span to the span a stored `traceparent` names (a task's), if both exist."""
    if not enabled():
        return
    target = span_context(value)
    if target is not None:
        trace.get_current_span().add_link(target, attributes or None)


def start_task_span(task_id: str, attributes: Mapping[str, Any], *, parent: str | None = None) -> Span:
    """A span for a detached call's whole life (`task`), child of the current span (the request
    that created it), or of the span a stored `traceparent` names (`parent`: a call taken over from
    a lost replica), linked to that request. End it with `end_task_span`. Only call while `enabled()`."""
    context = None
    links: list[Link] = []
    if parent is not None and (found := span_context(parent)) is not None:
        context = trace.set_span_in_context(trace.NonRecordingSpan(found))
        links.append(Link(found, {"relation": "taken over from"}))
    else:
        creator = trace.get_current_span().get_span_context()
        if creator.is_valid:
            links.append(Link(creator, {"relation": "created by"}))
    return tracer().start_span(
        "task",
        context=context,
        kind=SpanKind.INTERNAL,
        attributes={
            TASK_ID: task_id,
            **{k: _text(v, 256) if isinstance(v, str) else v for k, v in attributes.items()},
        },
        links=links,
    )


def task_event(span: Span | None, name: str, link: bool = False, **attributes: str | int) -> None:
    """Add event `name` to a task's span; with `link`, also link it to the current span (the
    request that caused the event: a `tasks/update`, a `tasks/cancel`)."""
    if span is None or not span.is_recording():
        return
    span.add_event(name, attributes)
    if link:
        current = trace.get_current_span().get_span_context()
        if current.is_valid and current.span_id != span.get_span_context().span_id:
            span.add_link(current, {"relation": name})


def end_task_span(span: Span | None, status: str) -> None:
    """End a task's span with its terminal `status` (an event, and ERROR for `failed`; the status
    message, which may quote the upstream, stays out of the span)."""
    if span is None:
        return
    span.set_attribute("mcp_tasks_proxy.task_status", status)
    span.add_event(status, {"status": status})
    if status == "failed":
        span.set_status(Status(StatusCode.ERROR, "failed"))
    span.end()


# -- logs -----------------------------------------------------------------------------------------


class _ExportFailures(logging.Handler):
    """Takes the OpenTelemetry SDK's own log records (failed or retried exports, which it logs as
    plain text on every try) and turns them into one JSON log line per EXPORT_LOG_EVERY_S at most,
    with how many were folded into it."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.last = 0.0
        self.folded = 0

    def emit(self, record: logging.LogRecord) -> None:
        now = time.monotonic()
        if now - self.last < EXPORT_LOG_EVERY_S:
            self.folded += 1
            return
        reason = record.getMessage().replace("\n", " ")[:300]
        log.warning("tracing_export_failed", reason=reason, folded=self.folded)
        self.last, self.folded = now, 0


def _quiet_exporter_logs() -> None:
    """Route the SDK's exporter and processor logs through `_ExportFailures` (once)."""
    for name in ("opentelemetry.exporter", "opentelemetry.sdk"):
        logger = logging.getLogger(name)
        if not any(isinstance(handler, _ExportFailures) for handler in logger.handlers):
            logger.addHandler(_ExportFailures())
        logger.propagate = False


def add_log_ids(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: `trace_id` and `span_id` of the current span on every log line (while
    tracing is on and a span is current)."""
    if _state.tracer is not None:
        span_context_now = trace.get_current_span().get_span_context()
        if span_context_now.is_valid and span_context_now.trace_flags.sampled:
            event_dict["trace_id"] = f"{span_context_now.trace_id:032x}"
            event_dict["span_id"] = f"{span_context_now.span_id:016x}"
    return event_dict
