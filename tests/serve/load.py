"""A bounded load test on loopback: 64 clients x 4 requests, mixed prompt
lengths, streamed and not, a quarter of the streams dropped midway. Every
request not dropped completes, none is lost or answered twice, the
server's memory stays bounded and /metrics agrees with the clients."""
import asyncio
import os
import random
import sys
import time

from common import aclient, check, metrics, model_id, rss_kib

CLIENTS, PER_CLIENT = 64, 4
WORDS = ("the river runs past old stone mills where the town keeps its grain and "
         "its stories of floods and dry years alike").split()


async def one(c, model, rng, log):
    n_words = rng.choice([4, 12, 40, 100])
    prompt = " ".join(rng.choice(WORDS) for _ in range(n_words))
    kind = rng.random()
    if kind < 0.25:
        # dropped midway: read three chunks, then close the connection. The
        # end of text is ignored so that the server cannot finish the answer
        # first (it would then rightly count it completed).
        stream = await c.completions.create(model=model, prompt=prompt, max_tokens=200,
                                            temperature=0.8, seed=rng.randrange(1 << 30), stream=True,
                                            extra_body={"ignore_eos": True})
        got, finished, rid = 0, False, None
        async for ch in stream:
            rid = ch.id
            if ch.choices and ch.choices[0].finish_reason:
                finished = True
            got += 1
            if got == 3:
                break
        await stream.close()
        log.append(("completed" if finished else "cancelled", rid))
    elif kind < 0.6:
        stream = await c.completions.create(model=model, prompt=prompt, max_tokens=rng.randrange(1, 24),
                                            temperature=0.8, seed=rng.randrange(1 << 30), stream=True)
        finish, rid = None, None
        async for ch in stream:
            rid = ch.id
            if ch.choices and ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
        check(finish in ("stop", "length"), f"stream {rid} ended without a finish reason")
        log.append(("completed", rid))
    else:
        r = await c.chat.completions.create(model=model, max_tokens=rng.randrange(1, 24), temperature=0.8,
                                            seed=rng.randrange(1 << 30),
                                            messages=[{"role": "user", "content": prompt}])
        check(r.choices[0].finish_reason in ("stop", "length"), r)
        check(r.usage.completion_tokens <= 24, r.usage)
        log.append(("completed", r.id))


async def client(i, model, log):
    rng = random.Random(i)
    c = aclient(timeout=900)
    for _ in range(PER_CLIENT):
        await one(c, model, rng, log)


async def sample_rss(pid, peak, stop):
    while not stop.is_set():
        peak[0] = max(peak[0], rss_kib(pid))
        await asyncio.sleep(0.2)


async def main():
    pid = int(os.environ["STRATA_PID"])
    model = model_id()
    before = metrics()
    rss0 = rss_kib(pid)
    log, peak, stop = [], [rss0], asyncio.Event()
    sampler = asyncio.create_task(sample_rss(pid, peak, stop))
    t0 = time.time()
    await asyncio.gather(*(client(i, model, log) for i in range(CLIENTS)))
    took = time.time() - t0
    # the server notices dropped streams at its next step
    for _ in range(100):
        m = metrics()
        if m["strata_requests_active"] == 0 and m["strata_requests_queued"] == 0:
            break
        await asyncio.sleep(0.1)
    stop.set()
    await sampler
    after = metrics()
    d = {k: after[k] - before.get(k, 0) for k in after}
    done = [rid for what, rid in log if what == "completed"]
    dropped = [rid for what, rid in log if what == "cancelled"]
    print(f"{len(log)} requests in {took:.1f} s: {len(done)} completed, {len(dropped)} dropped midway; "
          f"{int(d['strata_generated_tokens_total'])} tokens generated, "
          f"RSS {rss0 // 1024} MiB before, peak {peak[0] // 1024} MiB")
    check(len(log) == CLIENTS * PER_CLIENT, f"{len(log)} answers for {CLIENTS * PER_CLIENT} requests")
    ids = [rid for _, rid in log]
    check(len(set(ids)) == len(ids), "an answer id came twice")
    check(d["strata_requests_completed_total"] == len(done),
          f"metrics completed {d['strata_requests_completed_total']} vs clients {len(done)}")
    check(d["strata_requests_cancelled_total"] == len(dropped),
          f"metrics cancelled {d['strata_requests_cancelled_total']} vs clients {len(dropped)}")
    check(d["strata_requests_failed_total"] == 0 and d["strata_requests_rejected_total"] == 0, d)
    check(peak[0] - rss0 < 256 * 1024, f"RSS grew by {(peak[0] - rss0) // 1024} MiB")
    print("ok")


asyncio.run(main())
