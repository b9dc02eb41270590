#!/usr/bin/env python3
"""Load test of a running `strata serve` (standard library only): CLIENTS
clients send REQUESTS short requests between them (chat and text
completions, streamed and not, 4 to 16 tokens each), optionally while
abusive clients run beside them for as long as the well-formed ones do:

- special-token floods (a 200 KB prompt of `<|im_start|>`),
- prompts of 3 MB (longer than any context: refused after a byte check),
- malformed JSON and wrong content types,
- half-sent requests (headers, part of the body, then nothing),
- slow headers (one byte a second),
- 200 connections opened and left idle,

each kind in its own loop, one request every --pace seconds (0.5).

Prints the well-formed requests' throughput, latency (p50, p99), errors,
the completion tokens per second, what the abusive requests were answered,
and the server's resident memory (sampled every half second) at the start,
its peak and the end.

  tools/bench/serve-load.py --url http://127.0.0.1:8080 --pid PID [--abuse] [--json out.json]
"""
import argparse
import asyncio
import json
import random
import statistics
import time
from urllib.parse import urlparse

WORDS = ("the river runs past old stone mills where the town keeps its grain and "
         "its stories of floods and dry years alike").split()


async def request(host, port, path, body, timeout=120.0, content_type="application/json"):
    """One HTTP/1.1 request; returns (status, body bytes)."""
    r, w = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        w.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n".encode()
                + f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await w.drain()
        raw = await asyncio.wait_for(r.read(), timeout)
    finally:
        w.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    status = int(head.split()[1]) if head else 0
    return status, rest


def completion_tokens(status, body, stream):
    """Completion tokens of an answer (usage, or the chunks of a stream)."""
    if status != 200:
        return 0
    if stream:
        # chunked transfer: count the data events that carry text
        return sum(1 for line in body.split(b"\n")
                   if line.startswith(b"data: {") and b'"finish_reason":null' in line)
    try:
        return json.loads(body)["usage"]["completion_tokens"]
    except (ValueError, KeyError):
        return 0


async def well_formed(host, port, queue, rng, out):
    while True:
        try:
            queue.get_nowait()
        except asyncio.QueueEmpty:
            return
        stream = rng.random() < 0.5
        n = rng.randrange(4, 17)
        words = " ".join(rng.choice(WORDS) for _ in range(rng.choice([4, 12, 40])))
        if rng.random() < 0.5:
            path = "/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": words}], "max_tokens": n,
                    "temperature": 0.8, "seed": rng.randrange(1 << 30), "stream": stream}
        else:
            path = "/v1/completions"
            body = {"prompt": words, "max_tokens": n, "temperature": 0.8,
                    "seed": rng.randrange(1 << 30), "stream": stream}
        t0 = time.monotonic()
        try:
            status, data = await request(host, port, path, body)
            err = None if status == 200 else f"status {status}: {data[:200]!r}"
        except (OSError, asyncio.TimeoutError) as e:
            status, data, err = 0, b"", f"{type(e).__name__}: {e}"
        out.append({"latency": time.monotonic() - t0, "error": err,
                    "tokens": completion_tokens(status, data, stream)})


