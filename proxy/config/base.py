"""Building blocks of the config models: the error type, durations with units, the strict base model,
and URLs without their credentials (for messages, logs, /readyz and the console)."""

from __future__ import annotations

import re
from typing import Annotated, Any
from urllib.parse import unquote, urlsplit

import pytimeparse2
from pydantic import BaseModel, BeforeValidator, ConfigDict, WithJsonSchema


class ConfigError(Exception):
    """The config file cannot be used; the message names the file and the key path."""


def parse_duration(value: Any) -> float:
    """Parse a duration string with a unit (`500ms`, `30s`, `10m`, `1h`, `1h30m`) into seconds (float).

    Bare numbers are refused because they are ambiguous (ms or s). Raises ValueError.
    """
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueError(f"durations are strings with a unit, like '500ms', '30s' or '10m' (got {value!r})")
    text = value.strip()
    if re.fullmatch(r"[0-9.]+", text):
        raise ValueError(f"duration {value!r} has no unit; write '{text}s' or '{text}ms'")
    seconds = pytimeparse2.parse(text)
    if seconds is None or seconds < 0:
        raise ValueError(f"cannot read {value!r} as a duration; use forms like '500ms', '30s', '10m', '1h'")
    return float(seconds)


Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": r"^\s*[0-9.]+\s*(ms|s|m|h|d)",
            "examples": ["500ms", "30s", "10m", "1h"],
        }
    ),
]


class Strict(BaseModel):
    """A config section: unknown keys are errors; fields may also be given by alias."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def redact_url(url: str) -> str:
    """`url` without user name and password (for messages, logs, /readyz and the console)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<unparseable url>"
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}{port}{parts.path}"


def url_password(url: str) -> str | None:
    """The password inside `url`, if any (to scrub it from error texts)."""
    try:
        password = urlsplit(url).password
    except ValueError:
        return None
    return unquote(password) if password else None


def url_problem(url: str) -> str | None:
    """Why `url` (http, https, redis or rediss) cannot be connected to, or None: a host that is
    missing or holds whitespace, a port that is not a number in 1-65535. The text never holds the
    URL's credentials."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "its port is not a number in 1-65535"
    host = parts.hostname or ""
    if not host or any(c.isspace() for c in host) or any(c.isspace() for c in parts.netloc):
        return "it has no host, or whitespace in it"
    if port is not None and not 1 <= port <= 65535:
        return "its port is not a number in 1-65535"
    return None
