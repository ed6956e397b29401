#!/usr/bin/env python3
"""The table of prefill_ab.sh: per case and cache format, each build's attention time (the
better of its rounds) and its ratio to the first build's; the step time of the first and last
builds.

    python bench/experiments/prefill_ab_compare.py OUT base new [more builds]
"""
import sys

from ab_table import collect, print_table


def shape(r):
    queries = "+".join(str(q) for q in r["query_lens"])
    prefixes = "+".join(f"{p // 1000}k" for p in r["prefix_lens"])
    return f"{queries} / {prefixes}"


def main(out, names):
    rows, order = collect(out, names, lambda r: (shape(r), r["cache"]),
                          lambda r: (r["attention"]["ms"], r["step"]["ms"]))
    print_table(rows, order, names, ["case", "cache"], list, "ms", 3)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
