#!/usr/bin/env python3
"""Chart of a run's before / after figures for docs/performance.md.

    pip install matplotlib   # once
    python bench/plot_runs.py bench/data/run15_figures.json docs/performance-run15.png

The JSON holds the figures the run log's tables give, old build against new, one panel per
entry of "panels" ({"key", "labels", "title"}; without it, run 15's two panels: decode step per
shape and training steps at 16k); the chart shows new / old per item (below 1: faster).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    data = json.load(open(src))
    panels = [(p["key"], p["labels"], p["title"]) for p in data.get("panels", [])] or [
        ("decode_q8_step_us", "shapes", "decode step, Q = 8 (bf16 unless noted)"),
        ("training_16k_ms", "steps", "training, 16k tokens, independent selection")]
    widths = [max(3, len(data[key][labels])) for key, labels, _ in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 4.2), gridspec_kw={"width_ratios": widths}, squeeze=False)
    axes = axes[0]
    for ax, (key, labels, title) in zip(axes, panels):
        d = data[key]
        ratio = [n / o for n, o in zip(d["new"], d["old"])]
        colors = ["tab:green" if r < 0.98 else "tab:red" if r > 1.02 else "tab:gray" for r in ratio]
        ax.bar(range(len(ratio)), ratio, color=colors)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(ratio)), d[labels], rotation=40, ha="right", fontsize=8)
        ax.set_ylim(0, max(1.2, max(ratio) + 0.1))
        ax.set_title(title, fontsize=10)
        for i, r in enumerate(ratio):
            ax.text(i, r + 0.02, f"{r:.2f}", ha="center", fontsize=7)
    axes[0].set_ylabel("new time / old time")
    fig.suptitle(data["source"], fontsize=9)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
