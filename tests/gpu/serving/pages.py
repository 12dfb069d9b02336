"""Open /dashboard pages, as a browser holds them, for the page's cost under load (the GPU machine has no browser).

    python tests/gpu/serving/pages.py URL --pages 5 --seconds 120

Each page does what dashboard.js does: load the HTML and every asset it names, fetch the whole history
(/dashboard/data), then every second the points after its last one (?since=T), each on its own connection
as a browser tab keeps its own. Runs until --seconds pass or SIGINT/SIGTERM comes (within a second), then prints
one JSON line: polls, failures, bytes and the slowest answer.
"""

import argparse
import asyncio
import json
import re
import signal
import time


async def page(session, url: str, until: list[float], stats: dict) -> None:
    async with session.get(url + "/dashboard") as r:
        html = await r.text()
    for asset in re.findall(r'(?:src|href)="(/dashboard/static/[^"]+)"', html):
        async with session.get(url + asset) as r:
            stats["bytes"] += len(await r.read())
    since = None
    while time.monotonic() < until[0]:
        began = time.monotonic()
        try:
            query = "" if since is None else f"?since={since!r}"
            async with session.get(url + "/dashboard/data" + query) as r:
                r.raise_for_status()
                body = await r.read()
            stats["bytes"] += len(body)
            t = json.loads(body)["points"]["t"]
            since = t[-1] if t else since
            stats["polls"] += 1
        except Exception:
            stats["failures"] += 1
        took = time.monotonic() - began
        stats["slowest"] = max(stats["slowest"], took)
        await asyncio.sleep(max(0.0, 1.0 - took))


async def main() -> None:
    import aiohttp

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url")
    ap.add_argument("--pages", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=120)
    args = ap.parse_args()
    stats = {"pages": args.pages, "polls": 0, "failures": 0, "bytes": 0, "slowest": 0.0}
    until = [time.monotonic() + args.seconds]
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, lambda: until.__setitem__(0, 0.0))
    sessions = [aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) for _ in range(args.pages)]
    try:
        await asyncio.gather(*(page(s, args.url, until, stats) for s in sessions))
    finally:
        for s in sessions:
            await s.close()
        print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
