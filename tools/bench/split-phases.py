#!/usr/bin/env python3
"""The expert split's layer chain in a strata trace (`strata bench --trace`
with `--expert-split K`, as tools/device/split-host.sh takes them): per split
layer, medians over the last STEPS whole steps of the router round trip (the
host queuing the router to its picks read), the host part and its phases
(rows in, experts, rows out, then the host's rows up queued), the GPU's
experts and the add of the host's rows, and the waits between them: the
GPU's router ending to the host part starting, the host part ending to the
next GPU operation (the add), the add's end to the next. Also each step's length and the copy stream's busy
time.
  tools/bench/split-phases.py TRACE.json[.xz] [STEPS]"""
import json
import lzma
import re
import statistics as st
import sys


def main():
    path = sys.argv[1]
    n_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        d = json.load(f)
    evs = d["traceEvents"] if isinstance(d, dict) else d
    track = {(e["pid"], e["tid"]): e["args"]["name"] for e in evs
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans = [e for e in evs if e.get("ph") == "X"]
    steps = sorted((e for e in spans if e["name"].startswith("inputs")), key=lambda e: e["ts"])
    if len(steps) < 2:
        sys.exit("fewer than two steps in the trace")
    keep = steps[-(n_steps + 1):]
    got = {}

    def add(k, v):
        got.setdefault(k, []).append(v / 1000)

    for a, b in zip(keep, keep[1:]):
        t0, t1 = a["ts"], b["ts"]
        es = sorted((e for e in spans if t0 <= e["ts"] < t1), key=lambda e: e["ts"])
        on = lambda e, name: track.get((e["pid"], e["tid"])) == name
        copy = sum(e["dur"] for e in es if on(e, "copy stream"))
        print(f"step at {t0 / 1000:.1f} ms: {(t1 - t0) / 1000:.1f} ms, copy stream busy {copy / 1000:.1f} ms")
        compute = [e for e in es if on(e, "compute stream")]
        router_end = {}
        for e in es:
            n = e["name"]
            m = re.match(r"router (\d+)$", n)
            if m and on(e, "compute stream"):
                router_end[int(m.group(1))] = e["ts"] + e["dur"]
            elif re.match(r"router \d+: ", n):
                add("router round trip", e["dur"])
            elif re.match(r"ffn \d+: (rows in|experts|rows out|rows up queued)$", n):
                add(n.split(": ")[1], e["dur"])
            elif n.startswith("host rows up") and on(e, "compute stream"):
                add("whole group's rows up (GPU)", e["dur"])
            elif re.match(r"ffn \d+: host rows added$", n) and on(e, "compute stream"):
                add("host rows added (GPU)", e["dur"])
            elif re.match(r"ffn \d+ \(\d+ experts\)$", n) and on(e, "compute stream"):
                add("GPU's experts", e["dur"])
            m = re.match(r"ffn (\d+) \(the other experts", n)
            if m and on(e, "host CPU"):
                add("host part", e["dur"])
                layer = int(m.group(1))
                if layer in router_end:
                    add("router end to host part", e["ts"] - router_end[layer])
                end = e["ts"] + e["dur"]
                nxt = [c for c in compute if c["ts"] >= end]
                if nxt:
                    add("host part end to next GPU op", nxt[0]["ts"] - end)
                    if nxt[0]["name"].endswith("host rows added"):
                        add("rows added end to next GPU op", nxt[1]["ts"] - nxt[0]["ts"] - nxt[0]["dur"]
                            if len(nxt) > 1 else 0)
    for k, v in got.items():
        print(f"{k:30s} {len(v):4d} spans, median {st.median(v):.3f} ms, sum a step {sum(v) / n_steps:.1f} ms")


if __name__ == "__main__":
    main()
