#!/usr/bin/env python3
"""Draws a strata bench trace (Chrome trace JSON) as an SVG timeline:
one lane per stream (copy, compute; the draft model and the host CPU
computing layer groups (hybrid decode) when the trace has them; a set per
device for a model split across devices), one box per operation.

    tools/bench/trace-to-svg.py TRACE.json OUT.svg [--steps N] [--skip K]

--skip K drops the first K steps (warm-up); --steps N keeps N steps after
that (a step starts at an "attn 0" computation). Standard library only."""
import argparse
import json

COLORS = {"upload": "#e4572e", "picked": "#b5179e", "kv": "#f6ae2d", "attn": "#17bebb", "ffn": "#2e86ab", "router": "#3a0ca3", "draft": "#8e44ad", "head": "#a0a0a0"}


def kind(name):
    for k in COLORS:
        if name.startswith(k):
            return k
    return "head"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--skip", type=int, default=1)
    a = ap.parse_args()
    all_ev = json.load(open(a.trace))["traceEvents"]
    # process 1: the streams (four tracks a device); process 2, a step's
    # host work (inputs), is not drawn
    all_ev = [e for e in all_ev if e.get("pid", 1) == 1]
    meta = {e["tid"]: e["args"]["name"] for e in all_ev if e.get("ph") == "M"}
    ev = [e for e in all_ev if e.get("ph") == "X"]
    ev.sort(key=lambda e: e["ts"])
    starts = [e["ts"] for e in ev if e["name"] == "attn 0" and e["tid"] == 2]
    if len(starts) > a.skip:
        t0 = starts[a.skip]
        t1 = starts[a.skip + a.steps] if len(starts) > a.skip + a.steps else max(e["ts"] + e["dur"] for e in ev)
        # copies for a step start before its first computation
        first_copy = min((e["ts"] for e in ev if e["tid"] == 1 and e["ts"] + e["dur"] >= t0), default=t0)
        t0 = min(t0, first_copy)
        # a draft model proposes before the step that verifies its tokens
        prev = starts[a.skip - 1] if a.skip > 0 else float("-inf")
        t0 = min([t0] + [e["ts"] for e in ev if e["tid"] == 3 and prev <= e["ts"] < t0])
        ev = [e for e in ev if e["ts"] + e["dur"] > t0 and e["ts"] < t1]
    else:
        t0, t1 = ev[0]["ts"], max(e["ts"] + e["dur"] for e in ev)
    span = max(t1 - t0, 1.0)
    names = {1: "copy", 2: "compute", 3: "draft", 4: "host CPU"}
    n_dev = max((e["tid"] - 1) // 4 + 1 for e in ev)
    if n_dev > 1:
        # "device 1 copy stream" -> "GPU 1 copy"
        names = {t: meta.get(t, f"track {t}").replace("device ", "GPU ").replace(" stream", "")
                 for t in range(1, 4 * n_dev + 1)}
    tids = [t for t in sorted(names) if (t - 1) % 4 < 2 or any(e["tid"] == t for e in ev)]
    lanes = [names[t] for t in tids]
    row = {t: i for i, t in enumerate(tids)}
    W, lane, top, left = 1400, 46, 40, 130 if n_dev > 1 else 90
    x = lambda t: left + (t - t0) / span * (W - left - 20)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{top + len(lanes) * lane + 70}" font-family="sans-serif" font-size="12">',
           f'<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{left}" y="20">strata: {"one streamed step" if a.steps == 1 else str(a.steps) + " streamed steps"}, {span / 1000:.1f} ms ({", ".join(lanes)})</text>']
    for i, name in enumerate(lanes):
        y = top + i * lane
        out.append(f'<text x="10" y="{y + lane / 2 + 4}">{name}</text>')
        out.append(f'<line x1="{left}" x2="{W - 20}" y1="{y + lane - 4}" y2="{y + lane - 4}" stroke="#ddd"/>')
    busy = {t: 0.0 for t in names}
    for e in ev:
        s, d = max(e["ts"], t0), min(e["ts"] + e["dur"], t1) - max(e["ts"], t0)
        if d <= 0:
            continue
        busy[e["tid"]] += d
        y = top + row[e["tid"]] * lane
        out.append(f'<rect x="{x(s):.2f}" y="{y + 6}" width="{max(d / span * (W - left - 20), 0.5):.2f}" height="{lane - 14}" '
                   f'fill="{COLORS[kind(e["name"])]}"><title>{e["name"]} {e["dur"] / 1000:.3f} ms</title></rect>')
    ty = top + len(lanes) * lane + 20
    for k in range(11):
        t = t0 + span * k / 10
        out.append(f'<text x="{x(t):.1f}" y="{ty}" text-anchor="middle">{(t - t0) / 1000:.0f}</text>')
    out.append(f'<text x="{W - 20}" y="{ty + 18}" text-anchor="end">ms</text>')
    lx = left
    for k, c in COLORS.items():
        out.append(f'<rect x="{lx}" y="{ty + 28}" width="12" height="12" fill="{c}"/><text x="{lx + 16}" y="{ty + 38}">{k}</text>')
        lx += 90
    out.append(f'<text x="{lx + 20}" y="{ty + 38}">busy: ' + ", ".join(f"{names[t]} {busy[t] / span * 100:.0f}%" for t in tids) + '</text>')
    out.append("</svg>")
    open(a.out, "w").write("\n".join(out))


if __name__ == "__main__":
    main()
