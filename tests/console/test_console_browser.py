"""The operator console in real headless Chromium (Debian's `chromium`, driven by Playwright's Python
package through `executable_path`; no browser download): sign in, see a running task appear without
reloading, open it, cancel it, and watch its status turn `cancelled`; see a synchronous call under
"Running now" while it runs.

Marked `browser`: without Chromium or Playwright it fails under CI (`CI=true`) and is skipped elsewhere. With
`CONSOLE_SCREENSHOT=docs/console.png` it also saves the README's screenshot.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from support.browser import CHROMIUM, CHROMIUM_ARGS
from support.console import CONSOLE_TOKEN, client_for, console_config, seed
from support.proxy import Serve
from support.records import make_record

from proxy.tasks.model import TaskStatus, now_ms


@pytest.mark.browser
async def test_sign_in_see_a_task_appear_open_it_and_cancel_it(
    legacy_url: str, tmp_path: Path, serve: Serve
) -> None:
    from playwright.async_api import async_playwright, expect

    expect.set_options(timeout=15_000)  # a busy 2-core CI machine; every wait still ends

    now = now_ms()
    await seed(
        tmp_path / "store",
        [  # some history, so the table is not empty
            make_record(
                task_id="nightly-build-7",
                server="other",
                tool="build",
                principal="ci",
                status=TaskStatus.COMPLETED,
                created_ms=now - 400_000,
                status_message="build 7 done",
                ttl_ms=3_600_000,
                outcome={"result": {"content": [{"type": "text", "text": "ok"}]}},
            ),
            make_record(
                task_id="deploy-staging-3",
                server="legacy",
                tool="deploy",
                principal="release-bot",
                status=TaskStatus.FAILED,
                created_ms=now - 90_000,
                status_message="upstream timed out after 60 s",
                ttl_ms=3_600_000,
                outcome={"error": {"code": -32603, "message": "timed out"}},
            ),
        ],
    )
    proxy = await serve(console_config(legacy_url, tmp_path / "store"))
    client = client_for(proxy, "legacy")
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True
        )
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 720})
            page.set_default_timeout(15_000)
            await page.goto(proxy.base + "/console/")
            await expect(page.locator("#login")).to_be_visible()
            # signed out: no operator bar (its `display: flex` overrode `hidden`: "Sign out" showed)
            await expect(page.locator("#who")).to_be_hidden()
            await page.fill("#token", CONSOLE_TOKEN)
            await page.click("#signin")
            await expect(page.locator("#live")).to_have_text("live")  # the event stream is open
            await expect(page.locator("#operator")).to_have_text("alice")
            await page.evaluate("window.__notReloaded = true")
            await expect(page.locator('tr[data-task-id="deploy-staging-3"] td.status')).to_have_text("failed")

            # A call that stays synchronous (its client did not ask for tasks) shows under "Running now".
            waiting = client_for(proxy, "legacy")
            waiting.capabilities = {}
            try:
                sync = asyncio.create_task(
                    waiting.call("slow_compute", {"seconds": 3, "label": "browser-sync"})
                )
                in_flight = page.locator("#running tbody tr", has_text="slow_compute")
                await expect(in_flight).to_have_count(1)
                await expect(in_flight).to_contain_text("modern")
                await expect(page.locator("#running-summary")).to_contain_text("1 request(s) on 1 replica(s)")
                assert (await sync).result["content"][0]["text"] == "computed browser-sync after 3s"
                await expect(page.locator("#running tbody")).to_contain_text("nothing in flight")
            finally:
                await waiting.close()

            kept = (await client.call("slow_compute", {"seconds": 60, "label": "browser-kept"})).result[
                "taskId"
            ]
            task_id = (await client.call("slow_compute", {"seconds": 60, "label": "browser-cancel"})).result[
                "taskId"
            ]
            row = page.locator(f'tr[data-task-id="{task_id}"]')
            await expect(row.locator("td.status")).to_have_text("working")  # appeared from the stream
            await expect(page.locator(f'tr[data-task-id="{kept}"] td.status')).to_have_text("working")

            await row.click()
            await expect(page.locator("#d-id")).to_have_text(task_id)
            await expect(page.locator('#detail [data-field="status"]')).to_have_text("working")
            await expect(page.locator("#upstreams")).to_contain_text("legacy: ready")

            await page.click("#cancel-btn")
            await expect(page.locator("#confirm")).to_be_visible()
            await page.click("#confirm-yes")
            await expect(row.locator("td.status")).to_have_text("cancelled")
            await expect(page.locator('#detail [data-field="status"]')).to_have_text("cancelled")
            await expect(page.locator("#cancel-btn")).to_be_hidden()
            await expect(page.locator("#d-history li")).to_have_count(2)
            assert await page.evaluate("window.__notReloaded === true")
            record = await proxy.store.get(task_id)
            assert record.status is TaskStatus.CANCELLED and record.status_message == "cancelled by operator"
            assert (await proxy.store.get(kept)).status is TaskStatus.WORKING
            # the overview followed the changes
            await expect(page.locator("#upstreams")).to_contain_text("1 detached call(s) running")
            if os.environ.get("CONSOLE_SCREENSHOT"):  # with a synchronous call in flight
                shown = client_for(proxy, "legacy")
                shown.capabilities = {}
                try:
                    held = asyncio.create_task(shown.call("slow_compute", {"seconds": 30, "label": "shot"}))
                    await expect(page.locator("#running tbody tr", has_text="slow_compute")).to_have_count(1)
                    await page.screenshot(path=os.environ["CONSOLE_SCREENSHOT"], full_page=True)
                    held.cancel()
                finally:
                    await shown.close()
        finally:
            await browser.close()
            await client.close()
