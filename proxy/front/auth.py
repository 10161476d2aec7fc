"""Inbound identity: who is calling (the principal), per the config's `auth` section.

Modes: `none` (one principal, `anonymous`), `bearer` (static tokens, kept in the config only as
SHA-256 hashes), `jwt` (OAuth 2.1 access tokens: `tokens.py`, audience-bound to the endpoint's
resource URI, with the challenges and metadata of `resource.py`), `header` (a trusted header set
by a fronting auth proxy, optionally only from listed peer addresses). Every task is bound to the
principal that created it (design.md "Invariants").
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from proxy.config import ANY_AUDIENCE, AuthConfig, ListenConfig
from proxy.front.resource import METADATA_PREFIX, ProtectedResource
from proxy.front.tokens import AccessTokens, TokenError
from proxy.protocol import jsonrpc
from proxy.protocol.jsonrpc import INTERNAL_ERROR, INVALID_REQUEST
from proxy.replicas.forward import RELAYED_PRINCIPAL_HEADER, SECRET_HEADER
from proxy.runtime.running import bind
from proxy.tasks.model import ANONYMOUS, principal_hash
from proxy.tasks.rates import FailedAttempts

log = structlog.get_logger("proxy.front")

PRINCIPAL_KEY = web.RequestKey("principal", str)
SCOPES_KEY = web.RequestKey("scopes", frozenset)  # granted by an OAuth access token (mode jwt)
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


class AuthError(Exception):
    """The request carries no acceptable credentials; the message says why (never the secret)."""


def hash_token(token: str) -> str:
    """The config form of a bearer token: `sha256:<hex digest>`."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


class Authenticator:
    """Turns a request into a principal name (and, for OAuth access tokens, the scopes they grant),
    or raises AuthError.

    `config` is the `auth` section (a relative `jwks_file` is taken relative to `base_dir`);
    `resource` says which audience a token must carry (the resource URI of the endpoint it came to,
    with `listen.public_url`, unless `jwt.audience` is set); `replica_secret` is the replicas'
    shared secret, with which a request another replica relayed carries the principal that replica
    authenticated (None without replicas: such a request is refused). Call `close` when done.
    """

    def __init__(
        self,
        config: AuthConfig,
        *,
        resource: ProtectedResource | None = None,
        base_dir: Path | None = None,
        replica_secret: str | None = None,
    ) -> None:
        self.config = config
        self.mode = config.mode
        self.resource = resource
        self._tokens = {
            digest.removeprefix("sha256:").lower(): name for name, digest in config.tokens.items()
        }
        self.replica_secret = replica_secret
        self.access_tokens = (
            AccessTokens(config.jwt, base_dir=base_dir)
            if self.mode == "jwt" and config.jwt is not None
            else None
        )

    async def close(self) -> None:
        """Release the authorization server client (JWKS, introspection)."""
        if self.access_tokens is not None:
            await self.access_tokens.close()

    async def identify(self, request: web.Request) -> tuple[str, frozenset[str] | None]:
        """The principal of `request`, and the scopes its OAuth access token grants (None when the
        mode has no scopes). Raises AuthError, or TokenError for a refused access token.

        A request another replica relayed (it carries the replicas' shared secret) keeps the principal
        that replica authenticated (`X-Mcp-Replica-Principal`): it is not authenticated again (the
        relaying replica's address is not an auth proxy's, a token may not be re-checkable, and the
        relaying replica checked the scopes).
        """
        relayed = request.headers.getall(RELAYED_PRINCIPAL_HEADER, [])
        if relayed:
            if self.replica_secret is None:
                raise AuthError(f"{RELAYED_PRINCIPAL_HEADER} is only accepted from another replica")
            given = request.headers.get(SECRET_HEADER, "").encode(
                "utf-8", "surrogatepass"
            )  # raw header bytes
            if (
                len(relayed) != 1
                or not relayed[0]
                or not hmac.compare_digest(given, self.replica_secret.encode())
            ):
                raise AuthError(f"{RELAYED_PRINCIPAL_HEADER} is only accepted from another replica")
            return relayed[0], None
        if self.mode == "none":
            return ANONYMOUS, None
        if self.mode == "header":
            return self._from_header(request), None
        token = _bearer(request)
        if self.mode == "bearer":
            # raw header bytes: no 500
            digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()
            for known, name in self._tokens.items():
                if hmac.compare_digest(digest, known):
                    return name, None
            raise AuthError("unknown bearer token")
        assert self.access_tokens is not None and self.config.jwt is not None
        audience = self.config.jwt.audience
        if audience is None and self.resource is not None:
            audience = self.resource.resource_uri(request.path)
        claims = await self.access_tokens.verify(
            token, audience=None if audience == ANY_AUDIENCE else audience
        )
        return claims.principal, claims.scopes

    def _from_header(self, request: web.Request) -> str:
        cfg = self.config.header
        assert cfg is not None
        if not cfg.trusts(request.remote):
            raise AuthError(f"{cfg.name} is not accepted from this peer")  # never name the trusted peers
        values = request.headers.getall(cfg.name, [])
        if len(values) != 1 or not values[0].strip():
            raise AuthError(f"missing or repeated {cfg.name} header")
        return values[0].strip()


