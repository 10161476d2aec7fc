"""The config file as pydantic models: loading (YAML or JSON), `${VAR}` interpolation, durations.

Contract (design.md "Config contract"): one file; `mcpServers` accepts Claude Desktop / `.mcp.json`
entries; proxy concerns (`listen`, `store`, `tasks`) sit beside it; durations are strings with
units (`500ms`, `30s`, `10m`, `1h`); unknown keys are errors that name the key's path.
"""

from __future__ import annotations

import json
import os
import re
from urllib.parse import urlsplit
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import expandvars
import limits
import pytimeparse2
import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, WithJsonSchema, field_validator, model_validator

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class ConfigError(Exception):
    """The config file cannot be used; the message names the file and the key path."""


def parse_duration(value: Any) -> float:
    """Parse a duration string with a unit (`500ms`, `30s`, `10m`, `1h`, `1h30m`) into seconds (float).

    Bare numbers are refused because they are ambiguous (ms or s). Raises ValueError.
    """
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueError(f"durations are strings with a unit, like '500ms', '30s' or '10m' (got {value!r})")
    text = value.strip()
    if re.fullmatch(r"[0-9.]+", text):
        raise ValueError(f"duration {value!r} has no unit; write '{text}s' or '{text}ms'")
    seconds = pytimeparse2.parse(text)
    if seconds is None or seconds < 0:
        raise ValueError(f"cannot read {value!r} as a duration; use forms like '500ms', '30s', '10m', '1h'")
    return float(seconds)


Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    WithJsonSchema({"type": "string", "pattern": r"^\s*[0-9.]+\s*(ms|s|m|h|d)", "examples": ["500ms", "30s", "10m", "1h"]}),
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ListenConfig(_Strict):
    """Where the proxy listens. `port` 0 picks a free port."""

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    allowed_hosts: list[str] | None = Field(
        None, description="Host/Origin names accepted (DNS-rebinding guard); default: localhost names when bound to loopback, else any"
    )
    max_body: int = Field(4 * 1024 * 1024, ge=1024, description="largest accepted request body, in bytes")
    sse_keepalive: Duration = Field("15s", validate_default=True, description="SSE comment interval on long synchronous calls")
    drain_timeout: Duration = Field("30s", validate_default=True, description="on SIGTERM, how long synchronous calls may finish")

    @property
    def max_body_bytes(self) -> int:
        """`max_body` in bytes."""
        return self.max_body


class StoreConfig(_Strict):
    """The task store: a diskcache directory, served by one proxy process at a time (an OS lock).

    `durable` fsyncs every batch of writes (group commit). `lease` (s): how long this process's
    claim on the calls it runs lasts without renewal (renewed every third of it); a task whose
    owner's lease lapsed is ended (or re-run) by the sweep, which runs every half lease.
    `write_retry` (s): how long an outcome write the store refuses is retried before the task is
    shown `failed`, naming the store.
    """

    path: str = "./var/tasks"
    durable: bool = True
    lease: Duration = Field("15s", validate_default=True)
    write_retry: Duration = Field("5s", validate_default=True)

    @field_validator("lease", "write_retry")
    @classmethod
    def _positive_store_durations(cls, value: float, info: ValidationInfo) -> float:
        _positive(value, f"store.{info.field_name}")
        return value


