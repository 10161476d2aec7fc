"""proxy.config: loading, durations, `${VAR}` interpolation, key paths in errors, policy resolution.

Every file under config/ is loaded by a parametrized test, so a new example config is covered
as soon as it is added.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from proxy.app import build_app
from proxy.config import Config, ConfigError, ToolMode, config_from_data, load_config, parse_duration
from proxy.front.auth import hash_token

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "config"
CONFIG_FILES = sorted(p for p in CONFIG_DIR.iterdir() if p.suffix in (".yaml", ".yml", ".json"))

# Variables the example configs need (only those without a `:-default`).
EXAMPLE_ENV = {
    "BUILD_TOKEN": "s3cret-token",
    "REDIS_PASSWORD": "redis-s3cret",
    # config/replicas.yaml (tests/test_replicas.py runs it for real through scripts/cluster.py)
    "MCP_REDIS_URL": "redis://127.0.0.1:6379/0",
    "MCP_REPLICA_SECRET": "r" * 32,
    "MCP_UPSTREAM_URL": "http://127.0.0.1:9000/mcp",
    # config/oauth.yaml (tests/front/test_oauth.py checks it against a real authorization server)
    "MCP_PUBLIC_URL": "https://mcp.example.com",
    "MCP_OAUTH_ISSUER": "https://idp.example.com",
    "BUILD_CLIENT_SECRET": "build-s3cret",
}


def cfg(servers: dict | None = None, **top) -> Config:
    """Validate a config tree; one remote server `a` unless `servers` is given."""
    return config_from_data(
        {"mcpServers": servers if servers is not None else {"a": {"url": "http://127.0.0.1:1/mcp"}}, **top}
    )


def config_error(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_data(data)
    return str(info.value)


# --- the example files --------------------------------------------------------------------------


def test_there_are_example_configs():
    names = {p.name for p in CONFIG_FILES}
    assert {"example.yaml", "minimal.json", "demo.yaml"} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_example_config_loads(path: Path, monkeypatch: pytest.MonkeyPatch):
    for key, value in EXAMPLE_ENV.items():
        monkeypatch.setenv(key, value)
    config = load_config(path)
    assert config.servers, f"{path.name} serves no server"
    for name, entry in config.servers.items():
        assert bool(entry.url) != bool(entry.command), f"{path.name}: server {name} needs a url or a command"
        # Every tool listed resolves to a full policy.
        for tool in [*entry.tasks.tools, "some_other_tool"]:
            policy = config.policy(name, tool)
            assert policy.detach_after >= 0 and policy.timeout > 0
    # Relative store paths are taken relative to the config file's folder.
    assert Path(config.store.path).is_absolute()
    # The app builds (routes for every served server) without touching the network.
    app = build_app(config)
    paths = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
    for name in config.servers:
        assert f"/servers/{name}/mcp" in paths
    assert ("/mcp" in paths) == (len(config.servers) == 1)


def test_example_yaml_values(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("BUILD_TOKEN", "tok-123")
    monkeypatch.delenv("PROXY_PORT", raising=False)
    monkeypatch.delenv("BUILD_URL", raising=False)
    config = load_config(CONFIG_DIR / "example.yaml")
    assert config.listen.host == "127.0.0.1"
    assert config.listen.port == 8080  # ${PROXY_PORT:-8080}
    assert config.store.path == str((CONFIG_DIR / "var" / "tasks").resolve())
    assert (config.tasks.detach_after, config.tasks.ttl, config.tasks.poll_interval) == (10.0, 3600.0, 2.0)
    assert set(config.servers) == {"build", "files"}
    build = config.servers["build"]
    assert build.url == "http://127.0.0.1:9000/mcp"
    assert build.headers == {"Authorization": "Bearer tok-123"}
    assert build.timeout == 1800.0
    assert build.tasks.detach_after == 2.0
    assert build.tasks.tools["deploy_prod"].mode is ToolMode.REQUIRED
    assert build.tasks.tools["ping"].mode is ToolMode.FORBIDDEN
    assert config.policy("build", "deploy_prod").mode is ToolMode.REQUIRED
    assert config.policy("build", "ping").mode is ToolMode.FORBIDDEN
    assert config.policy("build", "compile").mode is ToolMode.OPTIONAL
    assert config.policy("build", "compile").detach_after == 2.0
    assert config.policy("files", "read_file").detach_after == 10.0
    assert config.servers["files"].timeout == 600.0


def test_example_yaml_env_overrides(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("BUILD_TOKEN", "t")
    monkeypatch.setenv("PROXY_PORT", "9999")
    monkeypatch.setenv("BUILD_URL", "http://127.0.0.1:7777/mcp")
    config = load_config(CONFIG_DIR / "example.yaml")
    assert config.listen.port == 9999
    assert config.servers["build"].url == "http://127.0.0.1:7777/mcp"


def test_example_yaml_without_token_names_the_header(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("BUILD_TOKEN", raising=False)
    with pytest.raises(ConfigError) as info:
        load_config(CONFIG_DIR / "example.yaml")
    message = str(info.value)
    assert "mcpServers.build.headers.Authorization" in message
    assert "BUILD_TOKEN" in message and "not set" in message


def test_minimal_json_values():
    config = load_config(CONFIG_DIR / "minimal.json")
    assert list(config.servers) == ["demo"]
    assert config.servers["demo"].url == "http://127.0.0.1:9001/mcp"
    # Everything else is a default.
    assert config.listen.port == 8080
    assert config.policy("demo", "anything").detach_after == 10.0
    assert config.policy("demo", "anything").ttl == 3600.0
    assert config.policy("demo", "anything").timeout == 1800.0


def test_resolved_policies_are_kept_per_configured_tool_and_not_shared_with_a_copy():
    config = load_config(CONFIG_DIR / "minimal.json")
    # Every tool the config does not name shares the server's one policy (arbitrary names add none).
    assert config.policy("demo", "anything") is config.policy("demo", "something_else")
    copied = config.model_copy(update={"tasks": config.tasks.model_copy(update={"detach_after": 3.0})})
    assert copied.policy("demo", "anything").detach_after == 3.0
    assert config.policy("demo", "anything").detach_after == 10.0


def test_demo_yaml_values(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("MCP_TASKS_STORE", raising=False)
    config = load_config(CONFIG_DIR / "demo.yaml")
    assert config.servers["demo"].url == "http://127.0.0.1:9001/mcp"
    assert config.tasks.detach_after == 1.0
    assert config.tasks.poll_interval == 0.5
    assert config.policy("demo", "slow_report").detach_after == 1.0
    assert config.policy("demo", "slow_report").timeout == 600.0
    assert config.policy("demo", "echo").mode is ToolMode.FORBIDDEN
    assert config.store.path == str((CONFIG_DIR / "var" / "demo-tasks").resolve())
    monkeypatch.setenv("MCP_TASKS_STORE", str(tmp_path / "s"))
    assert load_config(CONFIG_DIR / "demo.yaml").store.path == str(tmp_path / "s")


def test_json_and_yaml_forms_are_equivalent(tmp_path: Path):
    data = {
        "tasks": {"detach_after": "3s"},
        "mcpServers": {"x": {"url": "http://127.0.0.1:1/mcp", "timeout": "1m"}},
    }
    (tmp_path / "c.json").write_text(json.dumps(data))
    (tmp_path / "c.yaml").write_text(
        "tasks: {detach_after: 3s}\nmcpServers:\n  x: {url: 'http://127.0.0.1:1/mcp', timeout: 1m}\n"
    )
    a, b = load_config(tmp_path / "c.json"), load_config(tmp_path / "c.yaml")
    assert a.model_dump() == b.model_dump()


def test_unreadable_and_malformed_files(tmp_path: Path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path / "bad.json")
    (tmp_path / "bad.yaml").write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(tmp_path / "list.yaml")


def test_a_key_given_twice_is_refused_and_a_merge_may_still_override(tmp_path: Path):
    """A block pasted twice would drop a server or a setting without a word (PyYAML and `json`
    keep the last): refused, naming the key (and, in YAML, both lines). Keys a YAML merge brings in
    may still be overridden."""
    (tmp_path / "twice.yaml").write_text(
        "mcpServers:\n  a: {url: 'http://127.0.0.1:1/mcp'}\nmcpServers:\n  b: {url: 'http://127.0.0.1:2/mcp'}\n"
    )
    with pytest.raises(
        ConfigError, match=r"the key 'mcpServers' appears twice in one mapping \(lines 1 and 3\)"
    ):
        load_config(tmp_path / "twice.yaml")
    (tmp_path / "twice.json").write_text(
        '{"mcpServers": {"a": {"url": "http://127.0.0.1:1/mcp"}, "a": {"url": "http://127.0.0.1:3/mcp"}}}'
    )
    with pytest.raises(ConfigError, match="not valid JSON: the key 'a' appears twice in one object"):
        load_config(tmp_path / "twice.json")
    (tmp_path / "merge.yaml").write_text(
        "mcpServers:\n"
        "  a: &base {url: 'http://127.0.0.1:1/mcp', timeout: 5s}\n"
        "  b:\n    <<: *base\n    url: 'http://127.0.0.1:2/mcp'\n"
    )
    servers = load_config(tmp_path / "merge.yaml").mcpServers
    assert (servers["b"].url, servers["b"].timeout) == ("http://127.0.0.1:2/mcp", 5.0)


def _alias_bomb() -> str:
    """Eight levels of nine aliases each: 9**8 (43 million) values once followed."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    return "\n".join([*lines, "mcpServers: {a: {url: 'http://127.0.0.1:1/mcp'}}"]) + "\n"


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("binary.yaml", b"\xff\xfe\x00garbage", "cannot read: not UTF-8 text (byte 0xff at offset 0)"),
        ("recursive.yaml", b"a: &a [*a]\n", "nests more than 32 levels deep"),
        ("deep.yaml", b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", "the YAML nests too deeply to read"),
        ("deep.json", b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", "the JSON nests too deeply to read"),
        ("bomb.yaml", _alias_bomb().encode(), "holds more than 1000000 values"),
        ("long.yaml", b"a: " + b"7" * 5000 + b"\n", "not valid YAML: Exceeds the limit"),
        ("long.json", b'{"a": ' + b"7" * 5000 + b"}", "not valid JSON: Exceeds the limit"),
        # a mapping tag on what is no mapping (a TypeError of the duplicate-key check at first)
        ("tagged.yaml", b"x: !!map [a, b]\n", "expected a mapping node, but found sequence"),
        ("set.yaml", b"x: !!set abc\n", "expected a mapping node, but found scalar"),
    ],
)
def test_hostile_files_are_refused_with_a_config_error(
    tmp_path: Path, name: str, content: bytes, message: str
):
    """Not UTF-8, an alias inside what it names, nesting past the parser, an alias bomb: each a
    ConfigError naming the file (exit 2 from the CLI), never a traceback or a walk without end."""
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(message)) as raised:
        load_config(tmp_path / name)
    assert str(tmp_path / name) in str(raised.value)


