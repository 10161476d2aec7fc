"""The proxy-wide config sections: where it listens, who may call it, limits, logs and metrics.

`model.py` holds the servers and the whole file; `proxy.config` exports the names of both. Every
wait a section configures is a duration with a unit; every default is the safe one.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from typing import Literal
from urllib.parse import urlsplit

import limits
from pydantic import Field, ValidationInfo, field_validator, model_validator

from proxy.config.base import Duration, redact_url, token_hash_problem, url_problem
from proxy.config.base import Strict as _Strict

MIN_SSE_KEEPALIVE_S = 0.01  # the shortest `listen.sse_keepalive` (s) accepted


class ListenConfig(_Strict):
    """Where the proxy listens. `port` 0 picks a free port.

    `header_timeout` (s) bounds reading a request head and idle keep-alive connections,
    `body_timeout` (s) reading a body (408 after it); `max_connections` caps open connections;
    `event_loop` picks the process's loop (`runtime.event_loop`). `trusted_proxies`: the load
    balancers whose X-Forwarded-For / X-Forwarded-Proto are believed (none by default).
    `legacy_session_idle` (s): when an unused legacy session is forgotten.
    """

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    allowed_hosts: list[str] | None = Field(
        None,
        description="Host/Origin names accepted (DNS-rebinding guard); default: localhost names when bound "
        "to loopback, else any",
    )
    max_body: int = Field(4 * 1024 * 1024, ge=1024, description="largest accepted request body, in bytes")
    sse_keepalive: Duration = Field(
        "15s",
        validate_default=True,
        description="SSE comment interval on long synchronous calls and every relayed legacy SSE stream",
    )
    replay_events: int = Field(
        256,
        ge=1,
        le=100_000,
        description="events kept per relayed legacy SSE stream for Last-Event-ID resumption",
    )
    replay_bytes: int = Field(
        1024 * 1024,
        ge=1024,
        description="bytes kept per relayed legacy SSE stream for Last-Event-ID resumption",
    )
    drain_timeout: Duration = Field(
        "30s", validate_default=True, description="on SIGTERM, how long synchronous calls may finish"
    )
    drain_detached: Duration = Field(
        "10m",
        validate_default=True,
        description="replicas only: on SIGTERM, how long the detached calls this replica runs may go on "
        "(other replicas serve their polls)",
    )
    drain_grace: Duration = Field(
        "5s",
        validate_default=True,
        description="replicas only: on SIGTERM, how long a draining replica keeps listening at least "
        "(/readyz 503, new calls 503, polls served) before it stops, even with nothing left to run, so "
        "its load balancer's health checks take it out first; a replica that stops sooner closes "
        "connections the balancer may be sending a request on (HAProxy then drops the client's "
        "connection unanswered). Set it above the balancer's check interval x fall count; at most "
        "drain_detached. Kubernetes: a preStop sleep covers the Service's update before SIGTERM, so "
        "the grace only adds its length to each pod's stop",
    )
    legacy_session_idle: Duration = Field(
        "1h",
        validate_default=True,
        description="a legacy (2025-06-18 / 2025-11-25) session nobody used for this long, with nothing in "
        "flight, is forgotten and its upstream session DELETEd; a later request on it gets 404",
    )
    header_timeout: Duration = Field(
        "10s",
        validate_default=True,
        description="how long a connection may take to send a complete request head, and stay idle between "
        "requests",
    )
    body_timeout: Duration = Field(
        "30s", validate_default=True, description="how long a client may take to send a request body"
    )
    max_connections: int | None = Field(
        None,
        ge=8,
        description="open client connections at most (more are answered 503 and closed); default: half the "
        "open-file limit",
    )
    public_url: str | None = Field(
        None,
        description="the proxy's public base URL (https://host[:port], no path); an endpoint's OAuth "
        "resource URI is this plus its path. Never taken from a request's Host header",
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="addresses or CIDR networks of load balancers in front of the proxy: only from these "
        "peers are X-Forwarded-For (the client address that credential throttling counts) and "
        "X-Forwarded-Proto (a Secure console cookie) believed. Default: none, every header is ignored",
    )
    event_loop: Literal["asyncio", "auto", "uvloop"] = Field(
        "asyncio",
        description="the process's event loop: asyncio's own; uvloop (0.81-1.13x the CPU per request, "
        "median ~0.93x, in bench/README.md); auto = uvloop when installed. Out of descriptors, both "
        "pause accepting 1 s and log accept_failed",
    )

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        http_url(value, "public_url")
        parts = urlsplit(value)
        if parts.query or parts.fragment or parts.path.strip("/"):
            raise ValueError(
                f"public_url {value[:200]!r} must be scheme://host[:port] without a path, query or "
                "fragment: the metadata of an endpoint lives at "
                "/.well-known/oauth-protected-resource/<its path> (RFC 9728)"
            )
        # the canonical form clients compare `resource` and `aud` with: scheme and host in lower
        # case, no default port (RFC 3986 §6.2.2-6.2.3)
        scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
        default = {"http": 80, "https": 443}[scheme]
        netloc = f"[{host}]" if ":" in host else host
        return f"{scheme}://{netloc}" + (f":{parts.port}" if parts.port not in (None, default) else "")

    @field_validator("legacy_session_idle", "header_timeout", "body_timeout")
    @classmethod
    def _positive_durations(cls, value: float, info: ValidationInfo) -> float:
        if value <= 0:  # (0 is no "off": it cuts every request whose head or body is not there at once)
            raise ValueError(f"{info.field_name} must be longer than 0s")
        return value

    @field_validator("sse_keepalive")
    @classmethod
    def _keepalive_floor(cls, value: float) -> float:
        if value < MIN_SSE_KEEPALIVE_S:  # (0 wrote keepalives without pause: a CPU per open stream)
            raise ValueError(f"sse_keepalive must be at least {MIN_SSE_KEEPALIVE_S * 1000:g}ms")
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _trusted_proxies(cls, value: list[str]) -> list[str]:
        for peer in value:
            try:
                ipaddress.ip_network(peer, strict=False)
            except ValueError:
                raise ValueError(
                    f"trusted_proxies entry {peer!r} is not an IP address or CIDR network"
                ) from None
        return value

    @property
    def max_body_bytes(self) -> int:
        """`max_body` in bytes."""
        return self.max_body

    def trusts_proxy(self, remote: str | None) -> bool:
        """True when the peer address `remote` is one of `trusted_proxies`."""
        return bool(self.trusted_proxies) and _in_networks(remote, self.trusted_proxies)

    def client_address(self, remote: str | None, forwarded_for: list[str]) -> str:
        """The client's address: `remote` (the peer), or, when the peer is a trusted proxy, the
        rightmost X-Forwarded-For entry that is not itself a trusted proxy (RFC 7239 §7.4's advice:
        entries left of it may be forged by the client). `forwarded_for` is every X-Forwarded-For
        line, in order (a balancer adds a line of its own after the client's); an
        entry that is not an IP address ends the walk at the peer. `unknown` without a peer address."""
        address = remote or "unknown"
        if not forwarded_for or not self.trusts_proxy(remote):
            return address
        for entry in reversed(",".join(forwarded_for).split(",")):
            entry = entry.strip()
            if not entry:
                continue
            try:
                ipaddress.ip_address(entry)
            except ValueError:
                return address  # not an address: nothing left of it can be believed
            if not _in_networks(entry, self.trusted_proxies):
                return entry
        return address

    def via_https(self, remote: str | None, forwarded_proto: str | None, *, tls: bool) -> bool:
        """True when the client's request came over HTTPS: this connection is TLS (`tls`), or a trusted
        proxy says `X-Forwarded-Proto: https` (its last value)."""
        if tls:
            return True
        if forwarded_proto is None or not self.trusts_proxy(remote):
            return False
        return forwarded_proto.rsplit(",", 1)[-1].strip().lower() == "https"


def _no_shared_hashes(tokens: dict[str, str]) -> None:
    """ValueError when two names share one token hash (one token, two identities: which one wins is
    an accident)."""
    seen: dict[str, str] = {}
    for name, digest in tokens.items():
        key = digest.lower()
        if key in seen:
            raise ValueError(
                f"tokens.{seen[key]} and tokens.{name} have the same hash: give each its own token"
            )
        seen[key] = name


def _in_networks(address: str | None, networks: list[str]) -> bool:
    """True when `address` (an IP, a zone suffix allowed) lies in one of `networks` (IPs or CIDR)."""
    try:
        ip = ipaddress.ip_address((address or "").split("%")[0])
    except ValueError:
        return False
    return any(ip in _network(network) for network in networks)


@functools.lru_cache(maxsize=256)  # configured networks, parsed once, not per request
def _network(network: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(network, strict=False)


class ReplicasConfig(_Strict):
    """Several proxy processes (replicas) on one shared store, started from one config file.

    `secret` (at least 32 characters, usually `${MCP_REPLICA_SECRET}`) authenticates the replicas
    to each other on their internal endpoints (`/_replica/...`, which do not exist without it).
    `advertise` is the base URL the other replicas reach this one at; `{port}` (and `{host}`) are
    replaced by the address this process listens on, so one file serves every replica. Without it
    the address is derived from the listen host and port (the host must then be a concrete address,
    not `0.0.0.0`). `hop_timeout` (s) bounds one replica-to-replica request (connect and answer).
    """

    secret: str = Field(
        min_length=32, description="shared by all replicas; authenticates their internal requests"
    )
    advertise: str | None = Field(
        None,
        description="base URL the other replicas use, like http://10.0.0.5:{port}; default from listen "
        "host/port",
    )
    hop_timeout: Duration = Field(
        "2s", validate_default=True, description="bound on one replica-to-replica request"
    )

    @model_validator(mode="after")
    def _advertise(self) -> ReplicasConfig:
        if self.advertise is not None and not re.match(r"^https?://[^/?#]+/?$", self.advertise):
            raise ValueError(
                "advertise must be a base URL like http://10.0.0.5:{port} (scheme and host[:port], no path)"
            )
        if self.hop_timeout <= 0:
            raise ValueError("hop_timeout must be longer than 0s")
        return self


class StoreConfig(_Strict):
    """The task store: a diskcache directory (`path`, served by one proxy process at a time: an OS
    lock), or a Redis server (`url`, shared by any number of replicas). Give one of the two;
    without either, `path` defaults to `./var/tasks`.

    `url`: `redis://[:password@]host[:port][/db]` or `rediss://` (TLS); write the password as
    `${VAR}` (it never appears in logs, errors, /readyz or the console). `prefix`: the start of
    every Redis key. `timeout` (s): bound on each Redis call (connect, reply, pooled connection).
    `durable` (diskcache only) fsyncs every batch of writes (group commit); with Redis, durability
    is Redis's own persistence setting (README "Redis store"). `lease` (s): how long this
    process's claim on the calls it runs lasts without renewal (renewed every sixth of it); a task
    whose owner's lease lapsed is ended (or re-run) by the sweep, which runs every half lease.
    `write_retry` (s): how long an outcome write the store refuses is retried before the task is
    shown `failed`, naming the store.
    """

    path: str = "./var/tasks"
    url: str | None = Field(
        None, description="redis:// or rediss:// URL of a shared Redis store (instead of `path`)"
    )
    prefix: str = Field(
        "mcp-tasks-proxy:",
        min_length=1,
        max_length=100,
        description="start of every Redis key (Redis store only)",
    )
    timeout: Duration = Field(
        "5s", validate_default=True, description="bound on each Redis call (Redis store only)"
    )
    durable: bool = True
    lease: Duration = Field("15s", validate_default=True)
    write_retry: Duration = Field("5s", validate_default=True)

    @field_validator("lease", "write_retry", "timeout")
    @classmethod
    def _positive_store_durations(cls, value: float, info: ValidationInfo) -> float:
        if value <= 0:
            raise ValueError(f"store.{info.field_name} must be longer than 0s")
        if info.field_name == "lease" and value < 0.1:
            raise ValueError("store.lease must be at least 100ms (it is renewed every sixth of it)")
        return value

    @model_validator(mode="after")
    def _one_backend(self) -> StoreConfig:
        if self.url is None:
            return self
        if "path" in self.model_fields_set:
            raise ValueError("give either store.path (a diskcache directory) or store.url (Redis), not both")
        try:
            parts = urlsplit(self.url)
            parts.port  # noqa: B018 (raises ValueError for a bad port)
        except ValueError:
            raise ValueError("store.url is not a valid URL (redis://host:port/db)") from None
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            raise ValueError("store.url must be redis://host[:port][/db] or rediss://host[:port][/db]")
        if problem := url_problem(self.url):
            raise ValueError(f"store.url {redact_url(self.url)!r} cannot be used: {problem}")
        if parts.path.strip("/") and not parts.path.strip("/").isdigit():
            raise ValueError("store.url: the path must be a database number (redis://host:port/0)")
        return self

    @property
    def redis(self) -> bool:
        """True when the store is Redis (`url` given)."""
        return self.url is not None

    @property
    def where(self) -> str:
        """The store for messages: the directory, or the Redis URL without its password."""
        return self.path if self.url is None else redact_url(self.url)


class RequestStateConfig(_Strict):
    """Signing of MRTR `requestState` (HMAC-SHA256). Without `secret`, a key is generated once and
    kept beside the store (`<store.path>/request_state.key`), or in Redis with a Redis store (one
    key for every replica)."""

    secret: str | None = Field(None, min_length=32)


def http_url(value: str, name: str) -> str:
    """`value` when it is an http:// or https:// URL with a host and no user or password in it;
    else ValueError, naming `name` and never the credentials."""
    try:
        parts = urlsplit(value)
        has_credentials = parts.username is not None or parts.password is not None
    except ValueError:
        raise ValueError(f"{name} is not a URL") from None
    if has_credentials:
        raise ValueError(f"{name} must not carry a user or password in the URL")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{name} {redact_url(value)!r} must be an http:// or https:// URL")
    if problem := url_problem(value):
        raise ValueError(f"{name} {redact_url(value)!r} cannot be used: {problem}")
    return value


class IntrospectionConfig(_Strict):
    """RFC 7662 token introspection for opaque (non-JWT) access tokens, with the proxy's own client
    credentials (HTTP Basic). `endpoint` defaults to the authorization server's
    `introspection_endpoint` (discovered from `jwt.issuer`). `cache` (s) bounds how long an answer
    is reused; never past the token's `exp`."""

    client_id: str = Field(min_length=1)
    client_secret: str = Field(min_length=1)
    endpoint: str | None = None
    cache: Duration = Field("5m", validate_default=True)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        return http_url(value, "introspection.endpoint") if value is not None else None


ANY_AUDIENCE = "*"  # `auth.jwt.audience` that accepts tokens issued for any audience (written out)


class JwtConfig(_Strict):
    """Access-token verification (RFC 9068 JWTs, checked by PyJWT). Keys from `jwks_file` (relative
    to the config file), `jwks_url`, or, with neither, the `jwks_uri` the `issuer` publishes (RFC 8414
    `/.well-known/oauth-authorization-server`, then OpenID discovery). `issuer` is checked when
    given; `audience` defaults to the resource URI of the endpoint a request came to (with
    `listen.public_url`; without it, `audience` is required), and `"*"` (ANY_AUDIENCE, written out)
    accepts any audience. The principal is the `principal_claim` claim (`client:<client_id>` when
    a client-credentials token has no `sub`). `jwks_timeout` (s) bounds each metadata, JWKS or
    introspection request; `refetch_interval` (s) is the least time between two JWKS fetches for an
    unknown `kid`. `leeway_s` (s) is the clock skew allowed on `exp`/`nbf`."""

    jwks_file: str | None = None
    jwks_url: str | None = None
    issuer: str | None = None
    audience: str | None = None
    algorithms: list[str] = Field(default_factory=lambda: ["RS256", "ES256"], min_length=1)
    principal_claim: str = Field("sub", min_length=1)
    leeway_s: float = Field(30.0, ge=0, description="clock skew allowed on exp/nbf, in seconds")
    jwks_timeout: Duration = Field(
        "10s",
        validate_default=True,
        description="how long fetching the issuer's metadata, the JWKS or an introspection may take",
    )
    refetch_interval: Duration = Field(
        "30s", validate_default=True, description="least time between JWKS fetches for an unknown kid"
    )
    introspection: IntrospectionConfig | None = None

    @field_validator("issuer", "jwks_url")
    @classmethod
    def _urls(cls, value: str | None, info: ValidationInfo) -> str | None:
        return http_url(value, f"jwt.{info.field_name}") if value is not None else None

    @field_validator("jwks_timeout")
    @classmethod
    def _bounded(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("jwks_timeout must be more than 0 s: every wait has a bound")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> JwtConfig:
        if self.jwks_file and self.jwks_url:
            raise ValueError("give at most one of `jwks_file` and `jwks_url`")
        if not (self.jwks_file or self.jwks_url or self.issuer):
            raise ValueError(
                "give `issuer` (its keys are discovered from its metadata), `jwks_url` or `jwks_file`"
            )
        if self.introspection is not None and not (self.introspection.endpoint or self.issuer):
            raise ValueError("introspection needs `endpoint`, or `issuer` to discover it from")
        return self


class TrustedHeaderConfig(_Strict):
    """A header set by a fronting auth proxy. `trusted_peers` lists the peer addresses or networks
    (CIDR) allowed to set it; it is required, and `any` (trust the header from every peer, only
    safe when nothing but the auth proxy can reach this port) must be written out explicitly."""

    name: str = "X-Forwarded-User"
    trusted_peers: list[str] | Literal["any"] = Field(default_factory=list)

    @model_validator(mode="after")
    def _peers(self) -> TrustedHeaderConfig:
        if self.trusted_peers == "any":
            return self
        if not self.trusted_peers:
            raise ValueError(
                "trusted_peers is required: list the addresses (or CIDR networks) of the auth proxy that "
                "sets "
                f"{self.name}, or write `trusted_peers: any` to trust the header from every peer"
            )
        for peer in self.trusted_peers:
            try:
                ipaddress.ip_network(peer, strict=False)
            except ValueError:
                raise ValueError(
                    f"trusted_peers entry {peer!r} is not an IP address or CIDR network"
                ) from None
        return self

    def trusts(self, remote: str | None) -> bool:
        """True when a request from peer address `remote` may set the header."""
        if self.trusted_peers == "any":
            return True
        return _in_networks(remote, self.trusted_peers)


class AuthConfig(_Strict):
    """Inbound authentication. `tokens` maps principal names to `sha256:<hex>` token hashes
    (`mcp-tasks-proxy hash-token` prints one); plain tokens are never written in the config."""

    mode: Literal["none", "bearer", "jwt", "header"] = "none"
    tokens: dict[str, str] = Field(default_factory=dict)
    jwt: JwtConfig | None = None
    header: TrustedHeaderConfig | None = None
    scopes: dict[str, dict[str, list[str]]] = Field(
        default_factory=dict,
        description="mode jwt: OAuth scopes a token needs, {SERVER: {'*': [every tool], TOOL: [that tool]}}",
    )
    resource_documentation: str | None = Field(
        None, description="a URL for people, served in the protected resource metadata"
    )

    @field_validator("resource_documentation")
    @classmethod
    def _documentation(cls, value: str | None) -> str | None:
        return http_url(value, "resource_documentation") if value is not None else None

    @model_validator(mode="after")
    def _complete(self) -> AuthConfig:
        # A section another mode reads is a mistake, never a silently open (or differently guarded)
        # proxy: `tokens` without `mode: bearer` would let every client in as `anonymous`.
        for section, needs in (("tokens", "bearer"), ("jwt", "jwt"), ("header", "header")):
            if getattr(self, section) and self.mode != needs:
                raise ValueError(
                    f"auth.{section} is set but auth.mode is {self.mode!r}: it is read by mode {needs} only; "
                    f"set `mode: {needs}`, or remove auth.{section}"
                )
        if self.mode == "bearer":
            if not self.tokens:
                raise ValueError("mode bearer needs `tokens` (principal: sha256:<hex>)")
            for name, digest in self.tokens.items():
                if problem := token_hash_problem(f"tokens.{name}", digest):
                    raise ValueError(problem)
            _no_shared_hashes(self.tokens)
        if self.mode == "jwt" and self.jwt is None:
            raise ValueError("mode jwt needs a `jwt` section")
        if self.scopes and self.mode != "jwt":
            raise ValueError("auth.scopes needs mode jwt (only OAuth access tokens carry scopes)")
        for server, tools in self.scopes.items():
            for tool, needed in tools.items():
                if not all(re.fullmatch(r"[\x21\x23-\x5b\x5d-\x7e]+", scope) for scope in needed):
                    raise ValueError(
                        f"auth.scopes.{server}.{tool}: a scope is a non-empty token (RFC 6749 3.3)"
                    )
        if self.mode == "header" and self.header is None:
            raise ValueError(
                "mode header needs a `header` section with `trusted_peers` (the auth proxy's addresses, or "
                "`any`)"
            )
        return self


class LimitsConfig(_Strict):
    """Limits; each refusal is a JSON-RPC error naming the limit (HTTP 429 for rates and counts).

    `max_tasks_per_principal`: live (non-terminal) tasks one principal may have.
    `max_sessions_per_principal`: legacy sessions one principal may hold open on one server of one
    replica, its initializes in flight included (more: HTTP 429 before the upstream sees the
    initialize; a DELETE or `listen.legacy_session_idle` frees a place). `max_ttl`: upper
    bound of any task's retention (larger configured ttls are capped). `max_result_bytes`: the
    largest result stored for a task (larger: the task fails naming the limit). `tasks_rate`:
    tasks/* calls per principal, as `N/second`, `N/minute` (a moving window; HTTP 429 with
    `Retry-After` past it). `failed_auth`:
    credentials checked per client address in a moving window (HTTP 429 with `Retry-After` past it).
    """

    max_tasks_per_principal: int | None = Field(None, ge=1)
    max_sessions_per_principal: int | None = Field(
        None,
        ge=1,
        description="legacy sessions one principal may hold open on one server of one replica (its "
        "initializes in flight included); more: HTTP 429 naming the limit. null: no cap",
    )
    max_ttl: Duration | None = None
    max_result_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    tasks_rate: str | None = Field(
        None, description="tasks/* calls per principal, like `20/second` or `600/minute`"
    )
    failed_auth: str | None = Field(
        "20/minute",
        description="credentials (client bearer and access tokens, console tokens and sign-ins, the "
        "metrics token) one client address may have checked in a moving window, like `20/minute`; each "
        "not yet seen to verify counts before it is checked; past the rate every such credential from "
        "that address gets HTTP 429 with Retry-After until the window frees. Counted in the store's "
        "counters (shared by replicas on Redis). null: no limit",
    )

    @model_validator(mode="after")
    def _rate(self) -> LimitsConfig:
        for name in ("tasks_rate", "failed_auth"):
            rate = getattr(self, name)
            if rate is not None:
                try:
                    rates = limits.parse_many(rate)
                except ValueError:
                    raise ValueError(f"{name} {rate!r} must look like `20/second` or `600/minute`") from None
                if len(rates) > 1:  # (`limits.parse` would keep the first and drop the others unsaid)
                    raise ValueError(f"{name} {rate!r} names {len(rates)} rates; give one, like `20/second`")
                amount = rates[0].amount
                if amount < 1:
                    raise ValueError(f"{name} {rate!r} allows nothing; write null to turn the limit off")
                window = limits.util.SINGLE_EXPR.match(rate)
                if window is not None and window.group(3) is not None and int(window.group(3)) == 0:
                    # (`limits` reads a window of 0 as 1: "1/0second" would count per second unsaid)
                    raise ValueError(f"{name} {rate!r} has a window of 0; give one like `20/second`")
        return self


class LoggingConfig(_Strict):
    """Logs: JSON lines on stderr (a readable renderer on a terminal). `log_payloads: true` also logs
    request bodies (they may contain personal data and secrets; off by default)."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    log_payloads: bool = False


class MetricsConfig(_Strict):
    """`/metrics`: open by default (bind to loopback or keep it behind a firewall); with `token`
    (a `sha256:<hex>` hash, as `mcp-tasks-proxy hash-token` prints) it needs `Authorization: Bearer
    <token>`."""

    token: str | None = None

    @field_validator("token")
    @classmethod
    def _token(cls, value: str | None) -> str | None:
        if value is not None and (problem := token_hash_problem("token", value)):
            raise ValueError(problem)
        return value


class TracingConfig(_Strict):
    """OpenTelemetry traces, exported over OTLP/HTTP (protobuf). Off unless `otlp_endpoint` is set
    here or the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`
    variables are (`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn it off again).
    `sample_ratio` is the share of new traces kept (0..1); a request that arrives with a sampled
    `traceparent` is always kept (parent-based). Unset, `OTEL_TRACES_SAMPLER_ARG` or 1.0. The other
    `OTEL_*` variables (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_EXPORTER_OTLP_HEADERS`,
    timeouts) apply as the OpenTelemetry SDK defines them."""

    otlp_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces; unset: the OTEL_* variables",
    )
    sample_ratio: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="share of new traces sampled (0..1); unset: OTEL_TRACES_SAMPLER_ARG or 1",
    )
    service_name: str = Field(
        "mcp-tasks-proxy", min_length=1, description="service.name of the spans (OTEL_SERVICE_NAME wins)"
    )

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return value
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https"):
            raise ValueError("otlp_endpoint must be an http:// or https:// URL (OTLP over HTTP)")
        if parts.username or parts.password or parts.query:
            raise ValueError(
                "otlp_endpoint must hold no user, password or query (they would reach the logs); send "
                "credentials in OTEL_EXPORTER_OTLP_HEADERS"
            )
        if problem := url_problem(value):
            raise ValueError(f"otlp_endpoint {redact_url(value)!r}: {problem}")
        return value


class ConsoleConfig(_Strict):
    """The operator console at `/console/` (off unless this section is present).

    `tokens` maps operator names to `sha256:<hex>` token hashes (`mcp-tasks-proxy hash-token`);
    a console token is accepted as `Authorization: Bearer <token>` or through the sign-in form,
    which sets a session cookie lasting `session_ttl` (s). Sessions are kept in the task store, so
    they survive a restart and hold on every replica; signing out ends one everywhere. The cookie is
    Secure per `secure_cookie`. Console tokens are never client principals, and client tokens
    (`auth.tokens`) never open the console.
    """

    tokens: dict[str, str] = Field(
        min_length=1, description="operator name: sha256:<hex> hash of its console token"
    )
    session_ttl: Duration = Field("8h", validate_default=True, description="how long a console sign-in lasts")
    secure_cookie: bool | None = Field(
        None,
        description="mark the session cookie Secure: true always; unset (the default) when the sign-in "
        "came over TLS, or through one of listen.trusted_proxies that sent X-Forwarded-Proto: https",
    )

    @model_validator(mode="after")
    def _hashes(self) -> ConsoleConfig:
        for name, digest in self.tokens.items():
            if problem := token_hash_problem(f"tokens.{name}", digest):
                raise ValueError(problem)
        _no_shared_hashes(self.tokens)
        if self.session_ttl <= 0:
            raise ValueError("session_ttl must be longer than 0s")
        return self

    def hashes(self) -> dict[str, str]:
        """Lower-case hex digests (without `sha256:`) to operator names."""
        return {digest.removeprefix("sha256:").lower(): name for name, digest in self.tokens.items()}
