"""`mcp-tasks-proxy check-config FILE`: validate a config file and say what it will serve."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from urllib.parse import urlsplit

import limits

from proxy.config import (
    ANY_AUDIENCE,
    Config,
    ConfigError,
    JwtConfig,
    TaskPolicy,
    ToolMode,
    load_config,
    redact_url,
)
from proxy.front.tokens import AccessTokens, TokenError, load_jwks_file
from proxy.replicas import advertised_url
from proxy.runtime import event_loop, tracing


def run(argv: list[str]) -> int:
    """Check the config file `argv` names; 0 and a description when it can serve, 2 and the
    problems (one per line) when it cannot."""
    parser = argparse.ArgumentParser(
        prog="mcp-tasks-proxy check-config", description="Validate a config file and say what it will serve."
    )
    parser.add_argument("file", nargs="?", help="the config file")
    parser.add_argument("--config", help="the config file, as the main command takes it")
    args = parser.parse_args(argv)
    if (args.file is None) == (args.config is None):
        parser.error("name the config file once: check-config FILE, or check-config --config FILE")
    path = args.file or args.config
    try:
        config = load_config(path)
    except ConfigError as exc:
        print(f"mcp-tasks-proxy: {exc}", file=sys.stderr)
        return 2
    problems = (
        missing_commands(config)
        + replica_problems(config)
        + event_loop.problems(config.listen.event_loop)
        + auth_problems(config)
        + tracing.problems(config.tracing)
    )
    if problems:
        print(f"mcp-tasks-proxy: {path}: invalid config\n" + "\n".join(problems), file=sys.stderr)
        return 2
    try:
        print(describe(config, path))
        for warning in auth_warnings(config) + policy_warnings(config):
            print(f"warning: {warning}")
        sys.stdout.flush()
    except BrokenPipeError:  # (`check-config FILE | head`): the reader took what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no error again at exit)
    return 0


def auth_problems(config: Config) -> list[str]:
    """What stops `config.auth` from serving: a `jwks_file` that cannot be read as a key set."""
    jwt_config = config.auth.jwt
    if config.auth.mode != "jwt" or jwt_config is None or not jwt_config.jwks_file:
        return []
    try:
        load_jwks_file(jwt_config.jwks_file, None)
    except ConfigError as exc:
        return [str(exc)]
    return []


def auth_warnings(config: Config) -> list[str]:
    """What an operator should know about `config.auth` that does not stop the proxy: OAuth that
    MCP clients cannot discover (no `listen.public_url`), a public URL over plain HTTP beyond
    loopback, and an issuer whose metadata cannot be fetched now (offline is allowed; the proxy
    tries again for each token)."""
    auth = config.auth
    if auth.mode != "jwt" or auth.jwt is None:
        return []
    warnings = []
    public = config.listen.public_url
    if public is None:
        warnings.append(
            "auth mode jwt without listen.public_url: MCP clients cannot discover where to sign in (no "
            "protected resource metadata; the 401 names no resource_metadata); tokens are checked "
            "against jwt.audience"
            + (', which is "*": any audience passes' if auth.jwt.audience == ANY_AUDIENCE else "")
        )
    elif not auth.jwt.issuer:
        warnings.append(
            "listen.public_url is set but auth.jwt.issuer is not: no protected resource metadata is "
            "served, so MCP clients cannot discover where to sign in"
        )
    elif urlsplit(public).scheme == "http" and urlsplit(public).hostname not in (
        "127.0.0.1",
        "localhost",
        "::1",
    ):
        warnings.append(f"listen.public_url {public} is plain http: OAuth 2.1 needs https beyond loopback")
    if auth.jwt.issuer and not (auth.jwt.jwks_file or auth.jwt.jwks_url):
        problem = asyncio.run(_issuer_problem(auth.jwt))
        if problem is not None:
            warnings.append(
                f"the issuer's metadata cannot be fetched now ({problem}); tokens fail until it can"
            )
    return warnings


# Tool settings that act only on a call that became a task
TASK_ONLY_SETTINGS = frozenset({"on_restart", "detach_after", "ttl", "poll_interval", "progress_interval"})


def policy_warnings(config: Config) -> list[str]:
    """Task settings that can never take effect: an optional tool's `detach_after` not below the hard
    `timeout` of its server (s), so that its calls end, answered or timed out, before they could
    become tasks; task settings given to a `mode: forbidden` tool, whose calls never become tasks."""
    warnings = []
    for name, entry in config.servers.items():
        for tool_name, given in entry.tasks.tools.items():
            unused = sorted(given.model_fields_set & TASK_ONLY_SETTINGS)
            if given.mode is ToolMode.FORBIDDEN and unused:
                warnings.append(
                    f"mcpServers.{name} tool {tool_name}: mode forbidden (never a task) ignores "
                    + ", ".join(unused)
                )
        server = config.policy(name, "")  # (what a tool without settings of its own gets)
        for tool in (None, *entry.tasks.tools):
            policy = config.policy(name, tool or "")
            if policy.mode is not ToolMode.OPTIONAL or policy.detach_after < policy.timeout:
                continue  # (a required tool is a task at once, a forbidden one never)
            if (
                tool is not None
                and server.detach_after >= server.timeout
                and (policy.detach_after == server.detach_after)
            ):
                continue  # the server's own warning covers a tool that only inherits it
            where = f"mcpServers.{name}" + (f" tool {tool}" if tool else "")
            warnings.append(
                f"{where}: detach_after ({_s(policy.detach_after)}) is not below timeout "
                f"({_s(policy.timeout)}): its calls end before they could become tasks"
            )
    return warnings


async def _issuer_problem(jwt: JwtConfig) -> str | None:
    tokens = AccessTokens(jwt)
    try:
        await tokens.metadata()
    except TokenError as exc:
        return str(exc)
    finally:
        await tokens.close()
    return None


def replica_problems(config: Config) -> list[str]:
    """What stops `config` (after --host/--port) from serving as a replica: a wildcard listen host
    without `replicas.advertise`. Empty when fine or when it is no replica."""
    if config.replicas is None:
        return []
    try:
        advertised_url(config)
    except ValueError as exc:
        return [str(exc)]
    return []


def describe(config: Config, source: str) -> str:
    """What a config will serve, as text: listen address, store, and per server its upstream,
    routes and task policy, each configured tool's whole effective policy (durations in seconds);
    a note for replica-only settings given without a `replicas` section."""
    base = f"http://{config.listen.host}:{config.listen.port}"
    durability = "Redis persistence" if config.store.redis else ("yes" if config.store.durable else "no")
    lines = [
        f"{source}: valid",
        f"listen {base}  store {config.store.where}  (durable: {durability})  event loop "
        f"{event_loop.describe(config.listen.event_loop)}",
    ]
    ignored = sorted({"drain_detached", "drain_grace"} & config.listen.model_fields_set)
    if config.replicas is None and ignored:
        lines.append(
            "note: "
            + " and ".join(f"listen.{key}" for key in ignored)
            + (" apply" if len(ignored) > 1 else " applies")
            + " to replicas only (no `replicas` section): ignored here"
        )
    if config.replicas is not None:
        lines.append(
            f"replica of a shared store: advertised as {advertised_url(config)}, hop_timeout "
            f"{_s(config.replicas.hop_timeout)}, "
            f"drain_detached {_s(config.listen.drain_detached)}, drain_grace {_s(config.listen.drain_grace)}"
            + (" (cut to drain_detached)" if config.listen.drain_grace > config.listen.drain_detached else "")
        )
    auth = config.auth
    if auth.mode == "jwt" and auth.jwt is not None:
        source = auth.jwt.jwks_file or (
            redact_url(auth.jwt.jwks_url) if auth.jwt.jwks_url else "the issuer's jwks_uri"
        )
        issuer = redact_url(auth.jwt.issuer) if auth.jwt.issuer else "any issuer"
        lines.append(f"auth: OAuth access tokens from {issuer}, keys from {source}")
        if config.listen.public_url:
            lines.append(
                f"  resource {config.listen.public_url}/mcp (and /servers/NAME/mcp); metadata at "
                f"{config.listen.public_url}/.well-known/oauth-protected-resource/..."
            )
        for server, rules in auth.scopes.items():
            lines.append(
                f"  scopes on {server}: " + "; ".join(f"{t}: {' '.join(s)}" for t, s in rules.items())
            )
    else:
        lines.append(f"auth: {auth.mode}")
    lines.append(tracing.describe(config.tracing))
    d = config.tasks
    max_ttl = config.limits.max_ttl
    ttl = (
        f"{_s(d.ttl)}"
        if max_ttl is None or d.ttl <= max_ttl
        else f"{_s(max_ttl)} (limits.max_ttl; {_s(d.ttl)} given)"
    )
    lines.append(
        f"defaults: detach_after {_s(d.detach_after)}, ttl {ttl}, poll_interval {_s(d.poll_interval)}, "
        f"progress_interval {_s(d.progress_interval)}, input_timeout {_s(d.input_timeout)}, "
        f"idempotency_window {_s(d.idempotency_window)}"
    )
    lines.append(describe_limits(config))
    for name, entry in config.mcpServers.items():
        if not entry.active:
            lines.append(f"- {name}: disabled")
            continue
        upstream = (
            redact_url(entry.url) if entry.url else "stdio: " + " ".join([entry.command or "", *entry.args])
        )
        routes = f"{base}/servers/{name}/mcp" + (f" and {base}/mcp" if len(config.servers) == 1 else "")
        lines.append(f"- {name}: {upstream}")
        lines.append(f"    served at {routes}; hard timeout {_s(entry.timeout)}")
        tasks = entry.tasks
        overrides = {k: getattr(tasks, k) for k in TaskPolicy.model_fields if getattr(tasks, k) is not None}
        if "ttl" in overrides and config.limits.max_ttl is not None:
            overrides["ttl"] = min(overrides["ttl"], config.limits.max_ttl)  # as `limits.max_ttl` caps it
        if overrides:
            lines.append("    tasks: " + ", ".join(f"{k} {_s(v)}" for k, v in overrides.items()))
        for tool in tasks.tools:
            policy = config.policy(name, tool)
            dedupe = "" if policy.dedupe_window is None else f", dedupe_window {_s(policy.dedupe_window)}"
            if policy.mode is ToolMode.FORBIDDEN:
                lines.append(
                    f"    tool {tool}: mode forbidden (never a task: always answered synchronously), timeout "
                    f"{_s(policy.timeout)}, input_timeout {_s(policy.input_timeout)}, idempotency_window "
                    f"{_s(policy.idempotency_window)}{dedupe}"
                )
                continue
            lines.append(
                f"    tool {tool}: mode {policy.mode.value}, on_restart {policy.on_restart}, detach_after "
                f"{_s(policy.detach_after)}, timeout {_s(policy.timeout)}, ttl {_s(policy.ttl)}, "
                f"poll_interval {_s(policy.poll_interval)}, input_timeout {_s(policy.input_timeout)}, "
                f"progress_interval "
                f"{_s(policy.progress_interval)}, idempotency_window {_s(policy.idempotency_window)}{dedupe}"
            )
    return "\n".join(lines)


def _s(seconds: float) -> str:
    """A duration (s) as check-config prints it: `90s`, `0.5s`, `2592000s` for 30 days (`:g` alone
    wrote `2.592e+06`)."""
    return f"{seconds:.0f}s" if float(seconds).is_integer() else f"{seconds:g}s"


def describe_limits(config: Config) -> str:
    """The `limits` section as one line: each rate as the `limits` library reads it ("20 per 1
    second"), each count or "none", `max_ttl` in s and `max_result_bytes` in bytes."""
    given = config.limits

    def rate(text: str | None, counted: str) -> str:
        return "none" if text is None else f"{limits.parse(text)} per {counted}"

    def count(value: int | None) -> str:
        return "none" if value is None else str(value)

    return (
        f"limits: tasks_rate {rate(given.tasks_rate, 'principal')}, failed_auth "
        f"{rate(given.failed_auth, 'client address')}, max_tasks_per_principal "
        f"{count(given.max_tasks_per_principal)}, max_sessions_per_principal "
        f"{count(given.max_sessions_per_principal)}, max_ttl "
        f"{'none' if given.max_ttl is None else _s(given.max_ttl)}, max_result_bytes {given.max_result_bytes}"
    )


def missing_commands(config: Config) -> list[str]:
    """One sentence per enabled stdio server whose `command` cannot be found or run (looked up on
    the PATH its child would get, relative to its `cwd`); empty when all are runnable."""
    problems = []
    for name, entry in config.servers.items():
        if not entry.command:
            continue
        path = entry.env.get("PATH", os.environ.get("PATH", os.defpath))
        command = entry.command
        if os.sep in command and entry.cwd and not os.path.isabs(command):
            command = os.path.join(entry.cwd, command)
        if shutil.which(command, path=path) is None:
            where = "is not an executable file" if os.sep in command else "is not on the PATH"
            problems.append(f"mcpServers.{name}.command: {entry.command!r} {where}")
    return problems