def test_aliases_within_the_bounds_still_load(tmp_path: Path):
    """A merge key that repeats one server's settings for another loads as before."""
    (tmp_path / "aliases.yaml").write_text(
        "mcpServers:\n  a: &server {url: 'http://127.0.0.1:1/mcp', timeout: 1m}\n"
        "  b: {<<: *server, url: 'http://127.0.0.1:2/mcp'}\n"
    )
    config = load_config(tmp_path / "aliases.yaml")
    assert config.servers["b"].timeout == 60


# --- durations ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("30s", 30.0),
        ("10m", 600.0),
        ("1h", 3600.0),
        ("1h30m", 5400.0),
        ("1.5s", 1.5),
        ("0s", 0.0),
        (" 2s ", 2.0),
    ],
)
def test_durations(text: str, seconds: float):
    assert parse_duration(text) == pytest.approx(seconds)
    assert cfg(tasks={"detach_after": text}).tasks.detach_after == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["10", "2.5", 10, 2.5, True, "abc", "5x", "", "-5s", None, [1]])
def test_bad_durations_are_refused(value):
    with pytest.raises(ValueError):
        parse_duration(value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1M", "'m' for minutes, 'mo' for months"),  # read as a minute before
        ("5MS", "'ms' for milliseconds"),
        ("10000000000h", "longer than 100 years"),  # a ttlMs past 2**53 before
    ],
)
def test_ambiguous_and_huge_durations_are_refused(value: str, message: str):
    with pytest.raises(ValueError, match=message):
        parse_duration(value)
    assert parse_duration("100y") == 100 * 365 * 24 * 3600 and parse_duration("1mo") == 30 * 24 * 3600


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"tasks": {"detach_after": 10}}, "tasks.detach_after"),
        ({"tasks": {"ttl": "10"}}, "tasks.ttl"),
        ({"tasks": {"poll_interval": "soon"}}, "tasks.poll_interval"),
        ({"listen": {"sse_keepalive": 15}}, "listen.sse_keepalive"),
        ({"mcpServers": {"a": {"url": "http://h/mcp", "timeout": 30}}}, "mcpServers.a.timeout"),
        (
            {"mcpServers": {"a": {"url": "http://h/mcp", "tasks": {"detach_after": "2"}}}},
            "mcpServers.a.tasks.detach_after",
        ),
        (
            {"mcpServers": {"a": {"url": "http://h/mcp", "tasks": {"tools": {"t": {"ttl": "forever"}}}}}},
            "mcpServers.a.tasks.tools.t.ttl",
        ),
    ],
)
def test_bad_duration_error_names_the_key_path(data: dict, path: str):
    data.setdefault("mcpServers", {"a": {"url": "http://h/mcp"}})
    message = config_error(data)
    assert f"{path}:" in message
    assert "unit" in message or "duration" in message


