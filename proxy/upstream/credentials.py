"""The proxy's own OAuth token toward an upstream (`mcpServers.NAME.oauth`): an OAuth 2.1
client-credentials grant (RFC 6749 §4.4) the proxy runs itself, so that a client's token never
reaches the upstream (MCP authorization, "Token passthrough" is forbidden).

The token is kept until `refresh_before` (s) ahead of its `expires_in`, and fetched again once when
the upstream answers 401 to it. Each fetch is bounded, follows no redirect, and its failure is an
UpstreamError that names the token endpoint's answer, never the secret.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import quote_plus

import aiohttp
import structlog

from proxy.config import UpstreamOAuth, redact_url
from proxy.protocol import jsonrpc
from proxy.upstream.types import UpstreamError

log = structlog.get_logger("proxy.upstream")

MAX_TOKEN_RESPONSE_BYTES = 64 * 1024


class ClientCredentials:
    """One upstream's token (`server` names it in errors and logs). `http` is the proxy's upstream
    client session; `timeout_s` (s) bounds one token request."""

    def __init__(
        self, config: UpstreamOAuth, http: aiohttp.ClientSession, *, server: str, timeout_s: float
    ) -> None:
        self.config = config
        self.http = http
        self.server = server
        self.timeout_s = timeout_s
        self.token: str | None = None
        self._expires_at = 0.0  # monotonic s; 0 before the first token
        self._lock = asyncio.Lock()

    def header(self) -> dict[str, str]:
        """The `Authorization` header with the current token (empty before the first fetch)."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def ensure(self) -> dict[str, str]:
        """The `Authorization` header with a token that is not about to expire (fetched when needed).
        Raises UpstreamError."""
        if self.token is None or time.monotonic() >= self._expires_at - self.config.refresh_before:
            await self._fetch(stale=self.token)
        return self.header()

    async def refused(self, used: dict[str, str]) -> dict[str, str]:
        """The upstream answered 401 to the header `used`: a new token (once for all the requests
        that saw the same 401). Raises UpstreamError."""
        stale = used.get("Authorization", "").removeprefix("Bearer ") or None
        await self._fetch(stale=stale, force=True)
        return self.header()

    async def _fetch(self, *, stale: str | None, force: bool = False) -> None:
        async with self._lock:
            if self.token is not None and self.token != stale:
                return  # another request got a new token meanwhile
            if (
                not force
                and self.token is not None
                and time.monotonic() < self._expires_at - self.config.refresh_before
            ):
                return
            form = {"grant_type": "client_credentials"}
            if self.config.scope:
                form["scope"] = self.config.scope
            if self.config.resource:
                form["resource"] = self.config.resource
            try:
                async with self.http.post(
                    self.config.token_url,
                    data=form,
                    headers={
                        "Accept": "application/json",
                        # each part form-urlencoded first (RFC 6749 §2.3.1)
                        "Authorization": aiohttp.encode_basic_auth(
                            quote_plus(self.config.client_id), quote_plus(self.config.client_secret)
                        ),
                    },
                    allow_redirects=False,
                    timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                ) as resp:
                    body = await resp.content.read(MAX_TOKEN_RESPONSE_BYTES + 1)
                    status = resp.status
                answer = jsonrpc.loads(body) if len(body) <= MAX_TOKEN_RESPONSE_BYTES else None
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                raise self._failed(f"the request failed: {exc.__class__.__name__}: {exc}") from None
            token = answer.get("access_token") if isinstance(answer, dict) else None
            if status != 200 or not isinstance(token, str) or not token:
                error = answer.get("error") if isinstance(answer, dict) else None
                raise self._failed(f"HTTP {status}" + (f" ({str(error)[:100]})" if error else ""))
            assert isinstance(answer, dict)
            lifetime = answer.get("expires_in")
            seconds = float(lifetime) if isinstance(lifetime, int | float) and lifetime > 0 else 3600.0
            self.token, self._expires_at = token, time.monotonic() + seconds
            log.info("upstream_token_fetched", server=self.server, expires_in_s=round(seconds))

    def _failed(self, reason: str) -> UpstreamError:
        """Log why the proxy has no token (in full) and the error for the request (the token URL
        without credentials or query)."""
        where = redact_url(self.config.token_url)
        log.warning("upstream_token_failed", server=self.server, token_url=where, reason=reason[:300])
        return UpstreamError(f"upstream {self.server}: the proxy could not get its token from {where}")
