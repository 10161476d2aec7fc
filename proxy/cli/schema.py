"""`mcp-tasks-proxy schema`: the config file's JSON Schema (draft 2020-12), for editors."""

from __future__ import annotations

import json

from proxy.config import config_json_schema


def run(argv: list[str]) -> int:
    """Print the schema; always 0."""
    print(json.dumps(config_json_schema(), indent=2, sort_keys=True))
    return 0
