import warnings

import keras
import pytest

import keras_autovm
from keras_autovm import mechanisms
from conftest import data, small_cnn


def fit_with_peak(monkeypatch, factor, budget_share):
    """One epoch under a budget `budget_share` times the keep-all peak (after
    headroom), with the GPU's measured peak `factor` times the prediction."""
    keras.utils.set_random_seed(7)
    model = small_cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    keep = keras_autovm.plan(model, 8, budget=2**40, policy="keep_all", headroom=0)
    budget = int(keep.result.peak_bytes * budget_share
                 / (1 - mechanisms.get().default_headroom))
    callback = keras_autovm.AutoVM(budget=budget, verbose=0, apply_without_gpu=True,
                                   profile=None)
    cls = type(mechanisms.get())
    monkeypatch.setattr(cls, "reset_peak", lambda self: True)
    monkeypatch.setattr(cls, "peak_memory", lambda self: int(
        callback.plan.result.peak_bytes * factor))
    x, y = data(32)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, callbacks=[callback],
              verbose=0)
    return callback, keep


def test_peak_over_prediction_replans_with_the_measured_overhead(monkeypatch):
    callback, keep = fit_with_peak(monkeypatch, factor=1.5, budget_share=1.2)
    record = callback.report.epochs[0]
    # The first plan kept everything; the measured peak did not fit.
    assert record["predicted_peak_bytes"] == pytest.approx(keep.result.peak_bytes, rel=1e-3)
    assert record["replanned"]
    assert callback.report.stats["memory_scale"] == pytest.approx(1.5, rel=1e-3)
    # The new plan leaves room for the overhead measured.
    assert callback.plan.result.peak_bytes * 1.5 <= keep.result.peak_bytes * 1.2 + 1
    assert callback.plan.counts()["keep"] < len(callback.plan.graph.tensors)


