"""The openai package against strata serve: chat and text completions,
streamed and not, usage, stop strings, and its error classes for bad input."""
import openai

from common import check, client, model_id

c = client(timeout=300)
model = model_id()

r = c.chat.completions.create(model=model, temperature=0, max_tokens=12, seed=1,
                              messages=[{"role": "user", "content": "Name a colour."}])
text = r.choices[0].message.content
check(r.object == "chat.completion" and r.choices[0].message.role == "assistant", r)
check(len(text) > 0 and r.choices[0].finish_reason in ("stop", "length"), r)
check(r.usage.completion_tokens <= 12 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r.usage)

# streamed, the same request gives the same text, in pieces
pieces, finish, usage = [], None, None
for ch in c.chat.completions.create(model=model, temperature=0, max_tokens=12, seed=1, stream=True,
                                    stream_options={"include_usage": True},
                                    messages=[{"role": "user", "content": "Name a colour."}]):
    if ch.usage:
        usage = ch.usage
    for choice in ch.choices:
        pieces.append(choice.delta.content or "")
        finish = choice.finish_reason or finish
check("".join(pieces) == text, f"streamed {''.join(pieces)!r} vs {text!r}")
check(finish == r.choices[0].finish_reason and usage.completion_tokens == r.usage.completion_tokens, (finish, usage))

# text completions, a stop string, sampling with a seed is reproducible
r = c.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 7"])
check(r.object == "text_completion" and " 7" not in r.choices[0].text and r.choices[0].finish_reason == "stop", r)
check(r.choices[0].text.startswith(" 5, 6,"), r.choices[0].text)
a = c.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=42,
                         frequency_penalty=0.5, presence_penalty=0.5)
b = c.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=42,
                         frequency_penalty=0.5, presence_penalty=0.5)
check(a.choices[0].text == b.choices[0].text, (a.choices[0].text, b.choices[0].text))
streamed = "".join(ch.choices[0].text for ch in c.completions.create(
    model=model, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=42,
    frequency_penalty=0.5, presence_penalty=0.5, stream=True) if ch.choices)
check(streamed == a.choices[0].text, (streamed, a.choices[0].text))

# errors come back as the client's exception classes
for kw, cls in [({"max_tokens": -1}, openai.BadRequestError),
                ({"max_tokens": 10**9}, openai.BadRequestError),
                ({"top_p": 5}, openai.BadRequestError),
                ({"model": "no-such-model"}, openai.NotFoundError)]:
    args = {"model": model, "messages": [{"role": "user", "content": "hi"}], **kw}
    try:
        c.chat.completions.create(**args)
        check(False, f"{kw} was accepted")
    except cls as e:
        check(e.status_code in (400, 404) and e.body is not None, e)
try:
    c.chat.completions.create(model=model, messages=[])
    check(False, "empty messages accepted")
except openai.BadRequestError:
    pass
print("ok")
