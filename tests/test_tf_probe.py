"""TensorFlow: a plan's step measured before its first step, and replanned
while it is over its limit (keras_autovm/mechanisms/tensorflow/probe.py).
Measured here on the CPU's allocator, which counts what it hands out as a
GPU's does (tensors of a few KiB aside)."""

import keras
import numpy as np
import pytest

import keras_autovm
from conftest import BACKEND, data, small_cnn

pytestmark = pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's step probe")

# The CPU allocator's peak counts every tensor the test process holds, so
# the tests that measure for real give a budget nothing reaches.
BUDGET = 2**40
SIZE = 64


@pytest.fixture
def on_cpu(monkeypatch):
    import tensorflow as tf

    from keras_autovm.mechanisms.tensorflow import probe
    monkeypatch.setattr(probe, "device", lambda: "CPU:0")
    tf.config.experimental.get_memory_info("CPU:0")  # Turns the CPU's counts on.
    return probe


@pytest.fixture
def said(monkeypatch):
    lines = []
    monkeypatch.setattr(keras_autovm.callback.console_lib.Console, "warn",
                        lambda self, text: lines.append(text))
    return lines


def train(policy="sqrt_recompute", budget=BUDGET, watch=(), model_fn=None):
    keras.utils.set_random_seed(3)
    model = (model_fn or small_cnn)(SIZE)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=False)
    callback = keras_autovm.AutoVM(budget=budget, policy=policy, verbose=0,
                                   apply_without_gpu=True)
    x, y = data(32, size=SIZE)
    if model_fn is dict_input_cnn:
        x = {"image": x}
    model.fit(x, y[:, :4], batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[callback, *watch])
    return model, callback


def tight_budget():
    """A budget whose limit holds keeping every output, with 15% spare."""
    keep = keras_autovm.plan(small_cnn(SIZE), 8, budget=2**30, policy="keep_all")
    return int(keep.result.peak_bytes * 1.15 / 0.85)


def limit_of(plans):
    return plans.budget_bytes * (1 - plans.headroom)


class FirstBatch(keras.callbacks.Callback):
    """The layer state when the first step starts."""

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
    # Batch-norm statistics untouched by the probe, training as without it,
    # and the runtime's counts are the training's own.
    initial = [keras.ops.convert_to_numpy(v) for v in small_cnn(SIZE).non_trainable_variables]
    for before, now in zip(initial, first.seen):
        np.testing.assert_array_equal(before, now)
    monkeypatch.setattr(on_cpu, "device", lambda: None)
    unprobed, plain = train()
    for a, b in zip(model.get_weights(), unprobed.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert callback._runtime.stats == plain._runtime.stats


def test_the_probe_runs_the_backward_pass(on_cpu, monkeypatch):
    """The probe takes the gradients of every weight, as the step does."""
    import tensorflow as tf
    monkeypatch.setattr(on_cpu, "TIGHT", float("inf"))
    inside, asked = [], []
    real_peak, real_gradient = on_cpu.step_peak, tf.GradientTape.gradient

    def step_peak(*args):
        inside.append(1)
        try:
            return real_peak(*args)
        finally:
            inside.pop()

    def gradient(tape, target, sources, *args, **kwargs):
        if inside:
            asked.append(len(sources))
        return real_gradient(tape, target, sources, *args, **kwargs)

    monkeypatch.setattr(on_cpu, "step_peak", step_peak)
    monkeypatch.setattr(tf.GradientTape, "gradient", gradient)
    model, _ = train()
    # (Recomputed segments take gradients of their own inside it.)
    assert asked and asked[0] == len(model.trainable_variables)


def dict_input_cnn(size):
    inputs = {"image": keras.Input((size, size, 3), name="image")}
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c1")(inputs["image"])
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c2")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(x))


def test_a_model_taking_a_dict_is_measured(on_cpu, monkeypatch):
    monkeypatch.setattr(on_cpu, "TIGHT", float("inf"))
    peaks = []
    real = on_cpu.step_peak
    monkeypatch.setattr(on_cpu, "step_peak", lambda *a: peaks.append(real(*a)) or peaks[-1])
    train(model_fn=dict_input_cnn)
    assert len(peaks) == 1 and peaks[0] > 0


def test_a_step_over_its_limit_is_replanned_with_the_overhead(on_cpu, monkeypatch, said):
    seen = []

    def peak(model, runtime, batch_size, where):
        seen.append(runtime.current.plan)
        # The first plan is measured at 1.3x its prediction; the next fits.
        return int(seen[-1].result.peak_bytes * (1.3 if len(seen) == 1 else 1.0))

    monkeypatch.setattr(on_cpu, "step_peak", peak)
    _, callback = train(policy="auto", budget=tight_budget())
    plans = callback._runtime.plans
    assert len(seen) == 2 and callback._runtime.stats["probe_replans"] == 1
    assert plans.memory_scale == pytest.approx(1.3, rel=1e-6)
    assert len(said) == 1 and "overhead of 1.30x" in said[0]
    assert seen[1].result.peak_bytes * 1.3 <= limit_of(plans)
    assert seen[1].result.peak_bytes < seen[0].result.peak_bytes
    # The epoch's recalibration replanned with the overhead learnt.
    assert callback.plan.result.peak_bytes * 1.3 <= limit_of(plans)


def test_a_probe_out_of_memory_replans_as_a_failed_step_does(on_cpu, monkeypatch):
    from keras_autovm import oom
    seen = []

    def peak(model, runtime, batch_size, where):
        seen.append(runtime.current.plan)
        return None if len(seen) == 1 else 1

    monkeypatch.setattr(on_cpu, "step_peak", peak)
    budget = tight_budget()
    _, callback = train(policy="auto", budget=budget)
    plans = callback._runtime.plans
    assert plans.memory_scale == pytest.approx(
        oom.overhead_after_oom(seen[0], plans, budget), rel=1e-6)
    assert seen[1].result.peak_bytes * oom.MARGIN <= seen[0].result.peak_bytes


def test_after_the_retries_training_goes_on_and_says_so(on_cpu, monkeypatch, said):
    seen = []
    # Each plan is measured one byte over the limit: each replan shrinks it
    # a little, and the probe never fits.
    monkeypatch.setattr(on_cpu, "step_peak", lambda m, runtime, b, w: seen.append(1) or
                        int(limit_of(runtime.plans)) + 1)
    _, callback = train(policy="auto", budget=tight_budget())
    assert len(seen) == on_cpu.RETRIES + 1
    assert callback._runtime.stats["probe_replans"] == on_cpu.RETRIES
    assert f"after {on_cpu.RETRIES} replans; training goes on" in said[-1]


def test_a_probe_that_no_plan_meets_is_a_plan_error(on_cpu, monkeypatch):
    monkeypatch.setattr(on_cpu, "step_peak", lambda m, runtime, b, w:
                        int(runtime.current.plan.result.peak_bytes * 1.02 + 2**30))
    with pytest.raises(keras_autovm.PlanError, match="smallest feasible budget"):
        train(policy="auto", budget=tight_budget())


def test_loose_plans_swap_plans_and_machines_without_a_gpu_are_not_probed(
        on_cpu, monkeypatch):
    monkeypatch.setattr(on_cpu, "step_peak", lambda *a: pytest.fail("probed"))
    train(policy="sqrt_recompute", budget=2**30)  # Fits twice over and more.
    monkeypatch.setattr(on_cpu, "TIGHT", float("inf"))
    train(policy="offload_all")
    monkeypatch.setattr(on_cpu, "device", lambda: None)
    train()