def test_replan_for_an_unreachable_peak_keeps_the_plan(monkeypatch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback, _ = fit_with_peak(monkeypatch, factor=100.0, budget_share=1.2)
    assert any("kept its plan" in str(w.message) for w in caught)
    assert not callback.report.epochs[0]["replanned"]
    assert callback.report.stats["memory_scale"] == 1.0
    assert callback.plan.counts()["keep"] == len(callback.plan.graph.tensors)


def test_a_failed_replan_keeps_the_times_it_measured(monkeypatch):
    # The default device figures predict a CPU step far off what it takes,
    # so the first epoch calibrates; the peak no plan can meet fails the
    # replan. The plan stays, predicted again with the measured times.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback, _ = fit_with_peak(monkeypatch, factor=100.0, budget_share=1.2)
    assert any("kept its plan" in str(w.message) for w in caught)
    record = callback.report.epochs[0]
    assert not record["calibrated"]
    plan = callback.plan
    assert plan.calibrated
    assert plan.actions == {t: "keep" for t in plan.actions}
    assert callback.report.stats["memory_scale"] == 1.0
    assert plan.result.step_time == pytest.approx(record["step_time"], rel=0.3)
    assert record["predicted_step_time"] / record["step_time"] < 0.5


def test_peak_is_reset_when_an_epoch_begins_not_when_it_ends(monkeypatch):
    events = []
    cls = type(mechanisms.get())
    monkeypatch.setattr(cls, "reset_peak", lambda self: events.append("reset") or True)
    monkeypatch.setattr(cls, "peak_memory", lambda self: 1)

    class Reader(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            events.append("begin")

        def on_epoch_end(self, epoch, logs=None):
            events.append("end")

    model = small_cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    callback = keras_autovm.AutoVM(budget="1GiB", verbose=0, apply_without_gpu=True,
                                   profile=None)
    model.fit(*data(16), batch_size=8, epochs=2, verbose=0,
              callbacks=[callback, Reader()])
    # A callback after AutoVM reading the peak at an epoch's end (a timer, a
    # logger) sees the whole epoch's peak: AutoVM resets it only as the next
    # epoch begins.
    assert events == ["reset", "begin", "end", "reset", "begin", "end"]


def test_after_a_memory_replan_the_figures_name_the_overhead(monkeypatch, capsys):
    callback, _ = fit_with_peak(monkeypatch, factor=1.5, budget_share=1.2)
    plan = callback.plan
    assert plan.memory_scale == pytest.approx(1.5, rel=1e-3)
    # The limit is the budget less headroom, divided by the overhead; the
    # headroom is still its share of the budget, not of what the limit left.
    share = keras_autovm.mechanisms.get().default_headroom
    assert plan.budget == pytest.approx(plan.device_budget * (1 - share) / 1.5, rel=1e-3)
    line = keras_autovm.planner.plan.memory_line(plan.device_budget, plan.headroom,
                                                  plan.budget, plan.memory_scale)
    assert "measured overhead 1.50x" in line
    assert f"({keras_autovm.planner.format_bytes(plan.device_budget * share)})" in line
    from keras_autovm import report
    record = report.epoch_record(0, 1, plan, 4, 0.01, None)
    assert "measured overhead of 1.50x)" in report.epoch_line(record)


class _Result:
    """What `scaled_to_step` reads of a plan's `SimResult`."""

    def __init__(self, step_time, forward_time, h2d_bytes=0, recompute_time=0.0,
                 d2h_wait_time=0.0):
        self.step_time, self.forward_time, self.h2d_bytes = step_time, forward_time, h2d_bytes
        self.recompute_time, self.d2h_wait_time = recompute_time, d2h_wait_time


def test_a_measured_forward_scales_the_forward_and_the_rest_the_backward():
    from keras_autovm.calibration import scaled_to_step
    from keras_autovm.planner import CostModel
    cost = CostModel()
    # No forward seen apart (JAX, TensorFlow): one scale for the step.
    assert scaled_to_step(cost, _Result(1.0, 0.4), 2.0, None, 1.25).time_scale == 2.0
    assert scaled_to_step(cost, _Result(1.0, 0.4), 1.1, None, 1.25) == cost
    # The forward took twice the prediction, the rest as predicted.
    scaled = scaled_to_step(cost, _Result(1.0, 0.4), 1.4, 0.8, 1.25)
    assert (scaled.time_scale, scaled.fwd_scale) == (1.0, 2.0)
    # The forward as predicted, the rest half: the backward scales.
    scaled = scaled_to_step(cost, _Result(1.0, 0.4), 0.7, 0.4, 1.25)
    assert scaled.time_scale == pytest.approx(0.5)
    assert scaled.time_scale * scaled.fwd_scale == pytest.approx(1.0)


def test_recomputation_and_link_waits_are_not_counted_twice():
    from keras_autovm.calibration import scaled_to_step
    from keras_autovm.planner import CostModel
    # Forward 2x: the 0.1 s recomputed in the backward becomes 0.2 s, which
    # is all the rest grew by: the backward keeps its times.
    scaled = scaled_to_step(CostModel(), _Result(1.0, 0.4, recompute_time=0.1),
                            1.5, 0.8, 1.25)
    assert (scaled.time_scale, scaled.fwd_scale) == (1.0, 2.0)
    # 0.2 s of the predicted forward waited for the link, as measured.
    scaled = scaled_to_step(CostModel(), _Result(1.0, 0.4, d2h_wait_time=0.2),
                            1.2, 0.6, 1.25)
    assert scaled.fwd_scale == pytest.approx(2.0)
    # A forward no shorter than the step: one scale for the whole step.
    scaled = scaled_to_step(CostModel(), _Result(1.0, 0.4), 2.0, 2.0, 1.25)
    assert (scaled.time_scale, scaled.fwd_scale) == (2.0, 1.0)


def test_a_backward_that_copies_back_keeps_its_times():
    from keras_autovm.calibration import scaled_to_step
    from keras_autovm.planner import CostModel
    # How long it waited for its copies is the plan's to predict.
    scaled = scaled_to_step(CostModel(), _Result(1.0, 0.4, h2d_bytes=1 << 30), 2.4, 0.8,
                            1.25)
    assert (scaled.time_scale, scaled.fwd_scale) == (1.0, 2.0)


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="only torch's eager step shows its forward apart")
def test_torch_epochs_record_the_forward_pass_against_its_prediction():
    callback, _ = fit_epochs(2)
    for record in callback.report.epochs:
        assert 0 < record["forward_time"] < record["step_time"]
        assert 0 < record["predicted_forward_time"] < record["predicted_step_time"]


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="only torch's eager step shows its forward apart")
def test_torch_forward_times_learn_the_measured_forward(monkeypatch):
    cls = type(mechanisms.get())
    seen = []

    def forward_seconds(self):
        seen.append(self._forward is not None)
        self._forward = None
        return callback.plan.result.forward_time * 4

    monkeypatch.setattr(cls, "forward_seconds", forward_seconds)
    callback = keras_autovm.AutoVM(budget="1GiB", verbose=0, apply_without_gpu=True,
                                   profile=None)
    keras.utils.set_random_seed(7)
    model = small_cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    x, y = data(64)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, callbacks=[callback], verbose=0)
    assert seen and all(seen)  # Each training step's forward was marked.
    cost = callback._runtime.plans.cost
    # The forward measured 4x its prediction, whatever the rest measured.
    assert cost.fwd_scale != 1.0
    assert cost.time_scale * cost.fwd_scale == pytest.approx(4.0)


@pytest.mark.skipif(keras.backend.backend() == "torch",
                    reason="a compiled step shows no forward apart")
def test_compiled_epochs_record_no_forward():
    callback, _ = fit_epochs(1)
    assert callback.report.epochs[0]["forward_time"] is None


def fit_epochs(epochs):
    keras.utils.set_random_seed(7)
    model = small_cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    callback = keras_autovm.AutoVM(budget="1GiB", verbose=0, apply_without_gpu=True,
                                   profile=None)
    x, y = data(64)
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, callbacks=[callback],
              verbose=0)
    return callback, model
