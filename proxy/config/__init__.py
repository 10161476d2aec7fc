"""The config file (design.md "Config contract"): one YAML or JSON file, read by `load_config`.

`base` holds the building blocks (the error type, durations, redaction), `sections` the
proxy-wide sections, `model` the servers and the whole file, `load` reading and the JSON Schema.
This package's face names what the rest of the proxy uses.
"""

from proxy.config.base import ConfigError, Duration, parse_duration, redact_url
from proxy.config.load import SCHEMA_FILE, config_from_data, config_json_schema, load_config
from proxy.config.model import Config, ResolvedPolicy, ServerEntry, TaskPolicy, ToolMode, UpstreamOAuth
from proxy.config.sections import (
    ANY_AUDIENCE,
    AuthConfig,
    ConsoleConfig,
    IntrospectionConfig,
    JwtConfig,
    LimitsConfig,
    ListenConfig,
    LoggingConfig,
    MetricsConfig,
    ReplicasConfig,
    RequestStateConfig,
    StoreConfig,
    TracingConfig,
    TrustedHeaderConfig,
)

__all__ = [
    "ANY_AUDIENCE",
    "SCHEMA_FILE",
    "AuthConfig",
    "Config",
    "ConfigError",
    "ConsoleConfig",
    "Duration",
    "IntrospectionConfig",
    "JwtConfig",
    "LimitsConfig",
    "ListenConfig",
    "LoggingConfig",
    "MetricsConfig",
    "ReplicasConfig",
    "RequestStateConfig",
    "ResolvedPolicy",
    "ServerEntry",
    "StoreConfig",
    "TaskPolicy",
    "TracingConfig",
    "ToolMode",
    "TrustedHeaderConfig",
    "UpstreamOAuth",
    "config_from_data",
    "config_json_schema",
    "load_config",
    "parse_duration",
    "redact_url",
]
