"""OAuth 2.1 access tokens, checked as a resource server does (MCP authorization, 2025-06-18 and
later): JWT access tokens (RFC 9068) verified by PyJWT against the authorization server's keys,
opaque tokens through RFC 7662 introspection.

Keys come from a JWKS file, a JWKS URL, or the `jwks_uri` the issuer publishes (RFC 8414
`/.well-known/oauth-authorization-server`, then OpenID discovery). Every fetch is bounded by
`jwt.jwks_timeout`, follows no redirect and reads at most `MAX_DOCUMENT_BYTES`; the keys are kept
`KEYS_LIFESPAN_S` and fetched again for an unknown `kid` at most once per `jwt.refetch_interval`.
A fetch that fails never lets a token through: it is refused as `invalid_token`, the cause logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote_plus, urlsplit, urlunsplit

import aiohttp
import jwt
import structlog

from proxy.config import ConfigError, JwtConfig, redact_url
from proxy.protocol import jsonrpc

log = structlog.get_logger("proxy.front")

MAX_DOCUMENT_BYTES = 1024 * 1024  # metadata, JWKS and introspection answers
KEYS_LIFESPAN_S = 300.0  # how long fetched keys (and the issuer's metadata) are used before a refresh
INTROSPECTION_CACHE_MAX = 10_000  # answers kept at most


class TokenError(Exception):
    """The token is refused (HTTP 401); the message says why (never the token); `error` is the
    RFC 6750 error code for the `WWW-Authenticate` challenge."""

    def __init__(self, message: str, *, error: str = "invalid_token") -> None:
        super().__init__(message)
        self.error = error


@dataclass(frozen=True)
class TokenClaims:
    """What an accepted access token says: `principal`, `scopes` (granted), `expires_at` (epoch s)."""

    principal: str
    scopes: frozenset[str]
    expires_at: float | None


def scopes_of(claims: dict[str, Any]) -> frozenset[str]:
    """The scopes a token grants: `scope` (space-separated, RFC 9068 / RFC 7662) or `scp` (a list,
    as some servers write it)."""
    raw = claims.get("scope", claims.get("scp"))
    if isinstance(raw, str):
        return frozenset(raw.split())
    if isinstance(raw, list):
        return frozenset(s for s in raw if isinstance(s, str))
    return frozenset()


def discovery_urls(issuer: str) -> list[str]:
    """Where an issuer's metadata may be, in the order tried: RFC 8414 (path inserted after
    `/.well-known/`), OpenID Connect Discovery with the path inserted, then appended (OIDC 1.0 §4)."""
    parts = urlsplit(issuer.rstrip("/"))
    path = parts.path

    def at(well_known: str) -> str:
        return urlunsplit((parts.scheme, parts.netloc, well_known, "", ""))

    urls = [at("/.well-known/oauth-authorization-server" + path)]
    if path:
        urls.append(at("/.well-known/openid-configuration" + path))
    urls.append(at(path + "/.well-known/openid-configuration"))
    return urls


class AccessTokens:
    """Checks access tokens for one `jwt` config section. `base_dir` resolves a relative
    `jwks_file`. Use `verify`; call `close` when done (it owns an aiohttp client session)."""

    def __init__(self, config: JwtConfig, *, base_dir: Path | None = None) -> None:
        self.config = config
        self._static: jwt.PyJWKSet | None = None
        if config.jwks_file:
            self._static = load_jwks_file(config.jwks_file, base_dir)
        self._http: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()
        self._metadata: dict[str, Any] | None = None
        self._metadata_at = float("-inf")
        self._metadata_tried = float("-inf")
        self._keys: jwt.PyJWKSet | None = None
        self._keys_at = float("-inf")  # when the keys were last fetched (monotonic s)
        self._tried_at = float("-inf")  # when a fetch was last tried, for the refetch interval
        self._introspected: OrderedDict[str, tuple[TokenClaims, float]] = OrderedDict()

    async def close(self) -> None:
        """Close the HTTP client session (idempotent)."""
        if self._http is not None:
            await self._http.close()
            self._http = None

    # -- the check ---------------------------------------------------------------------------

    async def verify(self, token: str, *, audience: str | None) -> TokenClaims:
        """The claims of `token` when it is valid for `audience` (a resource URI; None: the
        audience is not checked). A token of three dot-separated parts is a JWT; any other goes to
        introspection when configured. Raises TokenError."""
        if token.count(".") == 2:
            return await self._verify_jwt(token, audience)
        if self.config.introspection is None:
            raise TokenError("the token is not a JWT and no introspection is configured")
        return await self._introspect(token, audience)

    async def _verify_jwt(self, token: str, audience: str | None) -> TokenClaims:
        cfg = self.config
        try:
            header = jwt.get_unverified_header(token)
            key = await self._key(header.get("kid"))
            allowed = _algorithms_for(key, cfg.algorithms)
            if header.get("alg") not in allowed:
                raise TokenError(f"the token's alg {str(header.get('alg'))[:20]!r} does not match its key")
            claims = jwt.decode(
                token,
                key.key,
                algorithms=allowed,
                audience=audience,
                issuer=cfg.issuer,
                leeway=cfg.leeway_s,
                options={"require": ["exp"], "verify_aud": audience is not None},
            )
        except jwt.PyJWTError as exc:
            raise TokenError(f"invalid token: {exc}") from None
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # a malformed header or key
            raise TokenError(f"invalid token ({exc.__class__.__name__})") from None
        exp = claims.get("exp")
        return TokenClaims(
            self._principal(claims), scopes_of(claims), float(exp) if isinstance(exp, int | float) else None
        )

    def _principal(self, claims: dict[str, Any]) -> str:
        principal = claims.get(self.config.principal_claim)
        client = claims.get("client_id")
        if principal is None and self.config.principal_claim == "sub" and isinstance(client, str) and client:
            principal = "client:" + client  # a client-credentials token names no user; never a user's name
        if not isinstance(principal, str) or not principal:
            raise TokenError(f"the token has no {self.config.principal_claim!r} claim")
        return principal

    # -- keys ---------------------------------------------------------------------------------

    async def _key(self, kid: Any) -> jwt.PyJWK:
        if self._static is not None:
            found = _find(self._static, kid)
            if found is None:
                raise TokenError("no key in the JWKS matches the token's kid")
            return found
        now = time.monotonic()
        may_fetch = now - self._tried_at >= self.config.refetch_interval  # also after a failed fetch
        if may_fetch and (self._keys is None or now - self._keys_at > KEYS_LIFESPAN_S):
            await self._refresh_keys(now)
            may_fetch = False
        found = _find(self._keys, kid)
        if found is None and may_fetch:
            await self._refresh_keys(now)  # a key rotated in since the last fetch
            found = _find(self._keys, kid)
        if found is None and self._keys is None:
            raise TokenError("the authorization server's keys are unavailable")
        if found is None:
            raise TokenError("no key of the authorization server matches the token's kid")
        return found

    async def _refresh_keys(self, asked_at: float) -> None:
        """Fetch the JWKS again, once for all the requests waiting (stale keys stay in use when it fails)."""
        async with self._lock:
            if self._tried_at >= asked_at:
                return  # another request fetched them meanwhile
            self._tried_at = time.monotonic()
            try:
                url = self.config.jwks_url or await self._jwks_uri()
                keys = jwt.PyJWKSet.from_dict(await self._get_json(url))
            except (TokenError, jwt.PyJWTError, ValueError, TypeError) as exc:
                log.warning("auth_keys_unavailable", reason=str(exc))
                if self._keys is None:
                    raise TokenError("the authorization server's keys are unavailable") from None
                return
            self._keys, self._keys_at = keys, time.monotonic()

    async def _jwks_uri(self) -> str:
        uri = (await self.metadata()).get("jwks_uri")
        if not isinstance(uri, str) or not uri:
            raise TokenError("the authorization server's metadata names no jwks_uri")
        return uri

    async def metadata(self) -> dict[str, Any]:
        """The issuer's authorization server metadata (RFC 8414 or OpenID discovery), kept
        `KEYS_LIFESPAN_S`, then fetched again at most once per `refetch_interval` (the old document
        stays in use while that fails); its `issuer` must be the configured one, exactly (RFC 8414
        §3.3). Raises TokenError."""
        now = time.monotonic()
        if self._metadata is not None and (
            now - self._metadata_at < KEYS_LIFESPAN_S
            or now - self._metadata_tried < self.config.refetch_interval
        ):
            return self._metadata
        issuer = self.config.issuer
        if not issuer:
            raise TokenError("no issuer is configured to discover metadata from")
        self._metadata_tried = now
        failures = []
        for url in discovery_urls(issuer):
            try:
                document = await self._get_json(url)
            except TokenError as exc:
                failures.append(str(exc))
                continue
            if document.get("issuer") != issuer:
                failures.append(
                    f"{redact_url(url)} names issuer {str(document.get('issuer'))[:200]!r}, not {issuer!r}"
                )
                continue
            self._metadata, self._metadata_at = document, time.monotonic()
            return document
        if self._metadata is not None:
            log.warning("auth_metadata_stale", reason="; ".join(failures))
            return self._metadata
        raise TokenError("no metadata for the issuer: " + "; ".join(failures))

    # -- introspection (RFC 7662) --------------------------------------------------------------

    async def _introspect(self, token: str, audience: str | None) -> TokenClaims:
        introspection = self.config.introspection
        assert introspection is not None
        # keyed by the audience too: a token good for one endpoint is not good for another
        digest = hashlib.sha256(f"{audience}\n{token}".encode("utf-8", "surrogatepass")).hexdigest()
        now = time.time()
        cached = self._introspected.get(digest)
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            endpoint = introspection.endpoint
            if endpoint is None:
                found = (await self.metadata()).get("introspection_endpoint")
                if not isinstance(found, str) or not found:
                    raise TokenError("the authorization server's metadata names no introspection_endpoint")
                endpoint = found
            answer = await self._post_form(
                endpoint,
                {"token": token, "token_type_hint": "access_token"},
                basic_auth(introspection.client_id, introspection.client_secret),
            )
        except TokenError as exc:  # the cause is the operator's to read, not an anonymous client's
            log.warning("auth_introspection_unavailable", reason=str(exc))
            raise TokenError("the token cannot be checked now") from None
        if answer.get("active") is not True:
            raise TokenError("the token is not active")
        exp = answer.get("exp")
        if isinstance(exp, int | float) and exp + self.config.leeway_s < now:
            raise TokenError("the token has expired")
        if self.config.issuer and "iss" in answer and answer["iss"] != self.config.issuer:
            raise TokenError("the token was issued by another authorization server")
        if audience is not None:
            aud = answer.get("aud")
            if audience not in (aud if isinstance(aud, list) else [aud]):
                raise TokenError("the token is not for this resource (aud)")
        claims = TokenClaims(
            self._principal(answer), scopes_of(answer), float(exp) if isinstance(exp, int | float) else None
        )
        until = min(now + introspection.cache, claims.expires_at or float("inf"))
        self._introspected[digest] = (claims, until)
        while len(self._introspected) > INTROSPECTION_CACHE_MAX:
            self._introspected.popitem(last=False)
        return claims

    # -- HTTP ----------------------------------------------------------------------------------

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.jwks_timeout))
        return self._http

    async def _get_json(self, url: str) -> dict[str, Any]:
        return await self._fetch("GET", url)

    async def _post_form(self, url: str, form: dict[str, str], authorization: str) -> dict[str, Any]:
        return await self._fetch("POST", url, data=form, headers={"Authorization": authorization})

    async def _fetch(
        self, method: str, url: str, *, headers: dict[str, str] | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """One bounded request to the authorization server: a JSON object, or TokenError naming
        what failed (the status, the error class; for the log, never for the client)."""
        try:
            async with self._session().request(
                method,
                url,
                allow_redirects=False,
                headers={"Accept": "application/json", **(headers or {})},
                **kwargs,
            ) as resp:
                if resp.status != 200:
                    raise TokenError(f"{method} {redact_url(url)}: HTTP {resp.status}")
                body = await resp.content.read(MAX_DOCUMENT_BYTES + 1)
            if len(body) > MAX_DOCUMENT_BYTES:
                raise TokenError(f"{method} {redact_url(url)}: larger than {MAX_DOCUMENT_BYTES} bytes")
            document = jsonrpc.loads(body)
        except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError) as exc:
            raise TokenError(f"{method} {redact_url(url)}: {exc.__class__.__name__}") from None
        if not isinstance(document, dict):
            raise TokenError(f"{method} {redact_url(url)}: not a JSON object")
        return document


def load_jwks_file(name: str, base_dir: Path | None) -> jwt.PyJWKSet:
    """The key set in the file `name` (relative to `base_dir`). Raises ConfigError naming the file."""
    path = Path(name)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        return jwt.PyJWKSet.from_json(path.read_text())
    except (OSError, ValueError, jwt.PyJWTError) as exc:
        raise ConfigError(f"auth.jwt.jwks_file {path}: {exc.__class__.__name__}: {exc}") from None


def basic_auth(client_id: str, client_secret: str) -> str:
    """An `Authorization: Basic` value for OAuth client credentials: each part form-urlencoded
    first (RFC 6749 §2.3.1), so a `:` or a non-ASCII character in them is carried intact."""
    return aiohttp.encode_basic_auth(quote_plus(client_id), quote_plus(client_secret))


def _find(keys: jwt.PyJWKSet | None, kid: Any) -> jwt.PyJWK | None:
    """The key `kid` names (the first of the set when the token names none: its signature must
    still verify with it)."""
    if keys is None:
        return None
    return next((k for k in keys.keys if kid is None or k.key_id == kid), None)


_ALG_FAMILIES = {"RSA": ("RS", "PS"), "EC": ("ES",), "OKP": ("EdDSA", "Ed"), "oct": ("HS",)}


def _algorithms_for(key: jwt.PyJWK, configured: list[str]) -> list[str]:
    """The configured algorithms that `key` can verify: its own `alg` when the JWK names one,
    else those of its key type (RSA: RS*/PS*, EC: ES*, OKP: EdDSA)."""
    data = getattr(key, "_jwk_data", {}) or {}
    if isinstance(data.get("alg"), str):
        return [alg for alg in configured if alg == data["alg"]]
    prefixes = _ALG_FAMILIES.get(str(data.get("kty")), ())
    return [alg for alg in configured if alg.startswith(prefixes)] if prefixes else []