# --- interpolation ------------------------------------------------------------------------------


def test_interpolation(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TOKEN", "abc")
    monkeypatch.setenv("HOST", "10.0.0.5")
    monkeypatch.delenv("UNSET_PORT", raising=False)
    config = cfg(
        {
            "a": {
                "url": "http://${HOST}:${UNSET_PORT:-9000}/mcp",
                "headers": {"Authorization": "Bearer ${TOKEN}", "X-Plain": "$TOKEN"},
                "timeout": "${UNSET_TIMEOUT:-5m}",
            }
        },
        tasks={"ttl": "${UNSET_TTL:-2h}"},
    )
    entry = config.servers["a"]
    assert entry.url == "http://10.0.0.5:9000/mcp"
    assert entry.headers == {"Authorization": "Bearer abc", "X-Plain": "abc"}
    assert entry.timeout == 300.0
    assert config.tasks.ttl == 7200.0


def test_default_is_not_used_when_variable_is_set(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PORT_X", "1234")
    assert cfg(listen={"port": "${PORT_X:-8080}"}).listen.port == 1234


def test_escaped_dollar_is_literal(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("NOPE", raising=False)
    config = cfg({"a": {"url": "http://h/mcp", "headers": {"X-Price": "\\$NOPE"}}})
    assert config.servers["a"].headers["X-Price"] == "$NOPE"


def test_interpolation_does_not_change_the_environment(monkeypatch: pytest.MonkeyPatch):
    import os

    monkeypatch.delenv("ASSIGNED_BY_CONFIG", raising=False)
    config = cfg({"a": {"url": "http://h/mcp", "args": ["${ASSIGNED_BY_CONFIG:=x}"]}})
    assert config.servers["a"].args == ["x"]
    assert "ASSIGNED_BY_CONFIG" not in os.environ


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"mcpServers": {"a": {"url": "${NOPE}"}}}, "mcpServers.a.url"),
        (
            {"mcpServers": {"a": {"url": "http://h/mcp", "headers": {"Authorization": "Bearer ${NOPE}"}}}},
            "mcpServers.a.headers.Authorization",
        ),
        ({"mcpServers": {"a": {"url": "http://h/mcp", "args": ["ok", "$NOPE"]}}}, "mcpServers.a.args[1]"),
        ({"store": {"path": "${NOPE}/tasks"}, "mcpServers": {"a": {"url": "http://h/mcp"}}}, "store.path"),
    ],
)
def test_missing_variable_names_key_path_and_variable(monkeypatch: pytest.MonkeyPatch, data: dict, path: str):
    monkeypatch.delenv("NOPE", raising=False)
    header, line = config_error(data).splitlines()
    assert header == "<config>: cannot interpolate environment variables", header
    assert line.startswith(f"{path}: environment variable NOPE is not set"), line
    assert "'" not in line.split(":", 1)[1].split("(")[0]  # not the raw quoted KeyError text


