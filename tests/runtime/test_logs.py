"""The JSON log line: compact JSON written by orjson, and, for what orjson refuses, by `json`, so a
value a client sent (a lone surrogate, a huge integer) never makes logging raise."""

from __future__ import annotations

import json
import math

import pytest
import structlog

from proxy.runtime.logs import configure_logging


class _Opaque:
    def __repr__(self) -> str:
        return "<opaque thing>"


def _strict(literal: str) -> None:
    raise ValueError(f"not strict JSON: {literal}")


@pytest.fixture
def json_lines(capsys: pytest.CaptureFixture[str]):
    """Logging configured as the proxy does on a non-terminal stderr; yields a function that returns
    the JSON lines written so far, parsed."""
    configure_logging("info", cache_loggers=False)

    def lines() -> list[dict]:
        return [json.loads(line, parse_constant=_strict) for line in capsys.readouterr().err.splitlines()]

    try:
        yield lines
    finally:
        structlog.reset_defaults()


def test_a_line_is_compact_json_with_the_bound_context(json_lines) -> None:
    log = structlog.get_logger("test")
    structlog.contextvars.bind_contextvars(request_id="r-1")
    try:
        log.info("request", status=200, duration_ms=0.42, thing=_Opaque(), tags=["a", "ü"])
    finally:
        structlog.contextvars.clear_contextvars()
    [line] = json_lines()
    assert line["event"] == "request" and line["level"] == "info" and line["request_id"] == "r-1"
    assert line["status"] == 200 and line["duration_ms"] == 0.42 and line["tags"] == ["a", "ü"]
    assert line["thing"] == "<opaque thing>" and line["timestamp"].endswith("Z")


def test_values_orjson_refuses_still_make_a_line(json_lines, capsys: pytest.CaptureFixture[str]) -> None:
    log = structlog.get_logger("test")
    log.info("surrogate", tool="bad\udc80name")
    log.info("big", value=2**70)
    log.info("keys", mapping={1: "one", None: "none"})
    log.info("nan", value=math.nan)
    log.info("both", tool="bad\udc80name", values=[math.inf, {"x": -math.inf}])
    surrogate, big, keys, nan, both = json_lines()
    assert surrogate["tool"] == "bad\udc80name"
    assert big["value"] == 2**70
    assert keys["mapping"] == {"1": "one", "null": "none"}
    assert nan["value"] is None
    assert both["tool"] == "bad\udc80name" and both["values"] == [None, {"x": None}]
