"""Summary of a decode step's timeline written by a build with decode_trace.patch
(`MSA_DECODE_TRACE=PREFIX msa bench --decode ...` writes PREFIX.graph after each shape: the
global-timer stamps of the last CUDA-graph replay). Prints, per event, over the CTAs that
recorded it: how many, and the min / median / max time in µs from the first score CTA's start.

    python bench/experiments/decode_trace_summary.py PREFIX.graph
"""
import struct
import sys

SCORE, SELECT, MERGE, ATTN = 0, 4096, 4096 + 2048, 8192
ATTN_CTAS = 4096
EVENTS = {0: "entry", 1: "after grid-dependency wait", 2: "page list built", 3: "producer: all loads issued",
          4: "consumer 0: query ready", 13: "consumer 0: page loop done", 14: "partial / state stored",
          15: "CTA done (merge included)"}


def main():
    data = open(sys.argv[1], "rb").read()
    v = struct.unpack(f"<{len(data) // 8}Q", data)
    score = [(v[SCORE + 2 * i], v[SCORE + 2 * i + 1]) for i in range(2048) if v[SCORE + 2 * i]]
    select = [(v[SELECT + 2 * i], v[SELECT + 2 * i + 1]) for i in range(1024) if v[SELECT + 2 * i]]
    merge = [(v[MERGE + 2 * i], v[MERGE + 2 * i + 1]) for i in range(1024) if v[MERGE + 2 * i]]
    ctas = [v[ATTN + 32 * c: ATTN + 32 * c + 32] for c in range(ATTN_CTAS) if v[ATTN + 32 * c]]
    starts = [s for s, _ in score] or [c[0] for c in ctas]
    t0 = min(starts)

    def line(label, times):
        times = sorted((t - t0) / 1e3 for t in times if t)
        if not times:
            return
        print(f"  {label:38s} n={len(times):4d}  min {times[0]:7.2f}  med {times[len(times) // 2]:7.2f}  max {times[-1]:7.2f}")

    print("score kernel:")
    line("CTA start", [s for s, _ in score])
    line("CTA end", [e for _, e in score])
    print("select kernel:")
    line("after grid-dependency wait", [s for s, _ in select])
    line("end", [e for _, e in select])
    print(f"attention: {len(ctas)} CTAs, pages a CTA: {sorted(set(int(c[16]) for c in ctas))}")
    for e in (0, 1, 2, 4, 3):
        line(EVENTS[e], [c[e] for c in ctas])
    for u in range(8):
        line(f"page {u} landed", [c[5 + u] for c in ctas])
        line(f"page {u} computed", [c[17 + u] for c in ctas])
    for e in (13, 14, 15):
        line(EVENTS[e], [c[e] for c in ctas])
    last = [c for c in ctas if c[25] == 1]
    if last:
        line("last split CTA: merged", [c[15] for c in last])
    if merge:
        print("merge kernel:")
        line("CTA start", [s for s, _ in merge])
        line("CTA end", [e for _, e in merge])
    ends = [e for _, e in merge] or [c[15] for c in ctas]
    print(f"step: first score start to last end {(max(ends) - t0) / 1e3:.2f} us")


if __name__ == "__main__":
    main()
