"""The markdown table of the A/B scripts (decode_ab.sh, prefill_ab.sh): per key, each build's
attention time (the better of its rounds), its ratio to the first build's, and the step time
of the first and last builds."""
import collections
import glob
import json
import os


def collect(out, names, key_of, times_of):
    """rows[key][name] = [(attention, step) per round] from OUT/ab_<name>_<round>*.json, keys in
    the order first met."""
    rows = collections.defaultdict(lambda: collections.defaultdict(list))
    order = []
    for name in names:
        for path in sorted(glob.glob(os.path.join(out, f"ab_{name}_[0-9]*.json"))):
            for r in json.load(open(path))["results"]:
                key = key_of(r)
                if key not in rows:
                    order.append(key)
                rows[key][name].append(times_of(r))
    return rows, order


def print_table(rows, keys, names, key_head, key_cells, unit, digits):
    first, last = names[0], names[-1]
    head = key_head + [f"{n} {unit}" for n in names] + [f"{n} / {first}" for n in names[1:]]
    head += [f"step {first}", f"step {last}"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for key in keys:
        got = rows[key]
        if not all(n in got for n in names):
            continue
        best = {n: min(a for a, _ in got[n]) for n in names}
        step = {n: min(s for _, s in got[n]) for n in names}
        cells = key_cells(key) + [f"{best[n]:.{digits}f}" for n in names]
        cells += [f"{best[n] / best[first]:.3f}" for n in names[1:]]
        cells += [f"{step[first]:.{digits}f}", f"{step[last]:.{digits}f}"]
        print("| " + " | ".join(cells) + " |")
