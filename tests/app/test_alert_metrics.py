"""The metrics deploy/prometheus/rules.yml and the Grafana dashboard need beyond the first ones:
upstream errors by server, whether the store takes writes, store errors, the lease and its renewals,
and the live replicas. Read from `/metrics` as Prometheus reads them; the registry is process-wide
(other tests move it too), so counters are compared as deltas."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.clients import ModernClient
from support.proxy import Serve, make_config
from support.redis_server import RedisServer
from support.relay import relay_to

from proxy.config import Config, config_from_data

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]  # (sample name, labels) -> value


async def scrape(base: str) -> Samples:
    """`/metrics` of the proxy at `base`, parsed: (sample name, labels) → value."""
    async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample `name` with exactly `labels` (0 when absent)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


async def test_upstream_errors_count_the_calls_the_upstream_failed_by_server_and_way(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    # detach_after well above a quick call's time on a loaded machine; the slow tools take ≥ 1 s
    proxy = await serve(make_config(legacy_url, tmp_path / "store", tasks={"detach_after": "500ms"}))
    client = ModernClient(proxy.url())
    await client.warm_up()  # the upstream session of this client's capabilities is open
    before = await scrape(proxy.base)
    try:
        assert "content" in (await client.call("greet", {"name": "ok"})).result  # sync, fine
        assert (await client.call("instant_error")).error["code"] == -32603  # sync, a JSON-RPC error
        failed, tool_error, cancelled = [  # all detached: then a JSON-RPC error, an isError result, a cancel
            reply.result
            for reply in await asyncio.gather(
                client.call("protocol_error_job"),
                client.call("failing_job"),
                client.call("slow_compute", {"seconds": 10, "label": "alert-metrics"}),
            )
        ]
        await client.request("tasks/cancel", {"taskId": cancelled["taskId"]})
        statuses = [
            (await client.wait_terminal(t["taskId"]))["status"] for t in (failed, tool_error, cancelled)
        ]
        assert statuses == ["failed", "completed", "cancelled"]
    finally:
        await client.close()
    after = await scrape(proxy.base)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("mcp_tasks_proxy_upstream_errors_total", server="legacy", via="request") == 1
    assert delta("mcp_tasks_proxy_upstream_errors_total", server="legacy", via="task") == 1
    assert delta("mcp_tasks_proxy_calls_total", server="legacy", tool="instant_error", outcome="error") == 1


def redis_config(legacy_url: str, url: str, prefix: str, *, replicas: bool = False, **store: str) -> Config:
    """One server in front of the legacy fixture, its task store the Redis at `url` under `prefix`
    (`store` adds keys), as a replica (`replicas`) or not."""
    return config_from_data(
        {
            "store": {"url": url, "prefix": prefix, **store},
            "tasks": {"detach_after": "50ms", "ttl": "10m", "poll_interval": "100ms"},
            "mcpServers": {"legacy": {"url": legacy_url}},
            **({"replicas": {"secret": "alert-metrics-" + "s" * 24}} if replicas else {}),
        }
    )


async def wait_metrics(base: str, check: Callable[[Samples], bool], timeout_s: float = 10.0) -> Samples:
    """Scrape `base` every 50 ms until `check(samples)` holds; return those samples."""
    async with asyncio.timeout(timeout_s):
        while not check(samples := await scrape(base)):
            await asyncio.sleep(0.05)
    return samples


@pytest.mark.redis
async def test_store_writable_and_the_lease_follow_a_store_cut_off_and_back(
    legacy_url: str, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    async with relay_to(redis_server) as (relay, url):
        proxy = await serve(redis_config(legacy_url, url, redis_prefix, lease="1200ms", timeout="300ms"))
        before = await scrape(proxy.base)
        assert value(before, "mcp_tasks_proxy_store_writable") == 1
        assert value(before, "mcp_tasks_proxy_lease_seconds") == 1.2
        renewed = value(before, "mcp_tasks_proxy_lease_renewed_timestamp_seconds")
        assert time.time() - 1.2 < renewed <= time.time()  # renewed every sixth of the lease
        relay.pause()  # cut off: renewals and every other store call time out
        cut = await wait_metrics(proxy.base, lambda s: value(s, "mcp_tasks_proxy_store_writable") == 0)
        for name in ("mcp_tasks_proxy_lease_renewal_failures_total", "mcp_tasks_proxy_store_errors_total"):
            assert value(cut, name) > value(before, name), name
        stale = value(cut, "mcp_tasks_proxy_lease_renewed_timestamp_seconds")
        async with aiohttp.ClientSession() as http, http.get(f"{proxy.base}/readyz") as resp:
            assert resp.status == 503
        assert value(await scrape(proxy.base), "mcp_tasks_proxy_store_writable") == 0
        relay.resume()
        back = await wait_metrics(
            proxy.base,
            lambda s: (
                value(s, "mcp_tasks_proxy_store_writable") == 1
                and value(s, "mcp_tasks_proxy_lease_renewed_timestamp_seconds") > stale
            ),
        )
        assert value(back, "mcp_tasks_proxy_lease_renewed_timestamp_seconds") <= time.time()


@pytest.mark.redis
async def test_the_replicas_gauge_counts_the_live_replicas_of_the_shared_store(
    legacy_url: str, serve: Serve, redis_server: RedisServer, redis_prefix: str
) -> None:
    first = await serve(redis_config(legacy_url, redis_server.url, redis_prefix, replicas=True))
    second = await serve(redis_config(legacy_url, redis_server.url, redis_prefix, replicas=True))
    store = f"{redis_server.url} {redis_prefix}"  # the replica set: Redis (no credentials) and prefix
    assert value(await scrape(first.base), "mcp_tasks_proxy_replicas", store=store) == 2
    assert value(await scrape(second.base), "mcp_tasks_proxy_replicas", store=store) == 2
    await second.stop()  # a clean exit withdraws its registry record
    assert value(await scrape(first.base), "mcp_tasks_proxy_replicas", store=store) == 1
