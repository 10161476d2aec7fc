"""Inbound identity: who is calling (the principal), per the config's `auth` section.

Modes: `none` (one principal, `anonymous`), `bearer` (static tokens, kept in the config only as
SHA-256 hashes), `jwt` (signature, expiry, issuer and audience checked by PyJWT against a JWKS file
or URL), `header` (a trusted header set by a fronting auth proxy, optionally only from listed peer
addresses). Every task is bound to the principal that created it (design.md "Invariants").
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from pathlib import Path

import jwt
import structlog
from aiohttp import web

from proxy.config import AuthConfig
from proxy.protocol import jsonrpc
from proxy.protocol.jsonrpc import INVALID_REQUEST
from proxy.replicas.forward import RELAYED_PRINCIPAL_HEADER, SECRET_HEADER
from proxy.tasks.model import ANONYMOUS, principal_hash

log = structlog.get_logger("proxy.front")

PRINCIPAL_KEY = web.RequestKey("principal", str)
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


class AuthError(Exception):
    """The request carries no acceptable credentials; the message says why (never the secret)."""


def hash_token(token: str) -> str:
    """The config form of a bearer token: `sha256:<hex digest>`."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


class Authenticator:
    """Turns a request into a principal name, or raises AuthError.

    `config` is the `auth` section (a relative `jwks_file` is taken relative to `base_dir`);
    `replica_secret` is the replicas' shared secret, with which a request another replica relayed
    carries the principal that replica authenticated (None without replicas: such a request is refused).
    """

    def __init__(
        self, config: AuthConfig, *, base_dir: Path | None = None, replica_secret: str | None = None
    ) -> None:
        self.config = config
        self.mode = config.mode
        self._tokens = {
            digest.removeprefix("sha256:").lower(): name for name, digest in config.tokens.items()
        }
        self._jwks: jwt.PyJWKSet | None = None
        self._jwks_client: jwt.PyJWKClient | None = None
        self.replica_secret = replica_secret
        if self.mode == "jwt":
            assert config.jwt is not None
            if config.jwt.jwks_file:
                path = Path(config.jwt.jwks_file)
                if not path.is_absolute() and base_dir is not None:
                    path = base_dir / path
                self._jwks = jwt.PyJWKSet.from_json(path.read_text())
            elif config.jwt.jwks_url:
                self._jwks_client = jwt.PyJWKClient(
                    config.jwt.jwks_url,
                    cache_keys=True,
                    lifespan=300,
                    timeout=int(max(1, config.jwt.jwks_timeout)),
                )

    async def principal(self, request: web.Request) -> str:
        """The principal of `request`. Raises AuthError.

        A request another replica relayed (it carries the replicas' shared secret) keeps the principal
        that replica authenticated (`X-Mcp-Replica-Principal`): it is not authenticated again (the
        relaying replica's address is not an auth proxy's, and a token may not be re-checkable).
        """
        relayed = request.headers.getall(RELAYED_PRINCIPAL_HEADER, [])
        if relayed:
            if self.replica_secret is None:
                raise AuthError(f"{RELAYED_PRINCIPAL_HEADER} is only accepted from another replica")
            given = request.headers.get(SECRET_HEADER, "").encode()
            if (
                len(relayed) != 1
                or not relayed[0]
                or not hmac.compare_digest(given, self.replica_secret.encode())
            ):
                raise AuthError(f"{RELAYED_PRINCIPAL_HEADER} is only accepted from another replica")
            return relayed[0]
        if self.mode == "none":
            return ANONYMOUS
        if self.mode == "header":
            return self._from_header(request)
        token = _bearer(request)
        if self.mode == "bearer":
            # raw header bytes: no 500
            digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()
            for known, name in self._tokens.items():
                if hmac.compare_digest(digest, known):
                    return name
            raise AuthError("unknown bearer token")
        return await self._from_jwt(token)

    def _from_header(self, request: web.Request) -> str:
        cfg = self.config.header
        assert cfg is not None
        if not cfg.trusts(request.remote):
            raise AuthError(f"{cfg.name} is not accepted from this peer")  # never name the trusted peers
        values = request.headers.getall(cfg.name, [])
        if len(values) != 1 or not values[0].strip():
            raise AuthError(f"missing or repeated {cfg.name} header")
        return values[0].strip()

    async def _from_jwt(self, token: str) -> str:
        cfg = self.config.jwt
        assert cfg is not None
        try:
            header = jwt.get_unverified_header(token)
            if self._jwks is not None:
                kid = header.get("kid")
                keys = [k for k in self._jwks.keys if kid is None or k.key_id == kid]
                if not keys:
                    raise AuthError("no key in the JWKS matches the token's kid")
                key = keys[0]
            else:
                assert self._jwks_client is not None
                key = await asyncio.to_thread(self._jwks_client.get_signing_key_from_jwt, token)
            # Only the algorithm of the matched key: a token whose `alg` does not fit its key is refused.
            allowed = _algorithms_for(key, cfg.algorithms)
            if header.get("alg") not in allowed:
                raise AuthError(f"the token's alg {str(header.get('alg'))[:20]!r} does not match its key")
            claims = jwt.decode(
                token,
                key.key,
                algorithms=allowed,
                audience=cfg.audience,
                issuer=cfg.issuer,
                leeway=cfg.leeway_s,
                options={"require": ["exp"]},
            )
        except jwt.PyJWTError as exc:
            raise AuthError(f"invalid token: {exc}") from None
        # a key the token's alg cannot use, a malformed header
        except (
            ValueError,
            TypeError,
            KeyError,
            AttributeError,
        ) as exc:
            raise AuthError(f"invalid token ({exc.__class__.__name__})") from None
        principal = claims.get(cfg.principal_claim)
        if not isinstance(principal, str) or not principal:
            raise AuthError(f"the token has no {cfg.principal_claim!r} claim")
        return principal