class ToolMode(StrEnum):
    """How a tool may become a task."""

    OPTIONAL = "optional"  # a task when still running after detach_after and the request declared the extension
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
    """

    detach_after: Duration | None = None
    ttl: Duration | None = None
    poll_interval: Duration | None = None
    input_timeout: Duration | None = None

    @field_validator("ttl", "poll_interval", "input_timeout")
    @classmethod
    def _positive_durations(cls, value: float | None, info: ValidationInfo) -> float | None:
        _positive(value, info.field_name or "duration")
        return value


class ToolTasks(TaskPolicy):
    """Per-tool task settings. `on_restart`: what happens to a detached call of this tool that was
    running when the proxy died: `fail` (the task fails, naming the restart) or `rerun` (the call
    is sent again after the restart; for idempotent tools only, since the first run may have had
    effects; its arguments are then kept in the store)."""

    mode: ToolMode = ToolMode.OPTIONAL
    on_restart: Literal["fail", "rerun"] = "fail"


class ServerTasks(TaskPolicy):
    """Per-server task settings and per-tool overrides."""

    tools: dict[str, ToolTasks] = Field(default_factory=dict)


class DefaultTasks(_Strict):
    """Defaults for every server."""

    detach_after: Duration = Field("10s", validate_default=True)
    ttl: Duration = Field("1h", validate_default=True)
    poll_interval: Duration = Field("2s", validate_default=True)
    input_timeout: Duration = Field("10m", validate_default=True)

    @field_validator("ttl", "poll_interval", "input_timeout")
    @classmethod
    def _positive_durations(cls, value: float | None, info: ValidationInfo) -> float | None:
        _positive(value, info.field_name or "duration")
        return value


_TRANSPORT_KINDS = ("stdio", "http", "streamable-http", "streamablehttp", "sse")
_CLIENT_ONLY_KEYS = ("disabled", "enabled", "alwaysAllow", "autoApprove", "trust", "description", "disabledTools", "timeout_ms")


class ServerEntry(_Strict):
    """One upstream MCP server, in the Claude Desktop / `.mcp.json` shape plus proxy keys.

    Remote: `url` (Streamable HTTP; Gemini's `httpUrl` too), `headers`. Stdio: `command`, `args`,
    `env` (added to the proxy's environment), `cwd`. `timeout` (s) is the hard limit of one upstream
    call. Stdio only: `instances` children per capability set, `max_concurrency` requests in flight,
    `isolation: per_principal` for a child per principal, `idle_timeout` (s) to stop an unused
    child, `init_timeout` (s) for its `initialize`, `max_restarts` quick exits in a row before the
    server counts as crash-looping.
    """

    url: str | None = None
    httpUrl: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
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
                raise ValueError(f"url {self.url!r} must be an http:// or https:// URL")
        if bool(self.url) == bool(self.command):
            raise ValueError("give either `url` (Streamable HTTP) or `command` (stdio), exactly one")
        kind = (self.type or self.transport or self.transportType or "").lower().replace("_", "-")
        if kind and kind not in _TRANSPORT_KINDS:
            raise ValueError(f"unknown transport {kind!r}; use stdio or http (streamable-http)")
        if kind == "sse":
            raise ValueError("the legacy HTTP+SSE transport is not supported; use a Streamable HTTP url")
        if kind == "stdio" and not self.command:
            raise ValueError("transport stdio needs `command`")
        if kind and kind != "stdio" and not self.url:
            raise ValueError(f"transport {kind} needs `url`")
        return self

    @property
    def active(self) -> bool:
        """False when the entry is switched off with `disabled: true` or `enabled: false`."""
        return self.enabled and not self.disabled


class ResolvedPolicy(BaseModel):
    """The effective task policy of one tool: durations in seconds, `timeout` the hard limit (s)."""

    mode: ToolMode
    on_restart: Literal["fail", "rerun"] = "fail"
    detach_after: float
    ttl: float
    poll_interval: float
    input_timeout: float
    timeout: float


class RequestStateConfig(_Strict):
    """Signing of MRTR `requestState` (HMAC-SHA256). Without `secret`, a key is generated once and
    kept beside the store (`<store.path>/request_state.key`)."""

    secret: str | None = Field(None, min_length=32)


class JwtConfig(_Strict):
    """JWT verification: keys from `jwks_file` (relative to the config file) or `jwks_url`;
    `issuer`/`audience` checked when given; the principal is the `principal_claim` claim."""

    jwks_file: str | None = None
    jwks_url: str | None = None
    issuer: str | None = None
    audience: str | None = None
    algorithms: list[str] = Field(default_factory=lambda: ["RS256", "ES256"])
    principal_claim: str = "sub"
    leeway_s: float = Field(30.0, ge=0, description="clock skew allowed on exp/nbf, in seconds")

    @model_validator(mode="after")
    def _one_source(self) -> JwtConfig:
        if bool(self.jwks_file) == bool(self.jwks_url):
            raise ValueError("give exactly one of `jwks_file` and `jwks_url`")
        return self


class TrustedHeaderConfig(_Strict):
    """A header set by a fronting auth proxy; `trusted_peers` limits which peer addresses may set it."""

    name: str = "X-Forwarded-User"
    trusted_peers: list[str] = Field(default_factory=list)


class AuthConfig(_Strict):
    """Inbound authentication. `tokens` maps principal names to `sha256:<hex>` token hashes
    (`mcp-tasks-proxy hash-token` prints one); plain tokens are never written in the config."""

    mode: Literal["none", "bearer", "jwt", "header"] = "none"
    tokens: dict[str, str] = Field(default_factory=dict)
    jwt: JwtConfig | None = None
    header: TrustedHeaderConfig | None = None

    @model_validator(mode="after")
    def _complete(self) -> AuthConfig:
        if self.mode == "bearer":
            if not self.tokens:
                raise ValueError("mode bearer needs `tokens` (principal: sha256:<hex>)")
            for name, digest in self.tokens.items():
                if not re.fullmatch(r"sha256:[0-9a-fA-F]{64}", digest):
                    raise ValueError(f"tokens.{name} must be a hash `sha256:<64 hex digits>`, not the token itself")
        if self.mode == "jwt" and self.jwt is None:
            raise ValueError("mode jwt needs a `jwt` section")
        if self.mode == "header" and self.header is None:
            self.header = TrustedHeaderConfig()
        return self


class LimitsConfig(_Strict):
    """Limits; each refusal is a JSON-RPC error naming the limit (HTTP 429 for rates and counts).

    `max_tasks_per_principal`: live (non-terminal) tasks one principal may have. `max_ttl`: upper
    bound of any task's retention (larger configured ttls are capped). `max_result_bytes`: the
    largest result stored for a task (larger: the task fails naming the limit). `tasks_rate`:
    tasks/* calls per principal, as `N/second`, `N/minute` (a moving window).
    """

    max_tasks_per_principal: int | None = Field(None, ge=1)
    max_ttl: Duration | None = None
    max_result_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    tasks_rate: str | None = Field(None, description="tasks/* calls per principal, like `20/second` or `600/minute`")

    @model_validator(mode="after")
    def _rate(self) -> LimitsConfig:
        if self.tasks_rate is not None:
            try:
                limits.parse(self.tasks_rate)
            except ValueError:
                raise ValueError(f"tasks_rate {self.tasks_rate!r} must look like `20/second` or `600/minute`") from None
        return self


class LoggingConfig(_Strict):
    """Logs: JSON lines on stderr (a readable renderer on a terminal). `log_payloads: true` also logs
    request bodies (they may contain personal data and secrets; off by default)."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    log_payloads: bool = False


class Config(_Strict):
    """The whole config file."""

    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    listen: ListenConfig = Field(default_factory=ListenConfig)
    request_state: RequestStateConfig = Field(default_factory=RequestStateConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    tasks: DefaultTasks = Field(default_factory=DefaultTasks)
    mcpServers: dict[str, ServerEntry] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _names(self) -> Config:
        for name in self.mcpServers:
            if not _NAME.match(name):
                raise ValueError(f"server name {name!r} must match {_NAME.pattern} (it becomes a URL path)")
        if not self.servers:
            raise ValueError("mcpServers must configure at least one enabled server")
        return self

    @property
    def servers(self) -> dict[str, ServerEntry]:
        """The enabled servers by name."""
        return {name: entry for name, entry in self.mcpServers.items() if entry.active}

    def policy(self, server: str, tool: str) -> ResolvedPolicy:
        """Resolve tool → server → defaults for one tool of one server."""
        entry = self.mcpServers[server]
        tool_cfg = entry.tasks.tools.get(tool, ToolTasks())
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
        )


def _interpolation_message(exc: Exception) -> str:
    """A readable sentence for an expandvars failure (its KeyError-based messages print quoted)."""
    text = str(exc.args[0]) if exc.args else str(exc)
    name, _, detail = text.partition(": ")
    if isinstance(exc, expandvars.UnboundVariable):
        return f"environment variable {name} is not set (use ${{{name}:-default}} for a fallback, or \\$ for a literal $)"
    if isinstance(exc, expandvars.ParameterNullOrNotSet):
        return f"environment variable {name} is not set or empty" + ("" if detail == "parameter null or not set" else f": {detail}")
    return f"cannot interpolate environment variables: {text}"


def _interpolate(node: Any, path: str) -> Any:
    if isinstance(node, str):
        try:
            # A copy of the environment: `${VAR:=default}` must not change the proxy's own environment.
            return expandvars.expand(node, nounset=True, environ=dict(os.environ))
        except expandvars.ExpandvarsException as exc:
            raise ConfigError(f"{path or '<root>'}: {_interpolation_message(exc)}") from None
    if isinstance(node, dict):
        return {k: _interpolate(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate(v, f"{path}[{i}]") for i, v in enumerate(node)]
    return node


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{loc or '<root>'}: {msg}")
    return "\n".join(lines)


def config_from_data(data: Any, *, source: str = "<config>") -> Config:
    """Validate an already-parsed config tree (after `${VAR}` interpolation). Raises ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    data = _interpolate(data, "")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid config\n{_format_errors(exc)}") from None


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read a YAML or JSON config file (by content: JSON is valid YAML) and validate it.

    Relative `store.path` and `auth.jwt.jwks_file` values are taken relative to the config file's folder.
    Raises ConfigError naming the file and, for invalid values, each key's path.
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read: {exc.strerror}") from None
    try:
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{file}: not valid {'JSON' if file.suffix == '.json' else 'YAML'}: {exc}") from None
    config = config_from_data(data, source=str(file))
    if not os.path.isabs(config.store.path):
        config.store.path = str((file.parent / config.store.path).resolve())
    jwt_cfg = config.auth.jwt
    if jwt_cfg is not None and jwt_cfg.jwks_file and not os.path.isabs(jwt_cfg.jwks_file):
        jwt_cfg.jwks_file = str((file.parent / jwt_cfg.jwks_file).resolve())
    return config



SCHEMA_FILE = Path(__file__).with_name("config.schema.json")


def config_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the config file, generated from the pydantic models.

    The package ships it as `proxy/config.schema.json` so editors can validate config files
    (`# yaml-language-server: $schema=…`); a test keeps the file equal to this function's output.
    """
    schema = Config.model_json_schema(mode="validation")
    return {**schema, "$schema": "https://json-schema.org/draft/2020-12/schema", "title": "mcp-tasks-proxy config"}
