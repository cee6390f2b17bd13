"""TensorFlow: a plan's step measured before its first step, and replanned
while it is over its limit (keras_autovm/mechanisms/tensorflow/probe.py).
Measured here on the CPU's allocator, which counts what it hands out as a
GPU's does."""

import keras
import numpy as np
import pytest

import keras_autovm
from conftest import BACKEND, data, small_cnn

pytestmark = pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's step probe")

BUDGET = 64 * 2**20
SIZE = 64  # Tensors of a few KiB are not counted by the CPU's allocator.


@pytest.fixture
def on_cpu(monkeypatch):
    from keras_autovm.mechanisms.tensorflow import probe
    monkeypatch.setattr(probe, "device", lambda: "CPU:0")
    return probe


def train(policy="sqrt_recompute", budget=BUDGET, watch=()):
    keras.utils.set_random_seed(3)
    model = small_cnn(SIZE)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=False)
    callback = keras_autovm.AutoVM(budget=budget, policy=policy, verbose=0,
                                   apply_without_gpu=True)
    x, y = data(32, size=SIZE)
    model.fit(x, y[:, :4], batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[callback, *watch])
    return model, callback


def tight_budget():
    """A budget whose limit holds keeping every output, with 15% spare."""
    keep = keras_autovm.plan(small_cnn(SIZE), 8, budget=2**30, policy="keep_all")
    return int(keep.result.peak_bytes * 1.15 / 0.85)


class FirstBatch(keras.callbacks.Callback):
    """The batch-norm statistics when the first step starts."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            self.seen = [keras.ops.convert_to_numpy(v) for v in
                         self.model.non_trainable_variables]


def test_the_step_is_measured_before_it_runs_and_changes_nothing(on_cpu, monkeypatch):
    monkeypatch.setattr(on_cpu, "TIGHT", float("inf"))  # Measured however loose.
    peaks = []
    real = on_cpu.step_peak
    monkeypatch.setattr(on_cpu, "step_peak", lambda *a: peaks.append(real(*a)) or peaks[-1])
    first = FirstBatch()
    model, callback = train(watch=[first])
    assert len(peaks) == 1 and peaks[0] > 0
    assert "probe_replans" not in callback._runtime.stats
    # Batch-norm statistics untouched by the probe, and training as without it.
    initial = [keras.ops.convert_to_numpy(v) for v in small_cnn(SIZE).non_trainable_variables]
    for before, now in zip(initial, first.seen):
        np.testing.assert_array_equal(before, now)
    monkeypatch.setattr(on_cpu, "device", lambda: None)
    unprobed, _ = train()
    for a, b in zip(model.get_weights(), unprobed.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_step_over_its_limit_is_replanned_with_the_overhead(on_cpu, monkeypatch):
    seen = []

    def peak(model, runtime, batch_size, where):
        seen.append(runtime.current.plan)
        # The first plan is measured at 1.3x its prediction; the next fits.
        return int(seen[-1].result.peak_bytes * (1.3 if len(seen) == 1 else 1.0))

    monkeypatch.setattr(on_cpu, "step_peak", peak)
    said = []
    monkeypatch.setattr(keras_autovm.callback.console_lib.Console, "warn",
                        lambda self, text: said.append(text))
    budget = tight_budget()
    _, callback = train(policy="auto", budget=budget)
    plans = callback._runtime.plans
    assert len(seen) == 2 and callback._runtime.stats["probe_replans"] == 1
    assert plans.memory_scale == pytest.approx(1.3, rel=1e-6)
    assert len(said) == 1 and "overhead of 1.30x" in said[0]
    assert seen[1].result.peak_bytes * 1.3 <= budget * (1 - plans.headroom)
    assert seen[1].result.peak_bytes < seen[0].result.peak_bytes
    # Later plans (the epoch's recalibration) keep the overhead learnt.
    assert callback.plan.memory_scale == plans.memory_scale


def test_a_probe_out_of_memory_learns_the_devices_limit(on_cpu, monkeypatch):
    seen = []

    def peak(model, runtime, batch_size, where):
        seen.append(runtime.current.plan)
        return None if len(seen) == 1 else 1

    monkeypatch.setattr(on_cpu, "step_peak", peak)
    budget = tight_budget()
    _, callback = train(policy="auto", budget=budget)
    plans = callback._runtime.plans
    limit = budget * (1 - plans.headroom)
    assert plans.memory_scale == pytest.approx(
        on_cpu.MARGIN * limit / seen[0].result.peak_bytes, rel=1e-6)
    assert seen[1].result.peak_bytes < seen[0].result.peak_bytes


def test_replans_stop_after_the_retries(on_cpu, monkeypatch):
    seen = []
    monkeypatch.setattr(on_cpu, "step_peak", lambda m, runtime, b, w: seen.append(1) or
                        int(runtime.current.plan.result.peak_bytes * 1.02 + BUDGET))
    with pytest.raises(keras_autovm.PlanError):
        train(policy="auto", budget=tight_budget())
    assert 1 <= len(seen) <= on_cpu.RETRIES + 1


def test_loose_plans_swap_plans_and_machines_without_a_gpu_are_not_probed(
        on_cpu, monkeypatch):
    monkeypatch.setattr(on_cpu, "step_peak", lambda *a: pytest.fail("probed"))
    train(policy="sqrt_recompute", budget=2**30)  # Fits 1.6x over and more.
    monkeypatch.setattr(on_cpu, "TIGHT", float("inf"))
    train(policy="offload_all")
    monkeypatch.setattr(on_cpu, "device", lambda: None)
    train()
