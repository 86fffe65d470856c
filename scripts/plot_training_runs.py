"""Plot tau per held-out set against the training blocks seen, across the runs of the shipped drafter.

    python scripts/plot_training_runs.py docs/training-runs.json docs/smollm2-runs-curve.png

Each run continues from the previous one (`dflash-hf train --init-from`); the JSON holds the measured points and
how they were measured. A held-out set first measured at a later run is plotted from that run on. A run marked
``"branch": true`` continued a drafter that the next run did not continue from (it was not shipped): its points
are drawn as crosses, off the lines.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label_runs(ax, blocks: list[float], runs: list[dict]) -> None:
    """Name the runs on a top axis, upright. Newest first: a run closer than 2 % of the axis to a named one stays
    unnamed (early runs came a few hundred thousand blocks apart, and their names would print over each other)."""
    left, right = ax.get_xlim()
    spacing = 0.02 * (right - left)
    named: dict[float, str] = {}
    for x, run in reversed(list(zip(blocks, runs))):
        if all(abs(x - other) >= spacing for other in named):
            named[x] = run["name"].split(":")[0]
    top = ax.secondary_xaxis("top")
    top.set_xticks(list(named), list(named.values()), rotation=90, fontsize=7)


def main(table: str, out: str) -> None:
    runs = json.load(open(table))["runs"]
    blocks = [run["blocks"] / 1000 for run in runs]
    fig, ax = plt.subplots(figsize=(8.5, 4))
    for dataset in dict.fromkeys(name for run in runs for name in run["tau"]):  # a set measured from some run on
        points = [(x, run["tau"][dataset]) for x, run in zip(blocks, runs)
                  if dataset in run["tau"] and not run.get("branch")]
        (line,) = ax.plot(*zip(*points), marker="o", label=dataset)
        branches = [(x, run["tau"][dataset]) for x, run in zip(blocks, runs)
                    if dataset in run["tau"] and run.get("branch")]
        if branches:
            ax.plot(*zip(*branches), marker="x", linestyle="none", color=line.get_color(), markersize=8)
    ax.margins(x=0.08)
    label_runs(ax, blocks, runs)
    ax.set_xlabel("training blocks seen (thousands)")
    ax.set_ylabel("tau at B = 16 (tokens per round)")
    ax.set_title("SmolLM2-135M-Instruct drafter across training runs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: the latest run sits top right
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python scripts/plot_training_runs.py TABLE.json OUT.png")
    main(sys.argv[1], sys.argv[2])
