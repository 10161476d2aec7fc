"""Closed-loop HTTP/1.1 load generator for MCP endpoints (its own process; prints one JSON line).

Raw asyncio streams with keep-alive and pre-built headers rather than an HTTP client library: a
library client costs more CPU per request than some of the servers it would measure. Each of
`concurrency` workers owns one connection and sends its next request when the previous answer is
complete (JSON with Content-Length, chunked SSE, or read-to-close).

Modes (`--spec` JSON: {"mode", "url", "concurrency", "duration", "warmup", "max_requests", ...};
`"progress": true` sends a `progressToken` with each `tools/call`):
- `legacy`: initialize + notifications/initialized per worker (its own session), then `tools/call`.
- `modern`: 2026-07-28 envelope per request (`_meta` protocolVersion/clientCapabilities, routing headers).
- `tasks_get`: modern `tasks/get` on ids from `ids_file`, chosen at random.
- `detach`: modern `tools/call` with the tasks extension on a slow tool; each answer must be a
  CreateTaskResult; reports `late_ms` = arrival - (send + detach_after).

Bounded: a worker stops at `duration` (after `warmup`) or when `max_requests` have been sent; the
whole run is cut at duration + warmup + 60 s; at most `max_errors` errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
from urllib.parse import urlsplit

TASKS_EXT = "io.modelcontextprotocol/tasks"
MODERN = "2026-07-28"


class HttpError(Exception):
    pass


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes, bool]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
    close = headers.get(b"connection", b"").lower() == b"close"
    if b"content-length" in headers:
        body = await reader.readexactly(int(headers[b"content-length"]))
    elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                break
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        body = b"".join(parts)
    elif status in (202, 204, 304) or status < 200:
        body = b""
    else:
        body = await reader.read()
        close = True
    return status, headers, body, close


def final_message(headers: dict[bytes, bytes], body: bytes) -> dict:
    """The JSON-RPC response in a JSON or SSE body."""
    if headers.get(b"content-type", b"").startswith(b"text/event-stream"):
        msg: dict = {}
        for line in body.splitlines():
            if line.startswith(b"data:"):
                data = json.loads(line[5:].strip() or b"null")
                if isinstance(data, dict) and "id" in data and "method" not in data:
                    msg = data
        return msg
    return json.loads(body) if body else {}


class Worker:
    def __init__(self, spec: dict, stats: Stats, rng: random.Random) -> None:
        self.spec = spec
        self.stats = stats
        self.rng = rng
        u = urlsplit(spec["url"])
        self.host, self.port, self.path = u.hostname, u.port, u.path or "/"
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.sid: bytes | None = None
        self.version = spec.get("legacy_version", "2025-11-25")
        self.rid = 0

    def _request(self, body: bytes, extra: list[tuple[str, str]]) -> bytes:
        head = [
            f"POST {self.path} HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            "Content-Type: application/json",
            "Accept: application/json, text/event-stream",
            f"Content-Length: {len(body)}",
        ] + [f"{k}: {v}" for k, v in extra]
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body

    async def _exchange(self, data: bytes):
        if self.writer is None:
            await self.connect()
        assert self.reader is not None and self.writer is not None
        self.writer.write(data)
        status, headers, body, close = await read_response(self.reader)
        if close:
            await self.disconnect(keep_session=True)
        return status, headers, body

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 22)

    async def disconnect(self, keep_session: bool = False) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except Exception:
                pass
        self.reader = self.writer = None
        if not keep_session:
            self.sid = None

    async def handshake(self) -> None:
        init = {
            "jsonrpc": "2.0",
            "id": 0,
            "method": "initialize",
            "params": {
                "protocolVersion": self.version,
                "capabilities": {},
                "clientInfo": {"name": "bench-loadgen", "version": "1"},
            },
        }
        status, headers, body = await self._exchange(self._request(json.dumps(init).encode(), []))
        msg = final_message(headers, body)
        if status != 200 or "result" not in msg:
            raise HttpError(f"initialize: HTTP {status} {body[:200]!r}")
        self.version = msg["result"].get("protocolVersion", self.version)
        self.sid = headers.get(b"mcp-session-id")
        note = json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}).encode()
        status, _, body = await self._exchange(self._request(note, self._session_headers()))
        if status >= 300:
            raise HttpError(f"notifications/initialized: HTTP {status} {body[:200]!r}")

    def _session_headers(self) -> list[tuple[str, str]]:
        h = [("MCP-Protocol-Version", self.version)]
        if self.sid:
            h.append(("Mcp-Session-Id", self.sid.decode()))
        return h

    def build(self) -> tuple[bytes, bytes]:
        """The next request's bytes and the marker its answer must contain."""
        self.rid += 1
        mode, spec = self.spec["mode"], self.spec
        progress = {"progressToken": self.rid} if spec.get("progress") else {}
        if mode == "legacy":
            tool, arguments = spec["tool"], json.dumps(spec["arguments"])
            meta = f',"_meta":{json.dumps(progress)}' if progress else ""
            body = (
                f'{{"jsonrpc":"2.0","id":{self.rid},"method":"tools/call",'
                f'"params":{{"name":"{tool}","arguments":{arguments}{meta}}}}}'
            ).encode()
            return self._request(body, self._session_headers()), spec["expect"].encode()
        caps = {"extensions": {TASKS_EXT: {}}} if spec.get("tasks_ext", True) else {}
        meta = {
            "io.modelcontextprotocol/protocolVersion": MODERN,
            "io.modelcontextprotocol/clientCapabilities": caps,
            **progress,
        }
        if mode == "tasks_get":
            task_id = self.rng.choice(spec["ids"])
            params = {"taskId": task_id, "_meta": meta}
            body = json.dumps(
                {"jsonrpc": "2.0", "id": self.rid, "method": "tasks/get", "params": params}
            ).encode()
            extra = [("MCP-Protocol-Version", MODERN), ("Mcp-Method", "tasks/get"), ("Mcp-Name", task_id)]
            return self._request(body, extra), b'"taskId"'
        params = {"name": spec["tool"], "arguments": spec["arguments"], "_meta": meta}
        body = json.dumps(
            {"jsonrpc": "2.0", "id": self.rid, "method": "tools/call", "params": params}
        ).encode()
        extra = [("MCP-Protocol-Version", MODERN), ("Mcp-Method", "tools/call"), ("Mcp-Name", spec["tool"])]
        return self._request(body, extra), spec["expect"].encode()

    async def run(self, t_measure: float, t_end: float) -> None:
        loop = asyncio.get_running_loop()
        spec = self.spec
        while loop.time() < t_end and self.stats.may_send():
            try:
                if spec["mode"] == "legacy" and self.sid is None and self.writer is None:
                    await self.handshake()
                data, expect = self.build()
                t0 = loop.time()
                status, headers, body = await asyncio.wait_for(
                    self._exchange(data), spec.get("request_timeout", 30)
                )
                t1 = loop.time()
                if status != 200 or expect not in body or b'"error"' in body[:200]:
                    raise HttpError(f"HTTP {status}: {body[:300]!r}")
                self.stats.ok(t0, t1, t_measure)
            except (
                OSError,
                HttpError,
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
                TimeoutError,
                ValueError,
            ) as exc:
                self.stats.error(exc)
                await self.disconnect()
                if self.stats.errors > spec.get("max_errors", 1000):
                    return
                await asyncio.sleep(0.01)
        await self.disconnect()


