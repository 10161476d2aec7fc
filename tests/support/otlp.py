"""A real OTLP/HTTP trace receiver on loopback: it decodes each protobuf export with
`opentelemetry-proto`, as a collector would, and keeps the spans for the test to read."""

from __future__ import annotations

import asyncio
import gzip
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class ReceivedSpan:
    """One span as it arrived: ids as hex, attributes and event names decoded."""

    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    events: list[str]
    links: list[tuple[str, str]]  # (trace id, span id)


@dataclass
class OtlpReceiver:
    """`POST /v1/traces` on 127.0.0.1 (`endpoint` is the base URL for OTEL_EXPORTER_OTLP_ENDPOINT)."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None
    endpoint: str = ""

    async def start(self) -> OtlpReceiver:
        app = web.Application()
        app.router.add_post("/v1/traces", self._export)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.endpoint = f"http://{host}:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _export(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        for resource_spans in export.resource_spans:
            service = next(
                (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"),
                "",
            )
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        ReceivedSpan(
                            service=service,
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            events=[event.name for event in span.events],
                            links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                        )
                    )
        self.arrived.set()
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    async def wait_for(self, predicate: Any, timeout: float = 10.0) -> list[ReceivedSpan]:
        """Wait (bounded by `timeout` s) until `predicate(spans)` holds; return the spans."""
        async with asyncio.timeout(timeout):
            while not predicate(self.spans):
                self.arrived.clear()
                await self.arrived.wait()
        return self.spans


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None
