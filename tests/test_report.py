"""The report: the same figures as printed, one memory vocabulary, plots."""

import importlib.util
import json
import pathlib

import keras
import pytest

import keras_autovm
from keras_autovm.planner import format_bytes
from conftest import BACKEND, data, small_cnn

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _fit(tmp_path, verbose=1, policy="sqrt_recompute"):
    keras.utils.set_random_seed(1)
    model = small_cnn()
    model.compile(optimizer="sgd", loss="mse")
    callback = keras_autovm.AutoVM(budget="8MiB", policy=policy, verbose=verbose,
                                   report_dir=str(tmp_path),
                                   apply_without_gpu=True)
    x, y = data(32)
    model.fit(x, y, batch_size=8, epochs=2, callbacks=[callback], verbose=0)
    return callback


def test_report_json_matches_printed_epoch_lines(tmp_path, capsys):
    callback = _fit(tmp_path)
    printed = capsys.readouterr().out.splitlines()
    saved = json.loads((tmp_path / "report.json").read_text())
    assert [r["epoch"] for r in saved["epochs"]] == [1, 2]  # As Keras counts.
    during = [line for line in printed if line.startswith("AutoVM epoch")][:2]
    assert during == [keras_autovm.report.epoch_line(r) for r in saved["epochs"]]
    assert during[0].startswith("AutoVM epoch 1/2: sqrt_recompute")
    # The budget, the headroom and the limit, each named.
    # The backend's default headroom (5% on torch, 15% elsewhere).
    share = keras_autovm.mechanisms.get().default_headroom
    assert (saved["budget_bytes"], saved["headroom"]) == (8 * 2**20, share)
    assert saved["limit_bytes"] == saved["plan"]["limit_bytes"] \
        == int(8 * 2**20 * (1 - share))
    assert (f"limit {format_bytes(saved['limit_bytes'])} "
            f"(budget 8.00 MiB less {share * 100:g}% headroom)") in during[0]
    assert (f"Memory: budget 8.00 MiB, headroom {share * 100:g}% "
            f"({format_bytes(8 * 2**20 * share)}), "
            f"limit {format_bytes(saved['limit_bytes'])}") in printed
    # Rates say their period.
    record = saved["epochs"][0]
    assert record["planned_host_bytes_per_epoch"] == \
        record["steps"] * record["planned_host_bytes_per_step"]
    assert "per step" in during[0] and "per epoch" in during[0]


def test_uncalibrated_predictions_say_so(capsys):
    plan = keras_autovm.plan(small_cnn(), 8, budget="8MiB")
    assert not plan.calibrated
    plan.summary()
    assert "uncalibrated: default device figures" in capsys.readouterr().out
    calibrated = keras_autovm.plan(small_cnn(), 8, budget="8MiB",
                                   cost=plan.cost.scaled(3.0))
    assert calibrated.calibrated
    calibrated.summary()
    assert "uncalibrated" not in capsys.readouterr().out


def test_timeline_and_layers_figures(tmp_path):
    callback = _fit(tmp_path, verbose=0)
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert (tmp_path / "layers.png").stat().st_size > 0
    report = callback.report
    fig = report.plot()
    ax = fig.axes[0]
    assert ax.get_title() == f"small_cnn, batch size 8, {BACKEND}, policy sqrt_recompute"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    share = keras_autovm.mechanisms.get().default_headroom
    for label in ("budget", "limit (budget less headroom)", f"headroom ({share * 100:g}%)",
                  "forward", "backward", "predicted (sqrt_recompute)"):
        assert label in labels, labels
    # The legend sits right of the axes: it hides no line.
    assert ax.get_legend().get_bbox_to_anchor().x0 >= ax.get_window_extent().x1
    assert ax.get_ylabel() == "device memory (MiB)"  # An 8 MiB budget.
    assert ax.get_ylim()[1] >= 8  # The budget line is inside the plot.
    layers = report.plot_layers().axes[0]
    assert len(layers.patches) == len(report.plan.graph.tensors)
    labels = [t.get_text() for t in layers.get_legend().get_texts()]
    counts = report.plan.counts()
    assert labels == [f"{a} ({counts[a]})" for a in ("keep", "swap", "recompute")]


def test_small_cnn_recipe_states_budgets_plan_accepts(capsys):
    spec = importlib.util.spec_from_file_location(
        "small_cnn_recipe", _ROOT / "recipes" / "small_cnn.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    model = recipe.make_model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    budget = recipe.default_budget(model, 64)
    line = capsys.readouterr().out
    keep = recipe.least_budget(model, 64, policy="keep_all")
    least = recipe.least_budget(model, 64)
    assert f"needs a budget of {format_bytes(keep)}" in line
    assert f"needs {format_bytes(least)}" in line
    # Like with like: each stated figure is a budget plan() accepts.
    assert keras_autovm.plan(model, 64, budget=keep, policy="keep_all").fits
    with pytest.raises(keras_autovm.PlanError):
        keras_autovm.plan(model, 64, budget=keep - 2**10, policy="keep_all")
    assert keras_autovm.plan(model, 64, budget=least).fits
    assert least < budget < keep


def test_timeline_shows_a_measured_peak_beside_the_prediction(tmp_path):
    report = _fit(tmp_path, verbose=0).report
    assert report.measured_peak() is None  # No GPU here: nothing measured.
    # As on a GPU, where the backend reports its peak.
    report.epochs[-1]["peak_bytes"] = 7 * 2**20
    ax = report.plot().axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    # XLA's peak cannot be reset: on JAX it is the process's, and says so.
    label = ("measured peak (the process's so far)" if BACKEND == "jax"
             else "measured peak")
    assert label in labels
    line = next(l for l in ax.get_lines() if l.get_label() == label)
    assert line.get_ydata()[0] == 7.0  # MiB
