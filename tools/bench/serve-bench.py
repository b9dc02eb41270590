#!/usr/bin/env python3
"""Load generator for `strata serve` (standard library only, so it runs on
machines without network): N clients each stream one text completion of
random prompt tokens at the same time, and the aggregate decode rate and
the time to first token are measured from the chunks' arrival times.

  tools/bench/serve-bench.py --url http://127.0.0.1:8080 --clients 64 \
      --prompt-tokens 16 --max-tokens 32 --vocab 49152 [--json out.json]

Aggregate decode rate: tokens that arrived while every client was past its
first token and none had finished, over that window's length (the steady
state `strata bench -B N` measures). Each completion runs to max_tokens
(ignore_eos), at temperature 0.
"""
import argparse
import asyncio
import json
import random
import statistics
import time
from urllib.parse import urlparse


async def one(host, port, body):
    t0 = time.monotonic()
    r, w = await asyncio.open_connection(host, port)
    data = json.dumps(body).encode()
    # the server answers only the hosts it serves (a DNS-rebinding guard)
    w.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n".encode()
            + f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    await w.drain()
    status = (await r.readline()).split()[1]
    if status != b"200":
        raise RuntimeError(f"status {status}: {(await r.read()).decode(errors='replace')}")
    while (await r.readline()) not in (b"\r\n", b""):
        pass
    times, usage = [], None
    buf = b""
    while True:
        chunk = await r.read(65536)
        if not chunk:
            break
        now = time.monotonic()
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            for line in ev.split(b"\n"):
                # chunked transfer encoding puts size lines between events
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    continue
                v = json.loads(payload)
                if v.get("usage"):
                    usage = v["usage"]
                for c in v.get("choices", []):
                    if c.get("text"):
                        times.append(now)
    w.close()
    return t0, times, usage


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--json")
    a = ap.parse_args()
    u = urlparse(a.url)
    rng = random.Random(1)
    bodies = [{"prompt": [rng.randrange(a.vocab) for _ in range(a.prompt_tokens)], "max_tokens": a.max_tokens,
               "temperature": 0, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
              for _ in range(a.clients)]
    start = time.monotonic()
    res = await asyncio.gather(*(one(u.hostname, u.port, b) for b in bodies))
    wall = time.monotonic() - start
    firsts = [t[0] for _, t, _ in res]
    lasts = [t[-1] for _, t, _ in res]
    lo, hi = max(firsts), min(lasts)
    in_window = sum(1 for _, t, _ in res for x in t if lo < x <= hi)
    ttft = sorted(t[0] - t0 for t0, t, _ in res)
    tokens = sum(u["completion_tokens"] for _, _, u in res)
    out = {
        "clients": a.clients,
        "prompt_tokens": a.prompt_tokens,
        "max_tokens": a.max_tokens,
        "completion_tokens": tokens,
        "wall_s": wall,
        "steady_window_s": hi - lo,
        "aggregate_decode_tps": in_window / (hi - lo) if hi > lo else float("nan"),
        "overall_tps": tokens / wall,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
    }
    print(f"{a.clients} streaming clients, {a.prompt_tokens}-token prompts, {a.max_tokens} tokens each: "
          f"aggregate decode {out['aggregate_decode_tps']:.1f} t/s over a {out['steady_window_s']:.1f} s steady window "
          f"({tokens} tokens in {wall:.1f} s, {out['overall_tps']:.1f} t/s overall); "
          f"time to first token p50 {out['ttft_p50_s']:.2f} s, p99 {out['ttft_p99_s']:.2f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


asyncio.run(main())
