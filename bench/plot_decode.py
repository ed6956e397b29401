"""Chart of one or more `msa bench --decode --json` reports: for every decode shape (batch x
context, queries per request Q, cache format) the share of the card's measured copy bandwidth
that the indexer, the attention and the whole step reach (the report's percent_of_copy), and
the step replayed as a CUDA graph where the report has it.

  python bench/plot_decode.py decode.json [more.json ...] --out decode.png [--title TEXT]

Needs matplotlib. Reports of several runs are drawn side by side in the order given (their
shapes are labelled with the file's stem when more than one file is given)."""

import argparse
import json
import os
import sys

PARTS = ("indexer", "attention", "step")
GRAPH_PART = "step_graph"  # GPU reports: the step replayed as a CUDA graph
LABELS = {"step_graph": "step (CUDA graph)"}


def _context_label(tokens):
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def read_rows(path):
    """[(label, {part: percent of copy})] of one report, in its order; SystemExit naming the file
    and what is wrong when it is not a decode report."""
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        if report.get("bench") != "decode":
            raise ValueError(f"its 'bench' is {report.get('bench')!r}, not 'decode'")
        rows = []
        for r in report["results"]:
            label = (f"{r['batch']} x {_context_label(r['context'])}, Q {r['queries_per_request']}, "
                     f"{r['cache']}")
            if r.get("selection") == "coherent":  # reports before the field had independent rows only
                label += ", coherent"
            parts = {part: float(r[part]["percent_of_copy"]) for part in PARTS}
            if GRAPH_PART in r:
                parts[GRAPH_PART] = float(r[GRAPH_PART]["percent_of_copy"])
            rows.append((label, parts))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"plot_decode.py: {path}: not a report of msa bench --decode --json ({e})") from None
    if not rows:
        raise SystemExit(f"plot_decode.py: {path}: the report has no results")
    return rows


def draw(groups, out, title):
    """groups: [(label, {part: percent})]; one row of three bars per group (four when a report
    has the CUDA-graph step; groups without it get no bar there)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = PARTS + ((GRAPH_PART,) if any(GRAPH_PART in g[1] for g in groups) else ())
    height = 0.8 / len(parts)
    fig, ax = plt.subplots(figsize=(8.0, max(3.0, 0.55 * len(groups) + 1.5)))
    for i, part in enumerate(parts):
        ys = [j + (i - (len(parts) - 1) / 2) * height for j in range(len(groups))]
        ax.barh(ys, [g[1].get(part, 0.0) for g in groups], height, label=LABELS.get(part, part))
    ax.axvline(100.0, color="black", linewidth=0.8)
    ax.set_xlim(0, 105)
    ax.set_xlabel("% of the card's measured copy bandwidth (bytes the step must move / time)")
    ax.set_yticks(range(len(groups)))
    ax.set_yticklabels([g[0] for g in groups], fontsize=8)
    ax.set_ylim(len(groups) - 0.5, -0.5)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="plot_decode.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", metavar="JSON", help="msa bench --decode --json reports")
    parser.add_argument("--out", required=True, metavar="PNG")
    parser.add_argument("--title", default="msa decode step: share of the copy bandwidth")
    args = parser.parse_args(argv)
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        parser.error(f"--out: the folder {folder} does not exist")
    groups = []
    for path in args.reports:
        stem = os.path.splitext(os.path.basename(path))[0]
        for label, parts in read_rows(path):
            groups.append((f"{stem}: {label}" if len(args.reports) > 1 else label, parts))
    draw(groups, args.out, args.title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
