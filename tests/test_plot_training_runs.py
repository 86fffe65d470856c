"""scripts/plot_training_runs.py: every run that has room gets its name, the newest first, and no two names overlap."""

import importlib.util
from pathlib import Path

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("plot_training_runs", REPO / "scripts" / "plot_training_runs.py")
plot_training_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_training_runs)


def _top_axis_names(blocks):
    fig, ax = plt.subplots()
    ax.set_xlim(0, 100)
    runs = [{"name": f"run {i}: data"} for i in range(1, len(blocks) + 1)]
    plot_training_runs.label_runs(ax, blocks, runs)
    (top,) = ax.child_axes
    names = {tick.get_text(): tick.get_position()[0] for tick in top.get_xticklabels()}
    plt.close(fig)
    return names


def test_a_run_crowding_a_newer_one_stays_unnamed():
    # run 2 sits 1 unit (1 % of the axis) before run 3: run 3, the newer, keeps the name
    assert _top_axis_names([10, 49, 50, 90]) == {"run 1": 10, "run 3": 50, "run 4": 90}


def test_a_later_run_placed_before_an_earlier_one_is_still_named():
    # a branch run far to the right must not hide the runs listed after it
    assert _top_axis_names([10, 95, 30, 40]) == {"run 1": 10, "run 2": 95, "run 3": 30, "run 4": 40}