class Stats:
    def __init__(self, max_requests: int | None) -> None:
        self.max_requests = max_requests
        self.sent = 0
        self.total_ok = 0
        self.lat: list[float] = []
        self.errors = 0
        self.samples: list[str] = []

    def may_send(self) -> bool:
        if self.max_requests is not None and self.sent >= self.max_requests:
            return False
        self.sent += 1
        return True

    def ok(self, t0: float, t1: float, t_measure: float) -> None:
        self.total_ok += 1
        if t0 >= t_measure:
            self.lat.append(t1 - t0)

    def error(self, exc: BaseException) -> None:
        self.errors += 1
        if len(self.samples) < 5:
            self.samples.append(f"{type(exc).__name__}: {exc}"[:400])


def pct(sorted_values: list[float], p: float) -> float | None:
    if not sorted_values:
        return None
    i = min(len(sorted_values) - 1, max(0, round(p / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[i]


def summary(values_s: list[float], prefix: str = "") -> dict:
    v = sorted(values_s)

    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1000, 3)

    return {
        f"{prefix}p50_ms": ms(pct(v, 50)),
        f"{prefix}p90_ms": ms(pct(v, 90)),
        f"{prefix}p99_ms": ms(pct(v, 99)),
        f"{prefix}max_ms": ms(v[-1] if v else None),
        f"{prefix}mean_ms": ms(sum(v) / len(v) if v else None),
    }


async def main(spec: dict) -> dict:
    if spec["mode"] == "tasks_get":
        with open(spec["ids_file"]) as f:
            spec["ids"] = json.load(f)
    stats = Stats(spec.get("max_requests"))
    loop = asyncio.get_running_loop()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    start = loop.time()
    warmup = float(spec.get("warmup", 0))
    duration = float(spec.get("duration", 10))
    t_measure, t_end = start + warmup, start + warmup + duration
    workers = [Worker(spec, stats, random.Random(i)) for i in range(int(spec["concurrency"]))]
    try:
        async with asyncio.timeout(warmup + duration + 60):
            await asyncio.gather(*(w.run(t_measure, t_end) for w in workers))
    except TimeoutError:
        stats.error(TimeoutError("run cut at its hard time limit"))
    finished = loop.time()
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    window = (
        max(1e-9, min(finished, t_end) - t_measure)
        if spec.get("max_requests") is None
        else max(1e-9, finished - t_measure)
    )
    out = {
        "mode": spec["mode"],
        "concurrency": spec["concurrency"],
        "requests": len(stats.lat),
        "total_ok": stats.total_ok,
        "errors": stats.errors,
        "error_samples": stats.samples,
        "window_s": round(window, 3),
        "rps": round(len(stats.lat) / window, 1),
        **summary(stats.lat),
        "loadgen_cpu_s": round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 3),
        "wall_s": round(finished - start, 3),
    }
    if spec["mode"] == "detach":
        out.update(summary([x - spec["detach_after_s"] for x in stats.lat], prefix="late_"))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="JSON spec (see module docstring)")
    a = parser.parse_args()
    print(json.dumps(asyncio.run(main(json.loads(a.spec)))), flush=True)
