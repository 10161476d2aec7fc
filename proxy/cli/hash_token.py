"""`mcp-tasks-proxy hash-token [TOKEN]`: the `sha256:<hex>` form of a bearer token, for `auth.tokens`,
`console.tokens` and `metrics.token` (plain tokens are never written in the config)."""

from __future__ import annotations

import sys

from proxy.config.base import MIN_TOKEN_LENGTH
from proxy.front.auth import hash_token


def run(argv: list[str]) -> int:
    """Print the hash of the token `argv` gives (read from stdin without one); 2 for a token shorter
    than `MIN_TOKEN_LENGTH` characters, or with whitespace around it (the proxy strips what a client
    sends, so such a token could never match)."""
    if argv[:1] in (["-h"], ["--help"]):
        print(
            "usage: mcp-tasks-proxy hash-token [TOKEN]\n\n"
            "Print sha256:<hex> for auth.tokens (reads the token from stdin without an argument)."
        )
        return 0
    token = argv[0] if argv else sys.stdin.readline().rstrip("\r\n")
    if token != token.strip():
        print(
            "mcp-tasks-proxy: the token has whitespace around it, which a client's Authorization header "
            "loses: it could never match",
            file=sys.stderr,
        )
        return 2
    if len(token) < MIN_TOKEN_LENGTH:
        print(
            f"mcp-tasks-proxy: hash-token needs a token of at least {MIN_TOKEN_LENGTH} characters (argument "
            "or stdin); `python -c 'import secrets; print(secrets.token_urlsafe(32))'` makes one",
            file=sys.stderr,
        )
        return 2
    print(hash_token(token))
    return 0
