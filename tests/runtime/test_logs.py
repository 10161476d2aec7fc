"""The JSON log line: compact JSON written by orjson, and, for what orjson refuses, by `json`, so a
value a client sent (a lone surrogate, a huge integer) never makes logging raise, and every line
is strict JSON (orjson, like jq, refuses NaN literals and escaped lone surrogates)."""

from __future__ import annotations

import json
import math

import orjson
import pytest
import structlog

from proxy.runtime.logs import configure_logging


class _Opaque:
    def __repr__(self) -> str:
        return "<opaque thing>"


class _OddRepr:
    def __repr__(self) -> str:
        return "odd\udc80repr"


def _strict(literal: str) -> None:
    raise ValueError(f"not strict JSON: {literal}")


@pytest.fixture
def json_lines(capsys: pytest.CaptureFixture[str]):
    """Logging configured as the proxy does on a non-terminal stderr; yields a function that returns
    the JSON lines written so far, parsed."""
    configure_logging("info", cache_loggers=False)

    def lines() -> list[dict]:
        lines = capsys.readouterr().err.splitlines()
        strict = [orjson.loads(line) for line in lines if "1180591620717411303424" not in line]
        assert len(strict) >= len(lines) - 2  # (orjson reads integers up to 64 bits only)
        return [json.loads(line, parse_constant=_strict) for line in lines]

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
    log.info("keys", mapping={1: "one", None: "none", ("a", 2): "tuple"})
    log.info("nan", value=math.nan)
    log.info("both", tool="bad\udc80name", values=[math.inf, {"x": -math.inf}])
    log.info("repr", thing=_OddRepr(), value=2**70)  # (the fallback, and `default` gives a surrogate)
    surrogate, big, keys, nan, both, odd = json_lines()
    assert surrogate["tool"] == "bad\\udc80name"  # the escape's text, not a lone surrogate
    assert big["value"] == 2**70
    assert keys["mapping"] == {"1": "one", "null": "none", "('a', 2)": "tuple"}
    assert nan["value"] is None
    assert both["tool"] == "bad\\udc80name" and both["values"] == [None, {"x": None}]
    assert odd["thing"] == "odd\\udc80repr" and odd["value"] == 2**70
