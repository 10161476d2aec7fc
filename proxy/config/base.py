"""Building blocks of the config models: the error type, durations with units, the strict base model,
and URLs without their credentials (for messages, logs, /readyz and the console)."""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Any
from urllib.parse import unquote, urlsplit, urlunsplit

import pytimeparse2
from pydantic import BaseModel, BeforeValidator, ConfigDict, WithJsonSchema


class ConfigError(Exception):
    """The config file cannot be used; the message names the file and the key path."""


MAX_DURATION_S = 100 * 365 * 24 * 3600  # the longest duration a config may give (s): 100 years


def parse_duration(value: Any) -> float:
    """Parse a duration string with a unit (`500ms`, `30s`, `10m`, `1h`, `1h30m`) into seconds (float).

    Bare numbers are refused because they are ambiguous (ms or s), and so is a capital `M` (the
    parser reads `1M` as a minute, a reader may as a month); so is a duration over MAX_DURATION_S
    (its ms would outgrow what JSON clients read exactly). Raises ValueError.
    """
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueError(f"durations are strings with a unit, like '500ms', '30s' or '10m' (got {value!r})")
    text = value.strip()
    if re.fullmatch(r"[0-9.]+", text):
        raise ValueError(f"duration {value!r} has no unit; write '{text}s' or '{text}ms'")
    if "M" in text:
        raise ValueError(f"duration {value!r}: write 'm' for minutes, 'mo' for months, 'ms' for milliseconds")
    seconds = pytimeparse2.parse(text)
    if seconds is None or seconds < 0:
        raise ValueError(f"cannot read {value!r} as a duration; use forms like '500ms', '30s', '10m', '1h'")
    if seconds > MAX_DURATION_S:
        raise ValueError(f"duration {value!r} is longer than 100 years, the longest accepted")
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
    """`url` as written up to its query, without user name and password (for messages, logs,
    /readyz and the console): `http://u:pw@h:1/mcp?t=x` reads `http://h:1/mcp`, and a URL without
    its scheme stays as given (`h:8080`, not a rebuilt `h://8080`). `<unparseable url>` when an
    `@` is left after the cut or the port is no number: a password holding `/`, `?` or `#` ends
    the parse of the host early, and the URL must not be shown at all."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port that is no number)
    except ValueError:
        return "<unparseable url>"
    shown = urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))
    return "<unparseable url>" if "@" in shown else shown


def url_password(url: str) -> str | None:
    """The password inside `url`, if any (to scrub it from error texts)."""
    try:
        password = urlsplit(url).password
    except ValueError:
        return None
    return unquote(password) if password else None


def url_problem(url: str) -> str | None:
    """Why `url` (http, https, redis or rediss) cannot be connected to, or None: a host that is
    missing or holds whitespace, a port that is not a number in 1-65535, a user or password whose
    `/`, `?` or `#` ends the host early. The text never holds the URL's credentials."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "its host is not a valid host name or IP address"
    try:
        port = parts.port
    except ValueError:
        if "@" in f"{parts.path}?{parts.query}#{parts.fragment}":  # `bob:Zm9v/YmFy@h`: no port at all
            return (
                "a `/`, `?` or `#` in its user or password ends the host early; write them "
                "percent-encoded (%2F, %3F, %23)"
            )
        return "its port is not a number in 1-65535"
    host = parts.hostname or ""
    if not host or any(c.isspace() for c in host) or any(c.isspace() for c in parts.netloc):
        return "it has no host, or whitespace in its host, user or password"
    if port is not None and not 1 <= port <= 65535:
        return "its port is not a number in 1-65535"
    return None


# Tokens anyone would guess first: every one of one or two printable ASCII characters, and the
# words people type when they try things out. A config holds only hashes, so these are what a
# config can still be checked against (`hash-token` refuses anything under MIN_TOKEN_LENGTH).
MIN_TOKEN_LENGTH = 16
_GUESSED = (
    "test testing password passw0rd secret changeme admin root token demo example hello qwerty "
    "letmein default guest user 1234 12345 123456 12345678 123456789 abc123 foo bar foobar"
).split()
_PRINTABLE = [chr(c) for c in range(33, 127)]
_WEAK_DIGESTS = frozenset(
    hashlib.sha256(token.encode()).hexdigest()
    for token in (*_GUESSED, *_PRINTABLE, *(a + b for a in _PRINTABLE for b in _PRINTABLE))
)


def weak_token_hash(digest: str) -> bool:
    """True when `digest` (`sha256:<hex>`) is the hash of a token anyone would guess: one or two
    characters, or a word like `test` or `password`."""
    return digest.removeprefix("sha256:").lower() in _WEAK_DIGESTS


def token_hash_problem(name: str, digest: str) -> str | None:
    """Why `digest` cannot be the config form of token `name`, or None: not `sha256:<64 hex>`
    (the token itself, most likely), or the hash of a token anyone would guess."""
    if not re.fullmatch(r"sha256:[0-9a-fA-F]{64}", digest):
        if digest.startswith("sha256:"):
            return f"{name} must be `sha256:` and 64 hex digits (mcp-tasks-proxy hash-token prints one)"
        return f"{name} must be a hash `sha256:<64 hex digits>`, not the token itself"
    if weak_token_hash(digest):
        return (
            f"{name} is the hash of a token anyone would guess (one or two characters, or a word like "
            f"`test`); make one of {MIN_TOKEN_LENGTH}+ random characters: mcp-tasks-proxy hash-token"
        )
    return None
