"""The proxy as an OAuth 2.1 protected resource (MCP authorization, 2025-06-18 and later): its
Protected Resource Metadata (RFC 9728), the `WWW-Authenticate` challenges that point clients to it
(RFC 6750 §3, RFC 9728 §5.1), and the scopes each server's tools need.

An endpoint's resource URI is `listen.public_url` plus its path (`/mcp`, `/servers/NAME/mcp`); it is
never taken from a request. Without `public_url` no metadata is served and challenges name only the
realm, as before.
"""

from __future__ import annotations

import json

from aiohttp import web

from proxy.config import Config

METADATA_PREFIX = "/.well-known/oauth-protected-resource"
REALM = "mcp-tasks-proxy"
METADATA_MAX_AGE_S = 3600  # clients and caches may keep the metadata this long
PREFLIGHT_MAX_AGE_S = 600  # how long (s) a browser may keep the preflight's answer (Chromium caps it at 7200)


class ProtectedResource:
    """What `config` says of the proxy as a resource server: endpoints by path, their resource
    URIs, metadata and the scopes their tools need (`auth.scopes`)."""

    def __init__(self, config: Config) -> None:
        self.public_url = config.listen.public_url
        self.issuer = config.auth.jwt.issuer if config.auth.jwt is not None else None
        self.oauth = config.auth.mode == "jwt"
        self.scopes = config.auth.scopes
        self.documentation = config.auth.resource_documentation
        self.endpoints = {f"/servers/{name}/mcp": name for name in config.servers}
        if len(config.servers) == 1:
            self.endpoints["/mcp"] = next(iter(config.servers))

    @property
    def discoverable(self) -> bool:
        """True when MCP clients can find where to sign in (mode jwt with `public_url` and `issuer`)."""
        return self.oauth and self.public_url is not None and self.issuer is not None

    def resource_uri(self, path: str) -> str | None:
        """The canonical resource URI of the endpoint at `path` (None without `public_url`)."""
        return self.public_url + path if self.public_url is not None else None

    def metadata_url(self, path: str) -> str | None:
        """Where the metadata of the endpoint at `path` is served (RFC 9728 §3.1, path inserted)."""
        return self.public_url + METADATA_PREFIX + path if self.discoverable else None  # type: ignore[operator]

    def needed(self, server: str, tool: str | None) -> list[str]:
        """The scopes a `tools/call` of `tool` on `server` needs: the server's `*` scopes and the
        tool's own, in config order without repeats (only the `*` scopes when `tool` is None)."""
        rules = self.scopes.get(server, {})
        combined = [*rules.get("*", []), *(rules.get(tool, []) if tool is not None else [])]
        return list(dict.fromkeys(combined))

    def supported(self, server: str) -> list[str]:
        """Every scope named for `server` (the metadata's `scopes_supported`)."""
        return list(dict.fromkeys(s for scopes in self.scopes.get(server, {}).values() for s in scopes))

    def challenge(
        self,
        path: str,
        *,
        error: str | None = None,
        description: str | None = None,
        scope: list[str] | None = None,
    ) -> str:
        """A `WWW-Authenticate` value for the endpoint at `path`: `Bearer` with `resource_metadata`
        (when discoverable, else the realm), and `error`, `error_description` and `scope` when given
        (RFC 6750 §3: quoted strings, no `"` or `\\` inside)."""
        params: list[tuple[str, str]] = []
        metadata = self.metadata_url(path) if path in self.endpoints else None
        params.append(("resource_metadata", metadata) if metadata is not None else ("realm", REALM))
        if error is not None:
            params.append(("error", error))
        if description is not None:
            params.append(("error_description", _quotable(description)))
        server = self.endpoints.get(path)
        wanted = scope if scope is not None else (self.needed(server, None) if server is not None else [])
        if wanted:
            params.append(("scope", " ".join(wanted)))
        return "Bearer " + ", ".join(f'{key}="{value}"' for key, value in params)

    def metadata(self, path: str) -> dict[str, object] | None:
        """The Protected Resource Metadata document of the endpoint at `path` (None: not served)."""
        server = self.endpoints.get(path)
        if server is None or not self.discoverable:
            return None
        document: dict[str, object] = {
            "resource": self.resource_uri(path),
            "authorization_servers": [self.issuer],
            "scopes_supported": self.supported(server),
            "bearer_methods_supported": ["header"],
            "resource_name": f"mcp-tasks-proxy: {server}",
        }
        if self.documentation:
            document["resource_documentation"] = self.documentation
        return document

    def add_routes(self, app: web.Application) -> None:
        """Serve the metadata of every endpoint (`/.well-known/oauth-protected-resource<path>`, and
        without a path for the default `/mcp`), when discoverable. Open: no credentials needed. A
        browser's CORS preflight (`OPTIONS`) of them is answered too: clients send
        `MCP-Protocol-Version` with the GET, which makes it a fetch that needs one."""
        if not self.discoverable:
            return
        for path in self.endpoints:
            app.router.add_get(METADATA_PREFIX + path, self._serve(path))
            app.router.add_route("OPTIONS", METADATA_PREFIX + path, _preflight)
        if "/mcp" in self.endpoints:
            app.router.add_get(METADATA_PREFIX, self._serve("/mcp"))
            app.router.add_route("OPTIONS", METADATA_PREFIX, _preflight)

    def _serve(self, path: str):
        document = json.dumps(self.metadata(path))

        async def handler(request: web.Request) -> web.Response:
            return web.Response(
                text=document,
                content_type="application/json",
                headers={
                    "Cache-Control": f"public, max-age={METADATA_MAX_AGE_S}",
                    "Access-Control-Allow-Origin": "*",  # browser-based clients read it too
                },
            )

        return handler


# Any request header (`*`: the fetch carries no credentials), `Authorization` too (the wildcard
# does not cover it): the document is public, so no header lets through what a plain GET would not.
PREFLIGHT_HEADERS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Methods": "GET, HEAD, OPTIONS",
    "Access-Control-Allow-Headers": "*, Authorization",
    "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
    "Allow": "GET, HEAD, OPTIONS",
}


async def _preflight(request: web.Request) -> web.Response:
    """204 to a CORS preflight of the metadata (Fetch standard, "CORS protocol"): any origin may GET
    it, with any request header (`PREFLIGHT_HEADERS`); nothing of the request is echoed."""
    return web.Response(status=204, headers=PREFLIGHT_HEADERS)


def _quotable(text: str) -> str:
    """`text` fit for a quoted-string in a challenge: printable ASCII without `"` and `\\`, 200
    characters at most."""
    cleaned = "".join(c if " " <= c <= "~" and c not in '"\\' else " " for c in text)
    return cleaned[:200]
