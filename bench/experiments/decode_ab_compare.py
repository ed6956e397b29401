#!/usr/bin/env python3
"""The table of decode_ab.sh: per shape, each build's attention time (the better of its
rounds) and its ratio to the first build's; the step time of the first and last builds.

    python bench/experiments/decode_ab_compare.py OUT base new [more builds]
"""
import sys

from ab_table import collect, print_table


def main(out, names):
    rows, _ = collect(out, names,
                      lambda r: (r["cache"], r["batch"], r["context"], r["queries_per_request"], r["selection"]),
                      lambda r: (r["attention"]["us"], r["step"]["us"]))
    print_table(rows, sorted(rows), names, ["format", "B", "ctx", "Q", "selection"],
                lambda k: [k[0], str(k[1]), f"{k[2] // 1024}k", str(k[3]), k[4]], "µs", 1)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
