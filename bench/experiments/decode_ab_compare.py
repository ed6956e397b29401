#!/usr/bin/env python3
"""The table of decode_ab.sh: per shape, each build's attention time (the better of its
rounds) and its ratio to the first build's; the step time of the first and last builds.

    python bench/experiments/decode_ab_compare.py OUT base new [more builds]
"""
import collections
import glob
import json
import os
import sys


def main(out, names):
    rows = collections.defaultdict(lambda: collections.defaultdict(list))
    for name in names:
        for path in glob.glob(os.path.join(out, f"ab_{name}_[0-9]*.json")):
            for r in json.load(open(path))["results"]:
                key = (r["cache"], r["batch"], r["context"], r["queries_per_request"], r["selection"])
                rows[key][name].append((r["attention"]["us"], r["step"]["us"]))
    first, last = names[0], names[-1]
    head = ["format", "B", "ctx", "Q", "selection"] + [f"{n} µs" for n in names] + [f"{n} / {first}" for n in names[1:]]
    head += [f"step {first}", f"step {last}"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for key in sorted(rows):
        got = rows[key]
        if not all(n in got for n in names):
            continue
        best = {n: min(a for a, _ in got[n]) for n in names}
        step = {n: min(s for _, s in got[n]) for n in names}
        cells = [key[0], str(key[1]), f"{key[2] // 1024}k", str(key[3]), key[4]]
        cells += [f"{best[n]:.1f}" for n in names] + [f"{best[n] / best[first]:.3f}" for n in names[1:]]
        cells += [f"{step[first]:.1f}", f"{step[last]:.1f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
