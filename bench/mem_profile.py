"""Diagnostic (not part of run.py): where the memory of a detached in-flight call goes.

Runs the proxy in-process (tests/support/proxy.py's `running_proxy`) in front of bench/fake_upstream.py,
creates N detached `hold` calls, and prints the top tracemalloc allocation sites (grouped by file)
of the difference. tracemalloc sees Python allocations only (not the kernel socket buffers, not
allocator slack), so its total is a lower bound of section (d)'s RSS figure.

    python bench/mem_profile.py --calls 2000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _where(filename: str) -> str:
    """A frame's file, short: relative to the checkout or to site-packages / the standard library."""
    return filename.split("site-packages/")[-1].split("lib/python3")[-1].replace(str(ROOT) + "/", "")


sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


async def main(n: int, top: int) -> None:
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from support.clients import ModernClient
    from support.proxy import make_config, running_proxy

    up = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "fake_upstream.py"), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = up.stdout.readline().strip().removeprefix("listening on ")
        with tempfile.TemporaryDirectory() as tmp:
            config = make_config(url, Path(tmp) / "store", tasks={"detach_after": "20ms"}, name="bench")
            async with running_proxy(config) as proxy:
                client = ModernClient(proxy.url())
                try:
                    sem = asyncio.Semaphore(64)

                    async def one(seconds: float) -> None:
                        async with sem:
                            r = await client.call("hold", {"seconds": seconds})
                            assert r.result["resultType"] == "task", r.message

                    await asyncio.gather(*(one(0.1) for _ in range(100)))  # warm-up
                    await asyncio.sleep(0.5)
                    gc.collect()
                    tracemalloc.start(25)
                    before = tracemalloc.take_snapshot()
                    await asyncio.gather(*(one(3600) for _ in range(n)))
                    await asyncio.sleep(0.5)
                    gc.collect()
                    after = tracemalloc.take_snapshot()
                    stats = after.compare_to(before, "filename")
                    total = sum(s.size_diff for s in stats)
                    print(
                        f"{n} detached calls in flight: +{total / n / 1024:.2f} KB/call traced by tracemalloc"
                    )
                    for s in stats[:top]:
                        print(
                            f"  {s.size_diff / n:8.0f} B/call  {s.count_diff / n:6.1f} blocks/call  "
                            f"{s.traceback[0].filename.replace(str(ROOT) + '/', '')}"
                        )
                    print(
                        "by the innermost proxy/ frame of the allocation's traceback, then the allocating "
                        "line:"
                    )
                    owners: dict[tuple[str, str], list[int]] = {}
                    for s in after.compare_to(before, "traceback"):
                        frames = [f"{_where(f.filename)}:{f.lineno}" for f in s.traceback]
                        # tracemalloc tracebacks are innermost-last after compare_to(..., "traceback")? take
                        # both orders into account
                        own = next(
                            (f for f in reversed(frames) if f.startswith("proxy/")), "(no proxy frame)"
                        )
                        key = (own, frames[-1])
                        acc = owners.setdefault(key, [0, 0])
                        acc[0] += s.size_diff
                        acc[1] += s.count_diff
                    for (own, site), (size, count) in sorted(owners.items(), key=lambda kv: -kv[1][0])[
                        : top * 3
                    ]:
                        print(f"  {size / n:8.0f} B/call {count / n:5.1f} blk  {own:40s} <- {site}")
                    print("top lines:")
                    for s in after.compare_to(before, "lineno")[:top]:
                        frame = s.traceback[0]
                        print(f"  {s.size_diff / n:8.0f} B/call  {_where(frame.filename)}:{frame.lineno}")
                    tracemalloc.stop()
                finally:
                    await client.close()
    finally:
        up.terminate()
        up.wait(timeout=10)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    asyncio.run(main(a.calls, a.top))