def test_required_variable_syntax(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("NOPE", raising=False)
    message = config_error({"mcpServers": {"a": {"url": "${NOPE:?set the upstream url}"}}})
    assert message.splitlines()[1].startswith("mcpServers.a.url: environment variable NOPE is not set")
    assert "set the upstream url" in message


def test_every_missing_variable_is_named_in_one_error(monkeypatch: pytest.MonkeyPatch):
    for name in ("NOPE", "NOPE_TOO", "NOPE_AGAIN"):
        monkeypatch.delenv(name, raising=False)
    data = {
        "store": {"path": "${NOPE}/tasks"},
        "mcpServers": {"a": {"url": "${NOPE_TOO}", "headers": {"Authorization": "Bearer ${NOPE_AGAIN}"}}},
    }
    lines = config_error(data).splitlines()[1:]
    assert [line.split(": ", 1)[0] for line in lines] == [
        "store.path",
        "mcpServers.a.url",
        "mcpServers.a.headers.Authorization",
    ], lines
    assert all(
        f"environment variable {name} is not set" in line
        for name, line in zip(("NOPE", "NOPE_TOO", "NOPE_AGAIN"), lines, strict=True)
    )


def test_every_missing_variable_of_one_string_is_named(monkeypatch: pytest.MonkeyPatch):
    for name in ("NOPE_HOST", "NOPE_PORT", "NOPE_PATH"):
        monkeypatch.delenv(name, raising=False)
    lines = config_error(
        {"mcpServers": {"a": {"url": "http://${NOPE_HOST}:${NOPE_PORT:?a port}/${NOPE_PATH}"}}}
    ).splitlines()[1:]
    assert [line.split(" is not set")[0] for line in lines] == [
        f"mcpServers.a.url: environment variable {name}" for name in ("NOPE_HOST", "NOPE_PORT", "NOPE_PATH")
    ], lines


def test_a_variable_set_but_empty_is_named_when_the_config_is_then_invalid(monkeypatch: pytest.MonkeyPatch):
    """`url: ${UPSTREAM_URL}` with the variable set to "" read only "give either `url` … or
    `command`", as if the key were missing."""
    monkeypatch.setenv("UPSTREAM_URL", "")
    message = config_error({"mcpServers": {"a": {"url": "${UPSTREAM_URL}"}}})
    assert "give either `url`" in message
    assert (
        "note: mcpServers.a.url: '${UPSTREAM_URL}' expanded to an empty string (a variable set but empty)"
        in message
    )
    monkeypatch.setenv("NOTE", "")  # a valid config says nothing of its empty strings
    config = config_from_data(
        {"mcpServers": {"a": {"url": "http://h/mcp", "headers": {"X-Note": "${NOTE}"}}}}
    )
    assert config.servers["a"].headers == {"X-Note": ""}


def test_malformed_interpolation_names_key_path():
    message = config_error({"mcpServers": {"a": {"url": "http://h/${BROKEN"}}})
    assert message.splitlines()[1].startswith("mcpServers.a.url:")


# --- unknown keys -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"bogus": 1}, "bogus"),
        ({"listen": {"hots": "x"}}, "listen.hots"),
        ({"store": {"pth": "x"}}, "store.pth"),
        ({"tasks": {"detach": "1s"}}, "tasks.detach"),
        ({"mcpServers": {"build": {"url": "http://h/mcp", "urls": []}}}, "mcpServers.build.urls"),
        (
            {"mcpServers": {"build": {"url": "http://h/mcp", "tasks": {"mode": "required"}}}},
            "mcpServers.build.tasks.mode",
        ),
        (
            {"mcpServers": {"build": {"url": "http://h/mcp", "tasks": {"tools": {"deploy": {"foo": 1}}}}}},
            "mcpServers.build.tasks.tools.deploy.foo",
        ),
    ],
)
def test_unknown_keys_are_rejected_with_their_path(data: dict, path: str):
    data.setdefault("mcpServers", {"a": {"url": "http://h/mcp"}})
    message = config_error(data)
    assert f"\n{path}: unknown key" in message, message


def test_all_errors_are_reported_at_once():
    message = config_error(
        {"listen": {"x": 1}, "mcpServers": {"a": {"url": "http://h/mcp", "y": 2, "timeout": "9"}}}
    )
    assert "listen.x: unknown key" in message
    assert "mcpServers.a.y: unknown key" in message
    assert "mcpServers.a.timeout:" in message


