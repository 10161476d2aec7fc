"""structlog set-up: JSON lines by default, a readable renderer on a TTY."""

from __future__ import annotations

import logging
import sys
from typing import TextIO, cast

import structlog

from proxy.runtime import tracing


class _CurrentStderr:
    """Writes to whatever `sys.stderr` is at the time (so cached loggers follow a swapped stderr)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "info", *, cache_loggers: bool = True) -> None:
    """Route structlog and stdlib logging to stderr; JSON lines unless stderr is a terminal. Lines
    logged inside a traced span carry its `trace_id` and `span_id`. With `cache_loggers` (the
    default) each logger keeps this set-up from its first use on, which saves a lookup per line; a
    test that configures logging again later passes False."""
    renderer = structlog.dev.ConsoleRenderer() if sys.stderr.isatty() else structlog.processors.JSONRenderer()
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            tracing.add_log_ids,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(cast(TextIO, _CurrentStderr())),
        cache_logger_on_first_use=cache_loggers,
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
