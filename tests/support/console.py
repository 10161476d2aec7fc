"""The console under test: a config with a console and client auth, its tokens, seeded records,
and a client that sends the client token."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from proxy.config import Config, config_from_data
from proxy.front.auth import hash_token
from proxy.tasks.diskcache_store import DiskcacheStore
from proxy.tasks.model import TaskRecord
from support.clients import ModernClient
from support.proxy import RunningProxy

CONSOLE_TOKEN = "console-token-for-tests"


CLIENT_TOKEN = "client-token-for-tests"


def console_config(legacy_url: str, store: Path | dict[str, Any], **top: Any) -> Config:
    """Two servers (`legacy`, `other`) on the fixture upstream, bearer client auth, a console;
    `store` is the diskcache directory, or a whole `store` section (a Redis store)."""
    return config_from_data(
        {
            "store": store if isinstance(store, dict) else {"path": str(store), "durable": False},
            "tasks": {"detach_after": "50ms", "ttl": "10m", "poll_interval": "100ms"},
            "auth": {"mode": "bearer", "tokens": {"ci": hash_token(CLIENT_TOKEN)}},
            "console": {"tokens": {"alice": hash_token(CONSOLE_TOKEN)}},
            "mcpServers": {"legacy": {"url": legacy_url}, "other": {"url": legacy_url}},
            **top,
        }
    )


async def seed(path: Path, records: list[TaskRecord]) -> None:
    """Commit `records` into a store directory (group-committed) before a proxy opens it."""
    store = DiskcacheStore(path, durable=False)
    try:
        await asyncio.gather(*(store.create(r) for r in records))
    finally:
        await store.close()


def client_for(proxy: RunningProxy, server: str = "legacy") -> ModernClient:
    client = ModernClient(proxy.url(server))
    original = client.headers_for

    def headers_for(method: str, params: dict) -> dict[str, str]:
        return {**original(method, params), "Authorization": f"Bearer {CLIENT_TOKEN}"}

    client.headers_for = headers_for  # type: ignore[method-assign]
    return client