def test_bad_tool_mode_names_path():
    message = config_error(
        {"mcpServers": {"a": {"url": "http://h/mcp", "tasks": {"tools": {"t": {"mode": "always"}}}}}}
    )
    assert "mcpServers.a.tasks.tools.t.mode:" in message


# --- mcpServers spellings, client-only keys -----------------------------------------------------


def test_client_only_keys_are_accepted():
    config = cfg(
        {
            "a": {
                "url": "http://h/mcp",
                "disabled": False,
                "enabled": True,
                "alwaysAllow": ["x"],
                "autoApprove": ["y"],
                "trust": True,
                "description": "a server",
                "disabledTools": ["z"],
                "timeout_ms": 60000,
            }
        }
    )
    assert list(config.servers) == ["a"]


def test_disabled_servers_are_not_served():
    config = cfg(
        {
            "on": {"url": "http://h/1"},
            "off": {"url": "http://h/2", "disabled": True},
            "off2": {"url": "http://h/3", "enabled": False},
        }
    )
    assert set(config.mcpServers) == {"on", "off", "off2"}
    assert list(config.servers) == ["on"]
    app = build_app(config)
    paths = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
    assert "/servers/on/mcp" in paths
    assert "/servers/off/mcp" not in paths and "/servers/off2/mcp" not in paths
    assert "/mcp" in paths  # exactly one server is served, so it is also at /mcp


def test_disabled_stdio_entry_is_fine():
    config = cfg(
        {"web": {"url": "http://h/mcp"}, "files": {"command": "npx", "args": ["-y", "x"], "disabled": True}}
    )
    assert list(config.servers) == ["web"]


def test_all_servers_disabled_is_an_error():
    message = config_error({"mcpServers": {"a": {"url": "http://h/mcp", "disabled": True}}})
    assert "at least one enabled server" in message
    assert "at least one enabled server" in config_error({"mcpServers": {}})


@pytest.mark.parametrize("key", ["type", "transport", "transportType"])
@pytest.mark.parametrize("value", ["http", "streamable-http", "streamableHttp"])
def test_transport_spellings_accepted(key: str, value: str):
    assert cfg({"a": {"url": "http://h/mcp", key: value}}).servers["a"].url == "http://h/mcp"


@pytest.mark.parametrize("key", ["type", "transport", "transportType"])
def test_legacy_sse_transport_refused(key: str):
    message = config_error({"mcpServers": {"a": {"url": "http://h/sse", key: "sse"}}})
    assert "mcpServers.a:" in message and "SSE" in message


def test_claude_desktop_stdio_entry_is_accepted():
    config = cfg(
        {
            "files": {
                "command": "npx",
                "args": ["-y", "@modelcontextprotocol/server-filesystem", "/srv"],
                "env": {"A": "1"},
            }
        }
    )
    entry = config.servers["files"]
    assert entry.command == "npx" and entry.args[-1] == "/srv" and entry.env == {"A": "1"}


@pytest.mark.parametrize("spelling", [{"type": "stdio"}, {"transport": "stdio"}, {"transportType": "stdio"}])
def test_stdio_transport_spellings(spelling: dict):
    assert cfg({"s": {"command": "x", **spelling}}).servers["s"].command == "x"


def test_transport_kind_must_match_the_entry():
    assert "needs `url`" in config_error({"mcpServers": {"a": {"command": "x", "type": "http"}}})
    assert "needs `command`" in config_error({"mcpServers": {"a": {"url": "http://h/mcp", "type": "stdio"}}})
    assert "unknown transport" in config_error(
        {"mcpServers": {"a": {"url": "http://h/mcp", "type": "carrier-pigeon"}}}
    )


def test_gemini_http_url_spelling():
    assert cfg({"g": {"httpUrl": "http://h/mcp"}}).servers["g"].url == "http://h/mcp"


def test_exactly_one_of_url_and_command():
    assert "exactly one" in config_error({"mcpServers": {"a": {"url": "http://h/mcp", "command": "x"}}})
    assert "exactly one" in config_error({"mcpServers": {"a": {}}})


@pytest.mark.parametrize("name", ["has space", "a/b", "", "x" * 65])
def test_server_names_must_be_url_safe(name: str):
    assert "server name" in config_error({"mcpServers": {name: {"url": "http://h/mcp"}}})


# --- policy resolution --------------------------------------------------------------------------


def test_policy_resolution_tool_then_server_then_defaults():
    config = cfg(
        {
            "s": {
                "url": "http://h/mcp",
                "timeout": "5m",
                "tasks": {
                    "detach_after": "2s",
                    "tools": {
                        "deploy": {"mode": "required", "ttl": "10m"},
                        "ping": {"mode": "forbidden", "detach_after": "100ms", "poll_interval": "250ms"},
                    },
                },
            },
            "plain": {"url": "http://h/2"},
        },
        tasks={"detach_after": "10s", "ttl": "1h", "poll_interval": "2s"},
    )
    deploy = config.policy("s", "deploy")
    assert (deploy.mode, deploy.detach_after, deploy.ttl, deploy.poll_interval, deploy.timeout) == (
        ToolMode.REQUIRED,
        2.0,
        600.0,
        2.0,
        300.0,
    )
    ping = config.policy("s", "ping")
    assert (ping.mode, ping.detach_after, ping.ttl, ping.poll_interval) == (
        ToolMode.FORBIDDEN,
        0.1,
        3600.0,
        0.25,
    )
    other = config.policy("s", "other")
    assert (other.mode, other.detach_after, other.ttl, other.poll_interval) == (
        ToolMode.OPTIONAL,
        2.0,
        3600.0,
        2.0,
    )
    plain = config.policy("plain", "x")
    assert (plain.mode, plain.detach_after, plain.ttl, plain.poll_interval, plain.timeout) == (
        ToolMode.OPTIONAL,
        10.0,
        3600.0,
        2.0,
        1800.0,
    )


