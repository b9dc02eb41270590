#!/usr/bin/env python3
"""Where one step's GPU time goes, kernel by kernel, from an Nsight Systems
profile exported to SQLite (`nsys export --type sqlite`) or from the lines
tools/device/cupti-trace.c writes (a .tsv).

The step is the last one of the run: device 0's kernels are cut into steps
at gaps of more than GAP_MS (a step's inputs are written with no kernel
running, 8-11 ms on the row split), and the last piece is kept. For each
device, over that window: its busy time (the union of its kernels), the
gaps between them, each kind of kernel's count and time, and the copies.

    python3 tools/device/kernel-sum.py PROFILE.sqlite|TRACE.tsv [GAP_MS]
"""
import sqlite3
import sys
from collections import defaultdict

# kernel name fragments, first match wins: the kinds a layer's graphs run
KINDS = [
    ("gemm (cuBLAS)", ("gemm", "xmma", "cutlass", "sm90_", "sm80_", "cublas", "nvjet")),
    ("mmq (ggml quantized)", ("mul_mat_q",)),
    ("mmvq / mmv", ("mul_mat_vec",)),
    ("dequantize / convert", ("dequantize", "convert_unary", "to_fp16", "to_bf16", "convert")),
    ("quantize activations", ("quantize_q8", "quantize_mmq")),
    ("flash attention", ("flash_attn",)),
    ("rms_norm", ("rms_norm",)),
    ("add / mul (binbcast)", ("bin_bcast", "k_bin")),
    ("copy / set_rows", ("cpy", "set_rows", "copy")),
    ("rope", ("rope",)),
    ("glu", ("glu", "swiglu", "geglu")),
    ("get_rows", ("get_rows",)),
]


def kind_of(name):
    n = name.lower()
    for k, frags in KINDS:
        if any(f in n for f in frags):
            return k
    return "other"


def union(intervals):
    busy, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


def read_sqlite(path):
    """Kernels (start, end, device, stream, name id), names, copies
    (start, end, device, kind, bytes)."""
    db = sqlite3.connect(path)
    names = dict(db.execute("SELECT id, value FROM StringIds"))
    rows = db.execute(
        "SELECT start, end, deviceId, streamId, shortName FROM CUPTI_ACTIVITY_KIND_KERNEL"
    ).fetchall()
    try:
        cp = db.execute(
            "SELECT start, end, deviceId, copyKind, bytes FROM CUPTI_ACTIVITY_KIND_MEMCPY"
        ).fetchall()
    except sqlite3.OperationalError:
        cp = []
    return rows, names, cp


def read_tsv(path):
    rows, names, ids, cp = [], {}, {}, []
    with open(path, errors="replace") as f:
        for line in f:
            p = line.rstrip("\n").split("\t")
            if p[0] == "K" and len(p) >= 6:
                i = ids.setdefault(p[5], len(ids))
                names[i] = p[5]
                rows.append((int(p[1]), int(p[2]), int(p[3]), int(p[4]), i))
            elif p[0] == "C" and len(p) >= 7:
                cp.append((int(p[1]), int(p[2]), int(p[3]), int(p[5]), int(p[6])))
    return rows, names, cp


def main():
    path = sys.argv[1]
    gap_ns = float(sys.argv[2] if len(sys.argv) > 2 else 3.0) * 1e6
    rows, names, cp = (read_sqlite if path.endswith(".sqlite") else read_tsv)(path)
    if not rows:
        print("no kernels in the profile")
        return
    devs = sorted({r[2] for r in rows})
    d0 = sorted(r for r in rows if r[2] == devs[0])
    # device 0's steps: cut at gaps over gap_ns; the last is the window
    cuts, prev_end = [0], d0[0][1]
    for i, r in enumerate(d0[1:], 1):
        if r[0] - prev_end > gap_ns:
            cuts.append(i)
        prev_end = max(prev_end, r[1])
    last = d0[cuts[-1]:]
    lo, hi = last[0][0], max(r[1] for r in last)
    print(f"devices {devs}; device {devs[0]}: {len(cuts)} pieces at gaps over {gap_ns / 1e6:.1f} ms; "
          f"the last: {len(last)} kernels over {(hi - lo) / 1e6:.2f} ms")
    for d in devs:
        ks = sorted(r for r in rows if r[2] == d and lo - 1e6 <= r[0] <= hi + 1e6)
        if not ks:
            continue
        busy = union([(r[0], r[1]) for r in ks])
        span = max(r[1] for r in ks) - ks[0][0]
        streams = defaultdict(int)
        for r in ks:
            streams[r[3]] += 1
        main_stream = max(streams, key=streams.get)
        ms = [r for r in ks if r[3] == main_stream]
        gaps = [b[0] - a[1] for a, b in zip(ms, ms[1:]) if b[0] > a[1]]
        big = [g for g in gaps if g > 20e3]
        print(f"\n== device {d}: {len(ks)} kernels, first to last {span / 1e6:.2f} ms, busy {busy / 1e6:.2f} ms; "
              f"stream {main_stream} ({len(ms)} kernels): gaps {sum(gaps) / 1e6:.2f} ms, "
              f"{len(big)} over 20 us ({sum(big) / 1e6:.2f} ms); streams {dict(streams)}")
        by_kind = defaultdict(lambda: [0, 0])
        by_name = defaultdict(lambda: [0, 0])
        for r in ks:
            n = names.get(r[4], str(r[4]))
            by_kind[kind_of(n)][0] += 1
            by_kind[kind_of(n)][1] += r[1] - r[0]
            by_name[n][0] += 1
            by_name[n][1] += r[1] - r[0]
        print("  by kind: count, ms")
        for k, (c, t) in sorted(by_kind.items(), key=lambda x: -x[1][1]):
            print(f"    {k:28s} {c:6d} {t / 1e6:9.2f}")
        print("  top kernels: count, ms, mean us")
        for n, (c, t) in sorted(by_name.items(), key=lambda x: -x[1][1])[:18]:
            print(f"    {n[:60]:60s} {c:6d} {t / 1e6:9.2f} {t / c / 1e3:8.1f}")
    tot = defaultdict(lambda: [0, 0, 0])
    for s, e, d, k, b in cp:
        if lo - 1e6 <= s <= hi + 1e6:
            t = tot[(d, k)]
            t[0] += 1
            t[1] += e - s
            t[2] += b
    print("\n== copies in the window (device, copyKind: 1 H2D, 2 D2H, 8 D2D, 10 P2P): count, ms, MiB")
    for (d, k), (c, t, b) in sorted(tot.items()):
        print(f"    device {d} kind {k}: {c:6d} {t / 1e6:9.2f} {b / 2**20:10.1f}")


if __name__ == "__main__":
    main()