async def abusive(host, port, done, rng, seen, kind, pace):
    """Abusive requests of one kind (an index into the kinds below), one
    after another, until `done` is set."""
    flood = {"prompt": "<|im_start|>" * 16000, "max_tokens": 4}
    huge = {"prompt": " ".join(rng.choice(WORDS) for _ in range(600000)), "max_tokens": 4}

    def note(kind, what):
        seen.setdefault(kind, {}).setdefault(what, 0)
        seen[kind][what] += 1

    async def answered(kind, coro):
        try:
            status, _ = await coro
            note(kind, str(status))
        except (OSError, asyncio.TimeoutError) as e:
            note(kind, type(e).__name__)

    async def half_sent():
        r, w = await asyncio.open_connection(host, port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n{\"prompt\": \"abc")
        await w.drain()
        t0 = time.monotonic()
        got = await asyncio.wait_for(r.read(), 120)
        note("half-sent body", f"closed after {time.monotonic() - t0:.0f} s"
             + (f" ({got.split()[1].decode()})" if got else ""))
        w.close()

    async def slow_headers():
        r, w = await asyncio.open_connection(host, port)
        t0 = time.monotonic()
        try:
            for b in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
                w.write(bytes([b]))
                await w.drain()
                await asyncio.sleep(1.0)
                if r.at_eof():
                    break
            note("slow headers", f"closed after {time.monotonic() - t0:.0f} s")
        except OSError:
            note("slow headers", f"closed after {time.monotonic() - t0:.0f} s")
        w.close()

    kinds = [
        lambda: answered("special-token flood", request(host, port, "/v1/completions", flood)),
        lambda: answered("3 MB prompt", request(host, port, "/v1/completions", huge)),
        lambda: answered("malformed JSON", request(host, port, "/v1/completions", b"{\"prompt\": [1, 2,")),
        lambda: answered("text/plain body", request(host, port, "/v1/completions", {"prompt": "hi"},
                                                    content_type="text/plain")),
        half_sent,
        slow_headers,
    ]
    while not done.is_set():
        await kinds[kind % len(kinds)]()
        # mixed in, not a flood: a loop in a tight cycle would measure how
        # many bad requests per second the cores can refuse (tens of
        # thousands a minute), not whether they stall the good ones
        await asyncio.sleep(pace)


async def idle_connections(host, port, n, done):
    conns = []
    for _ in range(n):
        try:
            conns.append(await asyncio.open_connection(host, port))
        except OSError:
            break
    await done.wait()
    for _, w in conns:
        w.close()
    return len(conns)


async def rss_sampler(pid, done, samples):
    while not done.is_set():
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        samples.append(int(line.split()[1]) / 1024)
        except OSError:
            pass
        await asyncio.sleep(0.5)


async def main(a):
    u = urlparse(a.url)
    host, port = u.hostname, u.port or 80
    rng = random.Random(a.seed)
    queue = asyncio.Queue()
    for i in range(a.requests):
        queue.put_nowait(i)
    out, seen, rss = [], {}, []
    done = asyncio.Event()
    side = [asyncio.create_task(rss_sampler(a.pid, done, rss))] if a.pid else []
    if a.abuse:
        # every kind in its own loop: a half-sent request holds its loop for
        # the body timeout, the floods keep coming meanwhile
        side += [asyncio.create_task(abusive(host, port, done, random.Random(a.seed + k), seen, k, a.pace))
                 for k in range(a.abusers)]
        idle = asyncio.create_task(idle_connections(host, port, 200, done))
    # warm-up, untimed: the first steps of each size build their graphs
    warm = asyncio.Queue()
    for i in range(2 * a.clients):
        warm.put_nowait(i)
    await asyncio.gather(*(well_formed(host, port, warm, random.Random(c), []) for c in range(a.clients)))
    t0 = time.monotonic()
    await asyncio.gather(*(well_formed(host, port, queue, random.Random(a.seed * 1000 + c), out)
                           for c in range(a.clients)))
    wall = time.monotonic() - t0
    done.set()
    n_idle = await idle if a.abuse else 0
    await asyncio.gather(*side, return_exceptions=True)
    lat = sorted(r["latency"] for r in out)
    errors = [r["error"] for r in out if r["error"]]
    tokens = sum(r["tokens"] for r in out)
    res = {
        "abuse": a.abuse, "clients": a.clients, "requests": len(out), "errors": len(errors),
        "wall_s": wall, "requests_per_s": len(out) / wall, "completion_tokens_per_s": tokens / wall,
        "latency_p50_s": statistics.median(lat), "latency_p99_s": lat[int(0.99 * (len(lat) - 1))],
        "rss_mib": {"start": rss[0], "peak": max(rss), "end": rss[-1]} if rss else None,
        "abusive": seen, "idle_connections": n_idle,
    }
    print(f"{'with' if a.abuse else 'without'} abusive clients: {len(out)} requests from {a.clients} clients "
          f"in {wall:.1f} s: {res['requests_per_s']:.2f} requests/s, {res['completion_tokens_per_s']:.1f} "
          f"completion tokens/s, latency p50 {res['latency_p50_s']:.2f} s p99 {res['latency_p99_s']:.2f} s, "
          f"{len(errors)} errors")
    if rss:
        print(f"  server RSS: {rss[0]:.0f} MiB at the start, {max(rss):.0f} peak, {rss[-1]:.0f} at the end")
    for kind, what in sorted(seen.items()):
        print(f"  {kind}: " + ", ".join(f"{k} x{v}" for k, v in sorted(what.items())))
    if a.abuse:
        print(f"  {n_idle} idle connections held open")
    for e in errors[:5]:
        print("  error:", e)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if errors else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--pid", type=int, default=0, help="the server's pid, for its resident memory")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--abuse", action="store_true")
    p.add_argument("--abusers", type=int, default=6, help="abusive loops, each of one kind (6 kinds)")
    p.add_argument("--pace", type=float, default=0.5, help="seconds each abusive loop waits between requests")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json")
    raise SystemExit(asyncio.run(main(p.parse_args())))