def test_zero_duration_at_tool_level_overrides_server():
    # 0s is a real value (detach at once), not "unset": it must not fall through to the server level.
    config = cfg(
        {
            "s": {
                "url": "http://h/mcp",
                "tasks": {"detach_after": "5s", "tools": {"now": {"detach_after": "0s"}}},
            }
        }
    )
    assert config.policy("s", "now").detach_after == 0.0


def test_defaults_without_tasks_section():
    config = cfg()
    policy = config.policy("a", "t")
    assert (policy.mode, policy.detach_after, policy.ttl, policy.poll_interval, policy.timeout) == (
        ToolMode.OPTIONAL,
        10.0,
        3600.0,
        2.0,
        1800.0,
    )


def test_listen_port_bounds():
    assert "listen.port" in config_error(
        {"listen": {"port": 70000}, "mcpServers": {"a": {"url": "http://h/mcp"}}}
    )
    assert cfg(listen={"port": 0}).listen.port == 0


def test_drain_grace_is_part_of_the_drain():
    assert cfg(listen={"drain_grace": "2s"}).listen.drain_grace == 2.0
    assert cfg().listen.drain_grace == 5.0
    # a grace over drain_detached is accepted; the drain cuts it to drain_detached
    assert cfg(listen={"drain_grace": "30s", "drain_detached": "10s"}).listen.drain_grace == 30.0


def test_absolute_store_path_is_kept(tmp_path: Path):
    (tmp_path / "c.yaml").write_text(
        f"store: {{path: {tmp_path / 'abs'}}}\nmcpServers: {{a: {{url: 'http://h/mcp'}}}}\n"
    )
    assert load_config(tmp_path / "c.yaml").store.path == str(tmp_path / "abs")


def test_urls_must_be_http_and_retention_positive():
    assert "must be an http:// or https:// URL" in config_error({"mcpServers": {"a": {"url": "notaurl"}}})
    assert "must be an http:// or https:// URL" in config_error({"mcpServers": {"a": {"url": "ftp://h/mcp"}}})
    assert "ttl must be longer than 0s" in config_error(
        {"tasks": {"ttl": "0s"}, "mcpServers": {"a": {"url": "http://h/mcp"}}}
    )
    assert "poll_interval must be longer than 0s" in config_error(
        {"mcpServers": {"a": {"url": "http://h/mcp", "tasks": {"tools": {"t": {"poll_interval": "0ms"}}}}}}
    )
    assert cfg(tasks={"detach_after": "0s"}).tasks.detach_after == 0  # detach at once is allowed


def test_hardening_keys_have_safe_defaults_and_are_checked(tmp_path):
    base = {"store": {"path": str(tmp_path)}, "mcpServers": {"a": {"url": "http://127.0.0.1:1/mcp"}}}
    config = config_from_data(base)
    entry = config.mcpServers["a"]
    assert (entry.init_timeout, entry.request_timeout, entry.connect_timeout) == (30.0, 30.0, 10.0)
    assert entry.max_response_bytes == 16 * 1024 * 1024 and entry.max_children == 32
    assert (config.listen.header_timeout, config.listen.body_timeout, config.listen.max_connections) == (
        10.0,
        30.0,
        None,
    )
    assert config.metrics.token is None
    bad = {**base, "mcpServers": {"a": {"url": "http://127.0.0.1:1/mcp", "request_timeout": "0s"}}}
    with pytest.raises(ConfigError, match="mcpServers.a: .*request_timeout must be longer than 0s"):
        config_from_data(bad)
    with pytest.raises(ConfigError, match="metrics.token"):
        config_from_data({**base, "metrics": {"token": "plain-secret"}})
    with pytest.raises(ConfigError, match="listen.max_connections"):
        config_from_data({**base, "listen": {"max_connections": 2}})
    # every zero bound at once (it took one run of check-config per bound), and the listener's too:
    # a 0 header or body bound was accepted, and cut any request whose head or body was not there at once
    zeros = {
        "url": "http://127.0.0.1:1/mcp",
        "init_timeout": "0s",
        "request_timeout": "0s",
        "connect_timeout": "0s",
    }
    message = config_error(
        {**base, "mcpServers": {"a": zeros}, "listen": {"header_timeout": "0s", "body_timeout": "0s"}}
    )
    assert "init_timeout, request_timeout and connect_timeout must each be longer than 0s" in message, message
    assert "listen.header_timeout: header_timeout must be longer than 0s" in message, message
    assert "listen.body_timeout: body_timeout must be longer than 0s" in message, message
    # a 0 keepalive wrote keepalives without pause on every open stream (a CPU at 1.6 MB in 3 s)
    message = config_error({**base, "listen": {"sse_keepalive": "0s"}})
    assert "listen.sse_keepalive: sse_keepalive must be at least 10ms" in message, message