def _bearer(request: web.Request) -> str:
    """The bearer token of the request's one `Authorization` header. Raises AuthError when there is
    none, or more than one (which one counts would depend on who reads them: never guessed)."""
    values = request.headers.getall("Authorization", [])
    if len(values) > 1:
        raise AuthError(f"{len(values)} Authorization headers: send one")
    scheme, _, token = (values[0] if values else "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError("missing bearer token")
    return token.strip()


def presented_credential(request: web.Request, mode: str) -> str | None:
    """The credential a request presents, which a guesser could vary: a relayed principal header with
    the replicas' secret it carries, or in modes `bearer` and `jwt` its `Authorization` value; None
    when it presents none (a first request without a token is no guess)."""
    relayed = request.headers.get(RELAYED_PRINCIPAL_HEADER)
    if relayed is not None:
        return f"{relayed}\x00{request.headers.get(SECRET_HEADER, '')}"
    return request.headers.get("Authorization") if mode in ("bearer", "jwt") else None


def too_many_failures(retry_after_s: int, rate: str | None) -> web.Response:
    """HTTP 429 for an address past `limits.failed_auth`: a JSON-RPC error (-32603, `data.limit`
    `failed_auth`, as every limit) and `Retry-After` (s)."""
    message = (
        f"limit failed_auth: too many credentials this proxy had not seen verify were checked from this "
        f"address ({rate}); retry after {retry_after_s} s"
    )
    body = jsonrpc.error_response(
        None,
        jsonrpc.error_object(INTERNAL_ERROR, message, {"limit": "failed_auth", "rate": rate}),
    )
    return web.Response(
        status=429,
        text=json.dumps(body),
        content_type="application/json",
        headers={"Retry-After": str(retry_after_s)},
    )


def auth_middleware(
    authenticator: Authenticator,
    resource: ProtectedResource,
    *,
    throttle: FailedAttempts,
    listen: ListenConfig,
    own_auth_prefix: str | None = None,
    internal_prefix: str | None = None,
):
    """aiohttp middleware: set `request[PRINCIPAL_KEY]` (and `request[SCOPES_KEY]` for OAuth
    access tokens), or answer 401 with a JSON-RPC error and a `WWW-Authenticate` challenge that
    points to the endpoint's Protected Resource Metadata (`resource`; RFC 9728 §5.1).

    Health, metrics and the resource metadata stay open. Paths under `own_auth_prefix` (the
    console, `/console`) are left to their own authentication: no client principal is set there, so
    a client credential never opens them. So are paths under `internal_prefix` (the replicas'
    `/_replica`, which check the replicas' shared secret themselves), and paths no route serves
    (their 404 or 405 tells a client it has the wrong URL). Failures are logged as
    security events (without secrets). Each credential that has not verified before counts as an
    attempt of its client address (`listen.client_address`) in `throttle` before it is looked at;
    an address past `limits.failed_auth` gets 429 with Retry-After.
    """

    @web.middleware
    async def middleware(request: web.Request, handler):
        path = request.path
        if path in OPEN_PATHS or path == METADATA_PREFIX or path.startswith(METADATA_PREFIX + "/"):
            return await handler(request)
        if own_auth_prefix is not None and (
            path == own_auth_prefix or path.startswith(own_auth_prefix + "/")
        ):
            return await handler(request)
        if internal_prefix is not None and path.startswith(internal_prefix + "/"):
            return await handler(request)
        if getattr(request.match_info, "http_exception", None) is not None:
            # no route: the router's 404 (or 405), not a 401 that sends a client to sign in again
            return await handler(request)
        credential = presented_credential(request, authenticator.mode)
        address = listen.client_address(request.remote, request.headers.getall("X-Forwarded-For", []))
        if credential is not None and (wait_s := await throttle.admit(credential, address, path=path)):
            return too_many_failures(wait_s, throttle.text)
        try:
            principal, scopes = await authenticator.identify(request)
        except (AuthError, TokenError) as exc:
            log.warning("security_auth_failed", reason=str(exc), remote=address, path=path)
            scheme = request.headers.get("Authorization", "").partition(" ")[0]
            sent_token = scheme.lower() == "bearer"  # another scheme carries no token (RFC 6750 §3.1)
            token_mode = sent_token and authenticator.mode in ("jwt", "bearer")
            challenge = resource.challenge(
                path,
                error="invalid_token" if token_mode else None,
                description=str(exc) if token_mode else None,
            )
            return auth_refusal(401, f"authentication required: {exc}", challenge)
        if credential is not None:
            throttle.remember_good(credential)
        request[PRINCIPAL_KEY] = principal
        if scopes is not None:
            request[SCOPES_KEY] = scopes
        bind(principal=principal_hash(principal))
        return await handler(request)

    return middleware


def auth_refusal(status: int, message: str, challenge: str, request_id: Any = None) -> web.Response:
    """A 401 or 403 answer: a JSON-RPC error (-32600) body under `request_id` (None: the body was
    not read) and the `WWW-Authenticate` challenge."""
    body = jsonrpc.error_response(request_id, jsonrpc.error_object(INVALID_REQUEST, message))
    return web.Response(
        status=status,
        text=json.dumps(body),
        content_type="application/json",
        headers={"WWW-Authenticate": challenge},
    )
