"""Helpers shared by the server tests: the client, metrics, the server's RSS."""
import os
import re
import sys
import urllib.request

import openai

BASE = os.environ["STRATA_URL"]  # e.g. http://127.0.0.1:18080


def client(**kw):
    return openai.OpenAI(base_url=BASE + "/v1", api_key="none", max_retries=0, **kw)


def aclient(**kw):
    return openai.AsyncOpenAI(base_url=BASE + "/v1", api_key="none", max_retries=0, **kw)


def metrics():
    text = urllib.request.urlopen(BASE + "/metrics").read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name, value = line.rsplit(" ", 1)
        out[name] = float(value)
    return out


def model_id():
    return client().models.list().data[0].id


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        m = re.search(r"VmRSS:\s+(\d+)", f.read())
    return int(m.group(1))


def check(cond, msg):
    if not cond:
        print("FAIL:", msg, file=sys.stderr)
        sys.exit(1)