@pytest.mark.parametrize(("lease", "ok"), [("10ms", False), ("100ms", True), ("15s", True)])
def test_store_lease_has_a_floor(lease: str, ok: bool):
    data = {"store": {"lease": lease}, "mcpServers": {"a": {"url": "http://h/mcp"}}}
    if ok:
        assert config_from_data(data).store.lease >= 0.1
    else:
        assert "store.lease" in config_error(data) and "at least 100ms" in config_error(data)


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"listen": {"public_url": "https://mcp.example.com/gateway"}}, "without a path"),
        ({"listen": {"public_url": "ftp://mcp.example.com"}}, "http:// or https://"),
        ({"listen": {"public_url": "https://user:pw@mcp.example.com"}}, "must not carry a user"),
        ({"auth": {"mode": "bearer", "tokens": {}, "scopes": {"a": {"*": ["x"]}}}}, "mode bearer needs"),
        # a section of another mode never leaves the proxy open (every client would be `anonymous`)
        ({"auth": {"tokens": {"ci": "sha256:" + "ab" * 32}}}, "auth.tokens is set but auth.mode is 'none'"),
        (
            {"auth": {"mode": "jwt", "jwt": {"issuer": "https://i"}, "tokens": {"ci": "x"}}},
            "set `mode: bearer`",
        ),
        ({"auth": {"jwt": {"issuer": "https://i"}}}, "auth.jwt is set but auth.mode is 'none'"),
        (
            {
                "auth": {
                    "mode": "bearer",
                    "tokens": {"ci": "sha256:" + "ab" * 32},
                    "header": {"trusted_peers": "any"},
                }
            },
            "auth.header is set but auth.mode is 'bearer'",
        ),
        ({"auth": {"mode": "jwt", "jwt": {"issuer": "https://i"}, "scopes": {"nope": {"*": ["x"]}}}}, "nope"),
        (
            {"auth": {"mode": "jwt", "jwt": {"issuer": "https://i"}, "scopes": {"a": {"*": ["a b"]}}}},
            "RFC 6749",
        ),
        ({"auth": {"mode": "jwt", "jwt": {}}}, "give `issuer`"),
        ({"auth": {"mode": "jwt", "jwt": {"issuer": "https://i", "jwks_timeout": "0s"}}}, "more than 0 s"),
        ({"auth": {"mode": "jwt", "jwt": {"issuer": "https://u:SECRET@i"}}}, "must not carry a user"),
        ({"auth": {"mode": "jwt", "jwt": {"issuer": "idp.example.com"}}}, "must be an http://"),
        ({"auth": {"mode": "jwt", "jwt": {"issuer": "https://i", "algorithms": []}}}, "algorithms"),
        # no audience to check a token against: tokens issued for any other service would pass
        ({"auth": {"mode": "jwt", "jwt": {"issuer": "https://i"}}}, "auth.mode jwt needs an audience"),
        ({"listen": {"public_url": "ftp://user:PUBSECRET@host"}}, "must not carry a user"),
        (
            {
                "mcpServers": {
                    "a": {
                        "url": "http://u",
                        "headers": {"Authorization": "x"},
                        "oauth": {"token_url": "http://t", "client_id": "c", "client_secret": "s"},
                    }
                }
            },
            "either `oauth` or an Authorization header",
        ),
        (
            {"mcpServers": {"a": {"url": "http://u:SECRET@h/mcp", "headers": {"Authorization": "Bearer x"}}}},
            "an HTTP request can carry only one",
        ),
        ({"mcpServers": {"a": {"url": "ftp://u:SECRET@h/mcp"}}}, "must be an http:// or https:// URL"),
    ],
)
def test_authorization_settings_are_checked(section: dict, expected: str):
    data = {"mcpServers": {"a": {"url": "http://127.0.0.1:9/mcp"}}, **section}
    message = config_error(data)
    assert expected in message and "SECRET" not in message


@pytest.mark.parametrize(
    "url",
    [
        "http://alice:S3cretPassw0rd@127.0.0.1:99999/mcp",
        "http://alice:S3cretPassw0rd@127.0.0.1:65536/mcp",
        "http://alice:S3cretPassw0rd@127.0.0.1:abc/mcp",
        "http://alice:S3cretPassw0rd@127.0.0.1:0/mcp",
        "http://alice:S3cretPassw0rd@/mcp",
        "http://alice:S3cretPassw0rd@exa mple.com/mcp",
        # a password holding `/`, `?` or `#` (base64 has `/`) ends the parse of the host early
        "https://alice:S3cretPassw0rd/Zm9v@127.0.0.1/mcp",
        "http://alice:S3cretPassw0rd?x@127.0.0.1/mcp",
        "http://alice:S3cretPassw0rd#x@127.0.0.1/mcp",
    ],
)
def test_an_upstream_url_that_cannot_be_connected_to_is_refused_without_its_password(url: str) -> None:
    """Such a URL used to pass and then fail at run time with aiohttp's error quoting it whole,
    password included, on the unauthenticated /readyz, in client errors and in the console."""
    message = config_error({"mcpServers": {"a": {"url": url}}})
    assert "cannot be used" in message or "must be an http" in message or "not a URL" in message, message
    assert "S3cretPassw0rd" not in message
    store = {
        "mcpServers": {"a": {"url": "http://127.0.0.1:9/mcp"}},
        "store": {"url": url.replace("http", "redis", 1)},
    }
    message = config_error(store)
    assert "store.url" in message and "S3cretPassw0rd" not in message, message


