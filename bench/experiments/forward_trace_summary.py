#!/usr/bin/env python3
"""Summary of forward timelines written by a build with forward_trace.patch (see
forward_trace.sh): per trace file, the kernel's span, the CTAs' tasks and block changes, and
the medians (p90) over all tasks of the gaps between a task's recorded points, in µs.

    python3 bench/experiments/forward_trace_summary.py OUT/trace_*.bin

File: four int32 (magic 0x4d534654, CTAs, events a CTA, source kind), then per CTA
`events` records of four uint32 (task, event, time low, time high); the producer's events
fill the first half of a CTA's records, the consumers' the second; unused records are zero.
"""
import struct
import sys

import numpy as np

EVENTS = {1: "staged", 2: "block_staged", 3: "task_ready", 4: "block_in", 5: "softmax", 6: "values",
          7: "pv_done", 8: "stored"}
# The consumers are pipelined: during task n they wait for task n + 1's Q stage (before P V of
# n completes) and issue its S. In time order a task's points are: S start (the later of the
# previous task's `stored` and this task's `block_in`), softmax, values, the next task's
# task_ready, pv_done, stored, and at a block change the next task's block_in.
GAPS = ["Q loads issued -> stage full (producer lead)",
        "S start -> S waited + softmax done",
        "softmax -> V ready",
        "V ready -> next task's stage full",
        "next stage full -> P V done",
        "P V done -> partial stored",
        "stored -> next block entered (block changes)"]


def task_gaps(ev, n):
    """(label index, µs) pairs of task n from its events {(name, task): µs}."""
    g = lambda a, b: (b - a) if a is not None and b is not None else None  # noqa: E731
    at = lambda e, k: ev.get((e, k))  # noqa: E731
    starts = [x for x in (at("stored", n - 1), at("block_in", n)) if x is not None]
    start = max(starts) if starts else None
    out = [g(at("staged", n), at("task_ready", n)), g(start, at("softmax", n)), g(at("softmax", n), at("values", n)),
           g(at("values", n), at("task_ready", n + 1)), g(at("task_ready", n + 1), at("pv_done", n)),
           g(at("pv_done", n), at("stored", n)), g(at("stored", n), at("block_in", n + 1))]
    return [(i, v) for i, v in enumerate(out) if v is not None]


def load(path):
    raw = open(path, "rb").read()
    magic, ctas, cap, kind = struct.unpack_from("<4i", raw, 0)
    if magic != 0x4D534654:
        raise SystemExit(f"{path}: not a forward trace")
    rec = np.frombuffer(raw, dtype="<u4", offset=16).reshape(ctas, cap, 4)
    return ctas, cap, kind, rec


def summarize(path):
    ctas, cap, kind, rec = load(path)
    t = rec[:, :, 2].astype(np.int64) | (rec[:, :, 3].astype(np.int64) << 32)
    used = t > 0
    if not used.any():
        print(f"{path}: no events")
        return
    t0 = t[used].min()
    gaps = [[] for _ in GAPS]
    tasks = blocks = 0
    spans = []
    for c in range(ctas):
        ev = {}  # (event name, task) -> µs
        for i in np.nonzero(used[c])[0]:
            ev[(EVENTS.get(int(rec[c, i, 1]), "?"), int(rec[c, i, 0]))] = (t[c, i] - t0) / 1e3
        ready = sorted(n for (e, n) in ev if e == "task_ready")
        if not ready:
            continue
        tasks += len(ready)
        blocks += sum(1 for (e, _) in ev if e == "block_in")
        times = [v for v in ev.values()]
        spans.append((min(times), max(times)))
        for n in ready:
            for i, v in task_gaps(ev, n):
                gaps[i].append(v)
    start = min(s for s, _ in spans)
    end = max(e for _, e in spans)
    busy = np.array([e - s for s, e in spans])
    print(f"== {path}: source kind {kind}, {len(spans)} CTAs with tasks, {tasks} tasks "
          f"({tasks / max(1, len(spans)):.1f} a CTA), {blocks} block changes; kernel span "
          f"{end - start:.1f} µs, CTA busy median {np.median(busy):.1f} / max {busy.max():.1f} µs")
    print(f"{'gap':46s} {'count':>7s} {'median':>8s} {'p90':>8s}")
    for label, v in zip(GAPS, gaps):
        v = np.array(v)
        if v.size:
            print(f"{label:46s} {v.size:7d} {np.median(v):8.2f} {np.percentile(v, 90):8.2f}")


def main(paths):
    if not paths:
        raise SystemExit(__doc__)
    for p in paths:
        summarize(p)


if __name__ == "__main__":
    main(sys.argv[1:])
