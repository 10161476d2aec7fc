"""The config file as pydantic models: the servers (`mcpServers`, Claude Desktop / `.mcp.json`
entries), their task policies, and the whole file (`Config`).

Contract (design.md "Config contract"): `mcpServers` accepts Claude Desktop / `.mcp.json` entries;
proxy concerns (`listen`, `store`, `tasks`, ...) sit beside it (`config.sections`); durations are
strings with units (`500ms`, `30s`, `10m`, `1h`); unknown keys are errors that name the key's path.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from proxy.config.base import Duration, redact_url, url_problem
from proxy.config.base import Strict as _Strict
from proxy.config.sections import (
    ANY_AUDIENCE,
    AuthConfig,
    ConsoleConfig,
    LimitsConfig,
    ListenConfig,
    LoggingConfig,
    MetricsConfig,
    ReplicasConfig,
    RequestStateConfig,
    StoreConfig,
    TracingConfig,
    http_url,
)

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class ToolMode(StrEnum):
    """How a tool may become a task."""

    # a task when still running after detach_after and the request declared the extension
    OPTIONAL = "optional"
    REQUIRED = "required"  # always a task; requests without the extension get -32021
    FORBIDDEN = "forbidden"  # never a task


def _positive(value: float | None, field: str) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{field} must be longer than 0s")


class TaskPolicy(_Strict):
    """Task settings; every field may be left out to inherit from the level above.

    `detach_after` (s): how long a call runs synchronously before it becomes a task.
    `ttl` (s): retention of a task after it ends (a running task never expires). `poll_interval` (s): the poll
    interval suggested to clients. `input_timeout` (s): how long a question from the upstream
    (elicitation, sampling, roots) may stay unanswered before the call fails.
    `idempotency_window` (s): how long a client's idempotency key holds after the call it named
    ended (a retry with the key within it joins that call instead of running it again).
    `progress_interval` (s): at most one store write of a detached call's progress text per this
    long (the latest text always lands, with the outcome at the latest); relaying progress to a
    connected client is never held back by it.
    """

    detach_after: Duration | None = None
    ttl: Duration | None = None
    poll_interval: Duration | None = None
    input_timeout: Duration | None = None
    idempotency_window: Duration | None = None
    progress_interval: Duration | None = None

    @field_validator("ttl", "poll_interval", "input_timeout", "idempotency_window", "progress_interval")
    @classmethod
    def _positive_durations(cls, value: float | None, info: ValidationInfo) -> float | None:
        _positive(value, info.field_name or "duration")
        return value


class Dedupe(_Strict):
    """Duplicate joining without a key, for clients that retry blindly: a call of this tool from the
    same principal with the same canonical arguments as one still running, or one that ended less
    than `window` (s) ago, joins that call (its task, or its outcome) instead of running again.
    Off unless set: two identical calls can be meant (two "add one" calls are two)."""

    window: Duration

    @field_validator("window")
    @classmethod
    def _positive_window(cls, value: float) -> float:
        _positive(value, "dedupe.window")
        return value


class ToolTasks(TaskPolicy):
    """Per-tool task settings. `on_restart`: what happens to a detached call of this tool that was
    running when the proxy died: `fail` (the task fails, naming the restart) or `rerun` (the call
    is sent again after the restart; for idempotent tools only, since the first run may have had
    effects; its arguments are then kept in the store). `dedupe`: join identical calls (Dedupe)."""

    mode: ToolMode = ToolMode.OPTIONAL
    on_restart: Literal["fail", "rerun"] = "fail"
    dedupe: Dedupe | None = None


class ServerTasks(TaskPolicy):
    """Per-server task settings and per-tool overrides."""

    tools: dict[str, ToolTasks] = Field(default_factory=dict)


class DefaultTasks(_Strict):
    """Defaults for every server."""

    detach_after: Duration = Field("10s", validate_default=True)
    ttl: Duration = Field("1h", validate_default=True)
    poll_interval: Duration = Field("2s", validate_default=True)
    input_timeout: Duration = Field("10m", validate_default=True)
    idempotency_window: Duration = Field("24h", validate_default=True)
    progress_interval: Duration = Field("1s", validate_default=True)

    @field_validator("ttl", "poll_interval", "input_timeout", "idempotency_window", "progress_interval")
    @classmethod
    def _positive_durations(cls, value: float | None, info: ValidationInfo) -> float | None:
        _positive(value, info.field_name or "duration")
        return value


_TRANSPORT_KINDS = ("stdio", "http", "streamable-http", "streamablehttp", "sse")
_CLIENT_ONLY_KEYS = (
    "disabled",
    "enabled",
    "alwaysAllow",
    "autoApprove",
    "trust",
    "description",
    "disabledTools",
    "timeout_ms",
)


def _has_credentials(url: str) -> bool:
    """True when `url` names a user or password (`http://user:password@host/...`)."""
    try:
        parts = urlsplit(url)
        return parts.username is not None or parts.password is not None
    except ValueError:
        return False


class UpstreamOAuth(_Strict):
    """The proxy's own OAuth 2.1 client-credentials grant toward an upstream that wants a token
    (the client's token never goes upstream). `token_url` is the authorization server's token
    endpoint; `client_secret` usually `${ENV_VAR}`; `scope` and `resource` (RFC 8707) are sent when
    given. The token is kept until `refresh_before` (s) ahead of its expiry, and fetched again once
    when the upstream answers 401."""

    token_url: str
    client_id: str = Field(min_length=1)
    client_secret: str = Field(min_length=1)
    scope: str | None = None
    resource: str | None = None
    refresh_before: Duration = Field("60s", validate_default=True)

    @field_validator("token_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        return http_url(value, "oauth.token_url")


class ServerEntry(_Strict):
    """One upstream MCP server, in the Claude Desktop / `.mcp.json` shape plus proxy keys.

    Remote: `url` (Streamable HTTP; Gemini's `httpUrl` too), `headers`, `oauth` (the proxy's client
    credentials). Stdio: `command`, `args`, `env` (added to the proxy's environment), `cwd`.
    `timeout` (s) is the hard limit of one upstream call (tools/call, prompts/get, resources/read);
    `request_timeout` (s) bounds every other upstream request (tools/list, …); `init_timeout` (s)
    the `initialize` handshake; `connect_timeout` (s) a TCP connect (HTTP); `keepalive_timeout` (s)
    how long an idle pooled connection to an HTTP upstream is kept (below the server's own keep-alive:
    `upstream.connections`); `max_response_bytes` the largest upstream reply (larger: a JSON-RPC
    error).
    Stdio only: `instances` children per capability set, `max_concurrency` requests in flight,
    `isolation: per_principal` for a child per principal (at most `max_children` at once, each
    stopped after `idle_timeout`, 10m by default then), `idle_timeout` (s) to stop an unused child,
    `max_restarts` quick exits in a row before the server counts as crash-looping.
    """

    url: str | None = None
    httpUrl: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    oauth: UpstreamOAuth | None = None
    command: str | None = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    type: str | None = None
    transport: str | None = None
    transportType: str | None = None
    timeout: Duration = Field("30m", validate_default=True)
    tasks: ServerTasks = Field(default_factory=ServerTasks)
    instances: int = Field(1, ge=1, le=64)
    max_concurrency: int | None = Field(None, ge=1)
    isolation: Literal["shared", "per_principal"] = "shared"
    idle_timeout: Duration | None = None
    init_timeout: Duration = Field("30s", validate_default=True)
    request_timeout: Duration = Field("30s", validate_default=True)
    connect_timeout: Duration = Field("10s", validate_default=True)
    keepalive_timeout: Duration = Field(
        "4s",
        validate_default=True,
        description="HTTP: how long an idle connection to the upstream is kept for reuse; keep it below "
        "the server's own keep-alive (uvicorn's is 5 s), or reused connections the server closed fail",
    )
    max_response_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    max_children: int = Field(
        32, ge=1, description="isolation per_principal: children running at once, across principals"
    )
    max_restarts: int = Field(5, ge=1)
    disabled: bool = False
    enabled: bool = True
    alwaysAllow: list[str] | None = None
    autoApprove: list[str] | None = None
    trust: bool | None = None
    description: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_client_only(cls, data: Any) -> Any:
        """Accept (and ignore) client-only keys that have no field here, like `disabledTools`."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k in cls.model_fields or k not in _CLIENT_ONLY_KEYS}
        return data

    @model_validator(mode="after")
    def _one_transport(self) -> ServerEntry:
        if self.httpUrl and not self.url:
            self.url = self.httpUrl
        if self.url:
            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"url {redact_url(self.url)!r} must be an http:// or https:// URL")
            if problem := url_problem(self.url):
                raise ValueError(f"url {redact_url(self.url)!r} cannot be used: {problem}")
        if bool(self.url) == bool(self.command):
            raise ValueError("give either `url` (Streamable HTTP) or `command` (stdio), exactly one")
        if self.oauth is not None and not self.url:
            raise ValueError("`oauth` (the proxy's client credentials) is for an upstream `url`")
        authorization = any(k.lower() == "authorization" for k in self.headers)
        if self.oauth is not None and authorization:
            raise ValueError("give either `oauth` or an Authorization header, not both")
        if self.url and (authorization or self.oauth is not None) and _has_credentials(self.url):
            raise ValueError(
                "the url carries a user and password and an Authorization header (or oauth) is given too: "
                "an HTTP request can carry only one; keep one of them"
            )
        kind = (self.type or self.transport or self.transportType or "").lower().replace("_", "-")
        if kind and kind not in _TRANSPORT_KINDS:
            raise ValueError(f"unknown transport {kind!r}; use stdio or http (streamable-http)")
        if kind == "sse":
            raise ValueError("the legacy HTTP+SSE transport is not supported; use a Streamable HTTP url")
        if kind == "stdio" and not self.command:
            raise ValueError("transport stdio needs `command`")
        if kind and kind != "stdio" and not self.url:
            raise ValueError(f"transport {kind} needs `url`")
        durations = ("timeout", "init_timeout", "request_timeout", "connect_timeout", "keepalive_timeout")
        zero = [name for name in durations if (value := getattr(self, name)) is not None and value <= 0]
        if zero:  # all at once: one run of check-config names them all
            named = zero[0] if len(zero) == 1 else ", ".join(zero[:-1]) + " and " + zero[-1]
            raise ValueError(named + (" must be" if len(zero) == 1 else " must each be") + " longer than 0s")
        if self.isolation == "per_principal" and self.idle_timeout is None:
            self.idle_timeout = 600.0  # a child per principal must not outlive its principal's use of it
        return self

    @property
    def active(self) -> bool:
        """False when the entry is switched off with `disabled: true` or `enabled: false`."""
        return self.enabled and not self.disabled


class ResolvedPolicy(BaseModel):
    """The effective task policy of one tool: durations in seconds, `timeout` the hard limit (s),
    `dedupe_window` (s) None when the tool does not join identical calls, `progress_interval` (s)
    the least time between two store writes of one task's progress text. Read-only: `Config.policy`
    hands one instance to every call of a configured tool, and one to all other tools of a server
    (`model_copy(update=...)` for a variant)."""

    model_config = ConfigDict(frozen=True)

    mode: ToolMode
    on_restart: Literal["fail", "rerun"] = "fail"
    detach_after: float
    ttl: float
    poll_interval: float
    input_timeout: float
    timeout: float
    idempotency_window: float = 86400.0
    dedupe_window: float | None = None
    progress_interval: float = 1.0


class Config(_Strict):
    """The whole config file."""

    # Resolved policies, kept: a Config is read-only once a proxy serves it (changes after the first
    # `policy` call are not seen); `model_copy` starts the copy's own.
    _policies: dict[tuple[str, str | None], ResolvedPolicy] = PrivateAttr(default_factory=dict)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    listen: ListenConfig = Field(default_factory=ListenConfig)
    request_state: RequestStateConfig = Field(default_factory=RequestStateConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    tasks: DefaultTasks = Field(default_factory=DefaultTasks)
    mcpServers: dict[str, ServerEntry] = Field(default_factory=dict)
    console: ConsoleConfig | None = Field(
        None, description="the operator console at /console/; off when absent"
    )
    replicas: ReplicasConfig | None = Field(
        None, description="several proxies on one shared store; off when absent"
    )

    @model_validator(mode="after")
    def _names(self) -> Config:
        for name in self.mcpServers:
            if not _NAME.match(name):
                raise ValueError(f"server name {name!r} must match {_NAME.pattern} (it becomes a URL path)")
        if not self.servers:
            raise ValueError("mcpServers must configure at least one enabled server")
        if self.replicas is not None and not self.store.redis:
            raise ValueError("replicas need a shared store: set store.url (redis://host:port/db)")
        unknown = sorted(set(self.auth.scopes) - set(self.mcpServers))
        if unknown:
            raise ValueError(f"auth.scopes names servers that are not configured: {', '.join(unknown)}")
        if self.console is not None:
            clients = {digest.removeprefix("sha256:").lower() for digest in self.auth.tokens.values()}
            for name, digest in self.console.tokens.items():
                if digest.removeprefix("sha256:").lower() in clients:
                    raise ValueError(
                        f"console.tokens.{name} is also a client token in auth.tokens; give the console a "
                        f"token of its own"
                    )
        jwt = self.auth.jwt
        if (
            self.auth.mode == "jwt"
            and jwt is not None
            and jwt.audience is None
            and not self.listen.public_url
        ):
            raise ValueError(
                "auth.mode jwt needs an audience to check tokens against: set listen.public_url (each "
                "endpoint's resource URI is its audience, and MCP clients can discover where to sign in) "
                f'or auth.jwt.audience; audience "{ANY_AUDIENCE}" accepts tokens issued for any audience'
            )
        return self

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Config:
        """A copy, as pydantic's, whose resolved policies start empty (the copy may differ)."""
        copied = super().model_copy(update=update, deep=deep)
        copied._policies = {}
        return copied

    @property
    def servers(self) -> dict[str, ServerEntry]:
        """The enabled servers by name."""
        return {name: entry for name, entry in self.mcpServers.items() if entry.active}

    def tool_mode(self, server: str, tool: str) -> ToolMode:
        """The configured task mode of one tool of one server (what `policy(...).mode` gives,
        without resolving the rest: checked on every legacy `tools/call`)."""
        tool_cfg = self.mcpServers[server].tasks.tools.get(tool)
        return tool_cfg.mode if tool_cfg is not None else ToolMode.OPTIONAL

    def policy(self, server: str, tool: str) -> ResolvedPolicy:
        """Resolve tool → server → defaults for one tool of one server; resolved once per configured
        tool and once per server for every other tool name (they share the server's policy), then
        kept, so a client's arbitrary tool names cannot grow the memo."""
        entry = self.mcpServers[server]
        key = (server, tool if tool in entry.tasks.tools else None)
        policy = self._policies.get(key)
        if policy is None:
            policy = self._policies[key] = self._resolve(entry, entry.tasks.tools.get(tool, ToolTasks()))
        return policy

    def _resolve(self, entry: ServerEntry, tool_cfg: ToolTasks) -> ResolvedPolicy:
        layers: list[TaskPolicy] = [tool_cfg, entry.tasks]

        def pick(field: str) -> float:
            for layer in layers:
                value = getattr(layer, field)
                if value is not None:
                    return value
            return getattr(self.tasks, field)

        ttl = pick("ttl")
        if self.limits.max_ttl is not None:
            ttl = min(ttl, self.limits.max_ttl)
        return ResolvedPolicy(
            mode=tool_cfg.mode,
            on_restart=tool_cfg.on_restart,
            detach_after=pick("detach_after"),
            ttl=ttl,
            poll_interval=pick("poll_interval"),
            input_timeout=pick("input_timeout"),
            timeout=entry.timeout,
            idempotency_window=pick("idempotency_window"),
            progress_interval=pick("progress_interval"),
            dedupe_window=None if tool_cfg.dedupe is None else tool_cfg.dedupe.window,
        )
