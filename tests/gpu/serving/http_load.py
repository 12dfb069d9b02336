"""An independent HTTP client for serving figures: aiohttp in several processes, no code shared with the service.

    python tests/gpu/serving/http_load.py URL --requests 1024 --concurrency 256 --procs 8 [--stream] [--pids 1,2,3]

Each process sends its share of the requests (closed loop, its share of the concurrency) to /v1/completions,
128 random prompt ids in, --output-len tokens out with ignore_eos, and records each request's first-chunk
time, chunk gaps and token count. The window is first request sent to last byte received, across processes.
With --pids, each listed process's CPU seconds over the window are reported (the server's processes); each of
the client's own processes reports its CPU share too. --extra adds fields to every request (e.g. penalties).
Each run draws new prompts (--seed, random unless given, is in the output): prompts repeated from an earlier run
would be found in the server's prefix cache, and that run would be faster for it. Prints one JSON line.
"""

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import statistics
import time


async def _worker(url: str, model: str, n: int, conc: int, stream: bool, input_len: int, output_len: int,
                  seed: int, start_at: float, extra: dict, vocab: int) -> list:
    import aiohttp

    rng = random.Random(seed)
    bodies = [{"model": model, "prompt": [rng.randrange(100, vocab) for _ in range(input_len)],
               "max_tokens": output_len, "ignore_eos": True, "temperature": 0.0, "stream": stream, **extra}
              for _ in range(n)]
    results, queue = [], list(range(n))
    while time.time() < start_at:
        await asyncio.sleep(min(0.01, start_at - time.time()))
    conn = aiohttp.TCPConnector(limit=conc, force_close=False)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=1800)) as session:
        async def one_slot():
            while queue:
                i = queue.pop()
                t0 = time.perf_counter()
                times, tokens, ok = [], 0, False
                async with session.post(url + "/v1/completions", json=bodies[i]) as r:
                    if stream:
                        buf = b""
                        async for chunk in r.content.iter_any():
                            now = time.perf_counter()
                            buf += chunk
                            *events, buf = buf.split(b"\n\n")
                            for ev in events:
                                if ev.startswith(b"data: {"):
                                    d = json.loads(ev[6:])
                                    if d.get("choices"):
                                        times.append(now)
                                elif ev == b"data: [DONE]":
                                    ok = r.status == 200
                        tokens = output_len if ok else 0
                    else:
                        d = await r.json()
                        ok = r.status == 200
                        tokens = d["usage"]["completion_tokens"] if ok else 0
                        times.append(time.perf_counter())
                end = time.perf_counter()
                results.append((t0, end, times, tokens, ok, time.time() - (time.perf_counter() - t0)))
        await asyncio.gather(*[one_slot() for _ in range(conc)])
    return results


def _proc(args, share, conc, seed, start_at, q):
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    cpu = time.process_time()
    results = asyncio.run(_worker(args.url, args.model, share, conc, args.stream, args.input_len, args.output_len,
                                  seed, start_at, json.loads(args.extra), args.vocab))
    q.put((results, time.process_time() - cpu))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--model", default="random:llama-1b")
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=30000, help="prompt token ids are drawn from [100, VOCAB)")
    ap.add_argument("--pids", default="")
    ap.add_argument("--label", default="")
    ap.add_argument("--extra", default="{}", help="JSON object of fields added to every request body")
    ap.add_argument("--seed", type=int, default=None, help="seeds the prompts (default: a new one each run)")
    args = ap.parse_args()
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2 ** 31)
    procs = min(args.procs, args.concurrency)
    shares = [args.requests // procs + (i < args.requests % procs) for i in range(procs)]
    concs = [args.concurrency // procs + (i < args.concurrency % procs) for i in range(procs)]
    start_at = time.time() + 1.0
    q = mp.get_context("fork").Queue()
    ps = [mp.get_context("fork").Process(target=_proc, args=(args, s, c, args.seed * 1000 + i, start_at, q))
          for i, (s, c) in enumerate(zip(shares, concs))]
    for p in ps:
        p.start()
    import psutil
    pids = [int(p) for p in args.pids.split(",") if p]
    cpu0 = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            cpu0[pid] = t.user + t.system
        except psutil.Error:
            pass
    done = [q.get() for _ in ps]
    results = [r for rs, _ in done for r in rs]
    for p in ps:
        p.join()
    # window: first request sent to last byte received, in wall-clock terms (processes share time.time)
    starts = [r[5] for r in results]
    ends = [r[5] + (r[1] - r[0]) for r in results]
    window = max(ends) - min(starts)
    cpu = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            cpu[pid] = round((t.user + t.system - cpu0[pid]) / window, 3)
        except psutil.Error:
            pass
    ok = [r for r in results if r[4]]
    ttft = [(r[2][0] - r[0]) * 1e3 for r in ok if r[2]]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r[2], r[2][1:])] if args.stream else []
    out = {"label": args.label, "seed": args.seed, "stream": args.stream, "requests": len(results),
           "errors": len(results) - len(ok), "concurrency": args.concurrency, "procs": procs,
           "window_s": round(window, 3),
           "output_tok_s": round(sum(r[3] for r in ok) / window, 1),
           "ttft_p50_ms": round(statistics.median(ttft), 2) if ttft else None,
           "ttft_mean_ms": round(statistics.mean(ttft), 2) if ttft else None,
           "itl_p50_ms": round(statistics.median(itl), 3) if itl else None,
           "cpu_share": cpu, "client_cpu_share": sorted(round(c / window, 3) for _, c in done)}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