@pytest.mark.parametrize("token", ["test", "a", "Zq", "password"])
@pytest.mark.parametrize("where", ["auth", "console", "metrics"])
def test_the_hash_of_a_token_anyone_would_guess_is_refused(token: str, where: str) -> None:
    digest = hash_token(token)
    section = {
        "auth": {"auth": {"mode": "bearer", "tokens": {"ci": digest}}},
        "console": {"console": {"tokens": {"alice": digest}}},
        "metrics": {"metrics": {"token": digest}},
    }[where]
    message = config_error({"mcpServers": {"a": {"url": "http://127.0.0.1:9/mcp"}}, **section})
    assert "a token anyone would guess" in message and "hash-token" in message, message


def test_a_rate_that_allows_nothing_is_refused() -> None:
    message = config_error(
        {"mcpServers": {"a": {"url": "http://127.0.0.1:9/mcp"}}, "limits": {"failed_auth": "0/minute"}}
    )
    assert "allows nothing" in message and "null" in message


@pytest.mark.parametrize("name", ["tasks_rate", "failed_auth"])
@pytest.mark.parametrize(
    ("rate", "said"),
    [
        # parsed as its first rate alone, the second dropped unsaid
        ("10/hour;2/second", "names 2 rates; give one"),
        ("10/hour, 2/second", "names 2 rates; give one"),
        # `limits` reads a window of 0 as one of 1: the 0 was dropped unsaid
        ("1/0second", "has a window of 0"),
        ("3 per 00 minute", "has a window of 0"),
    ],
)
def test_a_rate_that_limits_would_read_otherwise_is_refused(name: str, rate: str, said: str) -> None:
    message = config_error({"mcpServers": {"a": {"url": "http://127.0.0.1:9/mcp"}}, "limits": {name: rate}})
    assert f"{name} {rate!r} {said}" in message, message
    assert getattr(cfg(limits={name: "10/2minutes"}).limits, name) == "10/2minutes"


def test_two_names_with_one_token_hash_are_refused() -> None:
    digest = hash_token("one-token-shared-by-two-names")
    server = {"mcpServers": {"a": {"url": "http://127.0.0.1:9/mcp"}}}
    for section in (
        {"auth": {"mode": "bearer", "tokens": {"ci": digest, "bot": digest}}},
        {"console": {"tokens": {"alice": digest, "bob": digest.upper().replace("SHA256", "sha256")}}},
    ):
        assert "have the same hash" in config_error({**server, **section})
    message = config_error({**server, "metrics": {"token": "sha256:test"}})
    assert "must be `sha256:` and 64 hex digits" in message


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("HTTP://MCP.Example.com:80/", "http://mcp.example.com"),
        ("https://mcp.example.com:443", "https://mcp.example.com"),
        ("https://mcp.example.com:8443", "https://mcp.example.com:8443"),
        ("http://[::1]:9000", "http://[::1]:9000"),
    ],
)
def test_public_url_is_kept_in_the_canonical_form_clients_compare_with(given: str, canonical: str) -> None:
    """`resource` and each token's `aud` are compared as strings: `HTTP://…` or a default port kept
    as given would never match what a client computes (RFC 3986 §6.2.2-6.2.3)."""
    data = {"listen": {"public_url": given}, "mcpServers": {"s": {"url": "http://127.0.0.1:1/mcp"}}}
    assert config_from_data(data).listen.public_url == canonical


def test_a_public_url_with_a_query_is_quoted_whole_in_its_error() -> None:
    data = {
        "listen": {"public_url": "http://127.0.0.1:27084?x=1"},
        "mcpServers": {"s": {"url": "http://127.0.0.1:1/mcp"}},
    }
    with pytest.raises(ConfigError, match=r"'http://127\.0\.0\.1:27084\?x=1'"):
        config_from_data(data)


@pytest.mark.parametrize("given", ["mcp.example.com", "mcp.example.com:8443", "//mcp.example.com"])
def test_a_url_without_its_scheme_is_quoted_as_written(given: str) -> None:
    """It was quoted as its parse (`'://mcp.example.com'`, `'mcp.example.com://8443'`)."""
    for data in (
        {"listen": {"public_url": given}, "mcpServers": {"s": {"url": "http://127.0.0.1:1/mcp"}}},
        {"mcpServers": {"s": {"url": given}}},
    ):
        message = config_error(data)
        assert f"{given!r} must be an http:// or https:// URL" in message, message


def test_a_password_that_ends_the_host_early_is_named_as_such_and_never_shown() -> None:
    """`https://bob:Zm9v/YmFy@h/mcp` parses with the host `bob` and the port `Zm9v`: the error says
    to percent-encode the password, not that the port is wrong; whitespace names the password too."""
    for url in ("https://bob:S3cret/YmFy@h.example/mcp", "http://bob:S3cret?x@h.example/mcp"):
        message = config_error({"mcpServers": {"a": {"url": url}}})
        assert "percent-encoded (%2F, %3F, %23)" in message and "S3cret" not in message, message
    message = config_error({"mcpServers": {"a": {"url": "https://bob:S3cret word@h.example/mcp"}}})
    assert "whitespace in its host, user or password" in message and "S3cret" not in message, message
