"""The proxy's log as a test reads it: JSON lines from stderr."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import structlog

from proxy.runtime.logs import configure_logging


@contextmanager
def json_log(capsys: pytest.CaptureFixture[str]) -> Iterator[list[dict[str, Any]]]:
    """Log JSON lines at level info for the block. The list it gives holds, once the block has ended
    without an error, every JSON line written to stderr meanwhile; logging is reset either way."""
    configure_logging("info")
    lines: list[dict[str, Any]] = []
    try:
        yield lines
        err = capsys.readouterr().err
        lines.extend(json.loads(line) for line in err.splitlines() if line.startswith("{"))
    finally:
        structlog.reset_defaults()