_ALG_FAMILIES = {"RSA": ("RS", "PS"), "EC": ("ES",), "OKP": ("EdDSA", "Ed"), "oct": ("HS",)}


def _algorithms_for(key: jwt.PyJWK, configured: list[str]) -> list[str]:
    """The configured algorithms that `key` can verify: its own `alg` when the JWK names one,
    else those of its key type (RSA: RS*/PS*, EC: ES*, OKP: EdDSA)."""
    data = getattr(key, "_jwk_data", {}) or {}
    if isinstance(data.get("alg"), str):
        return [alg for alg in configured if alg == data["alg"]]
    prefixes = _ALG_FAMILIES.get(str(data.get("kty")), ())
    return [alg for alg in configured if alg.startswith(prefixes)] if prefixes else []


def _bearer(request: web.Request) -> str:
    value = request.headers.get("Authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError("missing bearer token")
    return token.strip()


def auth_middleware(
    authenticator: Authenticator, *, own_auth_prefix: str | None = None, internal_prefix: str | None = None
):
    """aiohttp middleware: set `request[PRINCIPAL_KEY]`, or answer 401 with a JSON-RPC error.

    Health and metrics paths stay open. Paths under `own_auth_prefix` (the console, `/console`)
    are left to their own authentication: no client principal is set there, so a client
    credential never opens them. So are paths under `internal_prefix` (the replicas' `/_replica`,
    which check the replicas' shared secret themselves). Failures are logged as security events (without
    secrets).
    """

    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.path in OPEN_PATHS:
            return await handler(request)
        if own_auth_prefix is not None and (
            request.path == own_auth_prefix or request.path.startswith(own_auth_prefix + "/")
        ):
            return await handler(request)
        if internal_prefix is not None and request.path.startswith(internal_prefix + "/"):
            return await handler(request)
        try:
            request[PRINCIPAL_KEY] = await authenticator.principal(request)
            structlog.contextvars.bind_contextvars(principal=principal_hash(request[PRINCIPAL_KEY]))
        except AuthError as exc:
            log.warning("security_auth_failed", reason=str(exc), remote=request.remote, path=request.path)
            body = jsonrpc.error_response(
                None, jsonrpc.error_object(INVALID_REQUEST, f"authentication required: {exc}")
            )
            return web.Response(
                status=401,
                text=json.dumps(body),
                content_type="application/json",
                headers={"WWW-Authenticate": 'Bearer realm="mcp-tasks-proxy"'},
            )
        return await handler(request)

    return middleware
