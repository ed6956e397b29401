#!/usr/bin/env python3
"""The table of training_ab.sh: per size and op, each build's time (the better of its rounds)
and its ratio to the first build's.

    python bench/experiments/training_ab_compare.py OUT base new [more builds]
"""
import collections
import glob
import json
import os
import sys

OPS = ["indexer", "indexer_fp8", "forward", "backward", "backward_deterministic", "kl"]


def collect(out, names):
    """times[(tokens, op)][name] = [ms per round] from OUT/ab_<name>_<round>.json."""
    times = collections.defaultdict(lambda: collections.defaultdict(list))
    for name in names:
        for path in sorted(glob.glob(os.path.join(out, f"ab_{name}_[0-9]*.json"))):
            for r in json.load(open(path))["results"]:
                for op in OPS:
                    if op in r:
                        times[(r["tokens"], op)][name].append(r[op]["ms"])
    return times


def main(out, names):
    times = collect(out, names)
    first = names[0]
    head = ["tokens", "op"] + [f"{n} ms" for n in names] + [f"{n} / {first}" for n in names[1:]]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for key in sorted(times, key=lambda k: (k[0], OPS.index(k[1]))):
        got = times[key]
        if not all(n in got for n in names):
            continue
        best = {n: min(got[n]) for n in names}
        cells = [str(key[0]), key[1]] + [f"{best[n]:.3f}" for n in names]
        cells += [f"{best[n] / best[first]:.3f}" for n in names[1:]]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
