"""The openai client reads strata's logprobs: chat (content entries with
top_logprobs) and completions (tokens, token_logprobs, top_logprobs,
text_offset), whole and streamed."""
import math

from common import client

c = client()
msgs = [{"role": "user", "content": "Name a fruit."}]

r = c.chat.completions.create(
    model=c.models.list().data[0].id,
    messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
)
content = r.choices[0].logprobs.content
assert content, r
for e in content:
    assert isinstance(e.token, str) and e.logprob <= 0 and isinstance(e.bytes, list), e
    assert len(e.top_logprobs) == 3, e
    assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob, e
assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in content) == r.choices[0].message.content

streamed = []
for chunk in c.chat.completions.create(
    model=r.model, messages=msgs, max_tokens=8, temperature=0, logprobs=True,
    top_logprobs=3, stream=True,
):
    if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
        streamed.extend(chunk.choices[0].logprobs.content)
assert [e.token for e in streamed] == [e.token for e in content]
assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(streamed, content))

r = c.completions.create(model=r.model, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
lp = r.choices[0].logprobs
assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0, lp
assert "".join(lp.tokens) == r.choices[0].text
assert all(t in d and d[t] == l for t, l, d in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)), lp

r = c.chat.completions.create(model=r.model, messages=msgs, max_tokens=2, temperature=0)
assert r.choices[0].logprobs is None
print("ok")
