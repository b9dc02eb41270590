"""At temperature 0, each of 16 concurrent requests answers exactly what it
answers alone; a system prompt they share is computed once."""
import asyncio

from common import aclient, check, metrics, model_id

SYSTEM = ("You are a careful assistant for a software team. Answer in one or two "
          "sentences, name concrete tools where they help, and never invent facts. "
          "If a question is ambiguous, say which reading you answer.")
QUESTIONS = [
    "What is a unit test?", "Why use version control?", "What does a linker do?",
    "What is a race condition?", "Explain a hash map.", "What is recursion?",
    "Why are pure functions easy to test?", "What is a memory leak?",
    "What does a compiler optimise?", "What is an API?", "Why write documentation?",
    "What is a deadlock?", "What is big-O notation?", "What is a cache?",
    "Why profile before optimising?", "What is continuous integration?",
]


async def ask(c, model, q, max_tokens=24):
    r = await c.chat.completions.create(
        model=model, temperature=0, max_tokens=max_tokens,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
    return r.choices[0].message.content, r.usage


async def main():
    model = model_id()
    c = aclient(timeout=600)
    alone = []
    for q in QUESTIONS:
        alone.append((await ask(c, model, q))[0])
    before = metrics()
    together = await asyncio.gather(*(ask(c, model, q) for q in QUESTIONS))
    after = metrics()
    for q, a, (t, _) in zip(QUESTIONS, alone, together):
        check(a == t, f"{q!r}: alone {a!r} but together {t!r}")
    hits = after["strata_prefix_cache_hits_total"] - before["strata_prefix_cache_hits_total"]
    cached = after["strata_prefix_cache_tokens_total"] - before["strata_prefix_cache_tokens_total"]
    prompt = after["strata_prompt_tokens_total"] - before["strata_prompt_tokens_total"]
    computed = after["strata_step_tokens_total"] - before["strata_step_tokens_total"]
    gen = after["strata_generated_tokens_total"] - before["strata_generated_tokens_total"]
    usage_cached = sum(u.prompt_tokens_details.cached_tokens for _, u in together)
    print(f"16 concurrent: {int(hits)} prefix hits, {int(cached)} of {int(prompt)} prompt tokens "
          f"from the cache, {int(computed)} tokens computed for {int(gen)} generated")
    check(hits == 16, f"every request reuses the system prompt (a cached one from the runs alone): {hits}")
    check(usage_cached == cached, f"usage reports the cached tokens: {usage_cached} vs {cached}")
    # the prompt part every request computes is only what follows the system prompt
    check(computed - gen + 16 < prompt - cached + 16 * 2, f"computed {computed}, prompt {prompt}, cached {cached}")
    # on a fresh shared prefix: 16 new requests with a new system prompt compute it once
    sys2 = SYSTEM.replace("software team", "hardware team")
    before = metrics()
    r = await asyncio.gather(*(c.chat.completions.create(
        model=model, temperature=0, max_tokens=4,
        messages=[{"role": "system", "content": sys2}, {"role": "user", "content": q}]) for q in QUESTIONS))
    after = metrics()
    hits = after["strata_prefix_cache_hits_total"] - before["strata_prefix_cache_hits_total"]
    computed = after["strata_step_tokens_total"] - before["strata_step_tokens_total"]
    prompt = after["strata_prompt_tokens_total"] - before["strata_prompt_tokens_total"]
    print(f"16 concurrent, new system prompt: {int(hits)} hits, {int(computed)} tokens computed "
          f"for {int(prompt)} prompt tokens")
    check(hits == 16, f"all reuse a prefix: {hits}")
    check(computed < prompt / 2, f"the shared prompt was computed once: {computed} of {prompt}")
    print("ok")


if __name__ == "__main__":
    asyncio.run(main())
