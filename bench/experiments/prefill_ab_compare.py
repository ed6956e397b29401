#!/usr/bin/env python3
"""The table of prefill_ab.sh: per case and cache format, each build's attention time (the
better of its rounds) and its ratio to the first build's; the step time of the first and last
builds.

    python bench/experiments/prefill_ab_compare.py OUT base new [more builds]
"""
import collections
import glob
import json
import os
import sys


def shape(r):
    queries = "+".join(str(q) for q in r["query_lens"])
    prefixes = "+".join(f"{p // 1000}k" for p in r["prefix_lens"])
    return f"{queries} / {prefixes}"


def main(out, names):
    rows = collections.defaultdict(lambda: collections.defaultdict(list))
    order = []
    for name in names:
        for path in sorted(glob.glob(os.path.join(out, f"ab_{name}_[0-9]_*.json"))):
            for r in json.load(open(path))["results"]:
                key = (shape(r), r["cache"])
                if key not in rows:
                    order.append(key)
                rows[key][name].append((r["attention"]["ms"], r["step"]["ms"]))
    first, last = names[0], names[-1]
    head = ["case", "cache"] + [f"{n} ms" for n in names] + [f"{n} / {first}" for n in names[1:]]
    head += [f"step {first}", f"step {last}"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for key in order:
        got = rows[key]
        if not all(n in got for n in names):
            continue
        best = {n: min(a for a, _ in got[n]) for n in names}
        step = {n: min(s for _, s in got[n]) for n in names}
        cells = list(key) + [f"{best[n]:.3f}" for n in names] + [f"{best[n] / best[first]:.3f}" for n in names[1:]]
        cells += [f"{step[first]:.3f}", f"{step[last]:.3f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
