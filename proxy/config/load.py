"""Reading a config file: YAML or JSON, `${VAR}` interpolation, validation with errors that name
each key's path, paths relative to the file; and the JSON Schema the models give."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import expandvars
import yaml
from pydantic import ValidationError

from proxy.config.base import ConfigError
from proxy.config.model import Config


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a mapping naming one key twice is refused (PyYAML keeps
    the last silently: a block pasted twice would drop a server or a setting without a word). Keys
    a merge (`<<: *anchor`) brings in may still be overridden, as YAML intends."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if not isinstance(node, yaml.MappingNode):  # (`!!map [a, b]`): PyYAML's own error names it
            return super().construct_mapping(node, deep=deep)
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: the constructor below names it
                continue
            if first is not key_node:
                lines = f"lines {first.start_mark.line + 1} and {key_node.start_mark.line + 1}"
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} appears twice in one mapping ({lines}); give each key once"
                )
        return super().construct_mapping(node, deep=deep)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members as a dict; ValueError when one name appears twice (`json` keeps the last)."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"the key {key!r} appears twice in one object; give each key once")
        data[key] = value
    return data


def _variable(exc: Exception) -> str:
    """The variable an expandvars failure names ("" when it names none)."""
    return (str(exc.args[0]) if exc.args else "").partition(": ")[0]


def _interpolation_message(exc: Exception) -> str:
    """A readable sentence for an expandvars failure (its KeyError-based messages print quoted)."""
    text = str(exc.args[0]) if exc.args else str(exc)
    name, detail = _variable(exc), text.partition(": ")[2]
    if isinstance(exc, expandvars.UnboundVariable):
        return (
            f"environment variable {name} is not set (use ${{{name}:-default}} for a fallback, or \\$ for "
            f"a literal $)"
        )
    if isinstance(exc, expandvars.ParameterNullOrNotSet):
        return f"environment variable {name} is not set or empty" + (
            "" if detail == "parameter null or not set" else f": {detail}"
        )
    return f"cannot interpolate environment variables: {text}"


def _expand(text: str) -> tuple[str, list[str]]:
    """`text` with its variables expanded, and what stops that: one sentence per variable it lacks
    (each found with the ones before it standing in as set), or the sentence for a malformed part."""
    # A copy of the environment: `${VAR:=default}` must not change the proxy's own environment.
    environ = dict(os.environ)
    problems: list[str] = []
    while True:
        try:
            return expandvars.expand(text, nounset=True, environ=environ), problems
        except (expandvars.UnboundVariable, expandvars.ParameterNullOrNotSet) as exc:
            problems.append(_interpolation_message(exc))
            name = _variable(exc)
            if not name or environ.get(name):  # (standing in did not help: nothing more to find)
                return text, problems
            environ[name] = "set"
        except expandvars.ExpandvarsException as exc:
            return text, [*problems, _interpolation_message(exc)]


MAX_CONFIG_DEPTH = 32  # levels of mappings and lists a config may nest (the model itself needs fewer than 10)
MAX_CONFIG_VALUES = 1_000_000  # values a config tree may hold once YAML aliases are followed


def _check_shape(data: Any, source: str) -> None:
    """Raise ConfigError when the tree nests deeper than MAX_CONFIG_DEPTH (an alias to one of its
    own ancestors never ends) or holds more than MAX_CONFIG_VALUES values once aliases are followed
    (a "billion laughs" file): both refused after at most that many steps, before anything walks
    the tree recursively. Walked without recursion."""
    stack: list[tuple[Any, int]] = [(data, 0)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_CONFIG_VALUES:
            raise ConfigError(
                f"{source}: the config holds more than {MAX_CONFIG_VALUES} values once YAML aliases are "
                "followed (a fixed bound)"
            )
        if isinstance(node, (dict, list)):
            if depth >= MAX_CONFIG_DEPTH:
                raise ConfigError(
                    f"{source}: the config nests more than {MAX_CONFIG_DEPTH} levels deep (a fixed bound; "
                    "a YAML alias inside what it names never ends)"
                )
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)


def _interpolate(node: Any, path: str, errors: list[str], emptied: list[str]) -> Any:
    """`node` with `${VAR}` expanded in every string; each string that cannot be expanded is kept
    as it is and adds one line (`key.path: what is wrong`) to `errors` per variable it lacks, so
    one run names them all. Each string that expanded to nothing adds a line to `emptied` (shown
    only if the config is then invalid: a url that is "missing" was a variable set but empty)."""
    if isinstance(node, str):
        value, problems = _expand(node)
        errors.extend(f"{path or '<root>'}: {problem}" for problem in problems)
        if not problems and node and not value:
            emptied.append(
                f"{path or '<root>'}: {node[:200]!r} expanded to an empty string (a variable set but empty)"
            )
        return node if problems else value
    if isinstance(node, dict):
        return {
            k: _interpolate(v, f"{path}.{k}" if path else str(k), errors, emptied) for k, v in node.items()
        }
    if isinstance(node, list):
        return [_interpolate(v, f"{path}[{i}]", errors, emptied) for i, v in enumerate(node)]
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
    """Validate an already-parsed config tree (after `${VAR}` interpolation). Raises ConfigError,
    for a tree too deep or too large (`_check_shape`), with one line per string that cannot be
    interpolated (all of them, before validation), else one line per invalid key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    _check_shape(data, source)
    errors: list[str] = []
    emptied: list[str] = []
    data = _interpolate(data, "", errors, emptied)
    if errors:
        raise ConfigError(f"{source}: cannot interpolate environment variables\n" + "\n".join(errors))
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        notes = "".join(f"\nnote: {line}" for line in emptied)
        raise ConfigError(f"{source}: invalid config\n{_format_errors(exc)}{notes}") from None


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read a YAML or JSON config file (by content: JSON is valid YAML) and validate it.

    Relative `store.path` and `auth.jwt.jwks_file` values are taken relative to the config file's folder.
    Raises ConfigError naming the file and, for invalid values, each key's path; also for a file
    that is not UTF-8, names one key twice in a mapping, nests too deeply, or expands (aliases)
    past MAX_CONFIG_VALUES values.
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{file}: cannot read: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})"
        ) from None
    kind = "JSON" if file.suffix == ".json" else "YAML"
    try:
        if file.suffix == ".json":
            data = json.loads(text, object_pairs_hook=_unique_keys)
        else:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except (yaml.YAMLError, ValueError) as exc:  # (ValueError: JSON, and a number too long to read)
        raise ConfigError(f"{file}: not valid {kind}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{file}: the {kind} nests too deeply to read") from None
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

    The package ships it as `proxy/config/config.schema.json` so editors can validate config files
    (`# yaml-language-server: $schema=…`); a test keeps the file equal to this function's output.
    """
    schema = Config.model_json_schema(mode="validation")
    return {
        **schema,
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "mcp-tasks-proxy config",
    }
