"""TensorFlow: each tight plan's first step measured; undone and run again
under a new plan when it ran out of memory, kept when it ran within its
limit (the budget less the headroom), followed by a new plan when it ran
over it
(keras_autovm/mechanisms/tensorflow/first_step.py). Measured here on the
CPU's allocator, which counts what it hands out as a GPU's does (tensors of
a few KiB aside)."""

import collections
import os

import keras
import numpy as np
import pytest

import keras_autovm
from conftest import BACKEND, data, forget_learnt_overheads, kept_overhead, small_cnn
from keras_autovm.mechanisms.base import FILLED_WITHIN
from keras_autovm.runtime import plan_key

pytestmark = pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's first steps")

# The CPU allocator's peak counts every tensor the test process holds, so
# the tests that measure for real give a budget nothing reaches.
BUDGET = 2**40
SIZE = 64
STEPS = 4  # 32 samples in batches of 8.


@pytest.fixture
def on_cpu(monkeypatch):
    import tensorflow as tf

    from keras_autovm.mechanisms.tensorflow import first_step
    monkeypatch.setattr(first_step, "device", lambda: "CPU:0")
    tf.config.experimental.get_memory_info("CPU:0")  # Turns the CPU's counts on.
    return first_step


def skip_warmup(first_step, monkeypatch):
    """Every measured step judged, as in a function whose convolutions a
    step before it tuned (`FirstSteps._warming`)."""
    monkeypatch.setattr(first_step.FirstSteps, "_warming", lambda self, plan: False)


def no_least(monkeypatch):
    """No plan of least predicted peak to try (`PlanBook.least`), as where
    it is over the limit even without the learnt overhead."""
    from keras_autovm.budget import PlanBook
    monkeypatch.setattr(PlanBook, "least", lambda self, batch_size: None)


@pytest.fixture
def tuned(on_cpu, monkeypatch):
    skip_warmup(on_cpu, monkeypatch)
    return on_cpu


@pytest.fixture
def said(monkeypatch):
    lines = []
    monkeypatch.setattr(keras_autovm.callback.console_lib.Console, "warn",
                        lambda self, text: lines.append(text))
    return lines


def train(policy="sqrt_recompute", budget=BUDGET, model_fn=None, steps_per_execution=1,
          built=None, jit_compile=False, optimizer=None, metrics=None, epochs=1,
          callbacks=()):
    keras.utils.set_random_seed(3)
    model = (model_fn or small_cnn)(SIZE)
    if built is not None:
        built.append(model)
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.05), loss="mse",
                  metrics=metrics, jit_compile=jit_compile,
                  steps_per_execution=steps_per_execution)
    callback = keras_autovm.AutoVM(budget=budget, policy=policy, verbose=0,
                                   apply_without_gpu=True)
    x, y = data(32, size=SIZE)
    if model_fn is dict_input_cnn:
        x = {"image": x}
    history = model.fit(x, y[:, :4], batch_size=8, epochs=epochs, shuffle=False,
                        verbose=0, callbacks=[*callbacks, callback])
    model.history_ = history.history
    return model, callback


def tight_budget():
    """A budget whose limit holds keeping every output, with 15% spare."""
    keep = keras_autovm.plan(small_cnn(SIZE), 8, budget=2**30, policy="keep_all")
    return int(keep.result.peak_bytes * 1.15 / 0.85)


def limit_of(plans):
    return plans.budget_bytes * (1 - plans.headroom)


def watch(first_step, monkeypatch, peak=None, fail=lambda n: False, runs=True):
    """Records each measured step's plan; `peak(n, plan, measured)` (n from 1)
    replaces the measured peak, and the n-th step runs out of memory where
    `fail(n)`: after running if `runs`, else before."""
    import tensorflow as tf
    plans = Seen()
    jit = plans.jit = []  # Whether each measured step ran under XLA.
    real = first_step.run_measured

    def run_measured(function, data, where):
        # The plan of the batch measured (a short last batch has its own).
        plans.append(current[0]._active.plan)
        jit.append(current[1].jit_compile)
        if fail(len(plans)) and not runs:
            raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating")
        logs, measured = real(function, data, where)
        if fail(len(plans)):
            raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating")
        return logs, (peak(len(plans), plans[-1], measured) if peak else measured)

    current = plans.current = []  # The runtime and model of the last trace.
    real_init = first_step.FirstSteps.__init__

    def init(self, model, runtime, function):
        current[:] = [runtime, model]
        real_init(self, model, runtime, function)

    monkeypatch.setattr(first_step, "run_measured", run_measured)
    monkeypatch.setattr(first_step.FirstSteps, "__init__", init)
    return plans


def replan_after_first_epoch(monkeypatch, seen):
    """A callback that, at the first epoch's end, puts a plan made with a
    larger overhead in force and retraces the step, as a replan at an
    epoch's end does (`seen`: from `watch`)."""
    from keras_autovm import patches as patches_lib
    autovm = []
    real_init = keras_autovm.AutoVM.__init__
    monkeypatch.setattr(keras_autovm.AutoVM, "__init__", lambda self, *args, **kw: (
        real_init(self, *args, **kw), autovm.append(self))[0])

    class Replan(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch:
                return
            runtime = seen.current[0]
            runtime.plans.memory_scale = 1.3
            runtime.replace(runtime.plans.plan(8))
            patches_lib.retrace(self.model, autovm[0]._patches, runtime)

    return Replan()


class Seen(list):
    """The plans of the measured steps; `jit`: whether each ran under XLA."""


def weights(model):
    return [keras.ops.convert_to_numpy(v) for v in model.variables]


def test_the_first_step_is_measured_once_and_trains_as_without(on_cpu, monkeypatch):
    monkeypatch.setattr(on_cpu, "TIGHT", float("inf"))  # Measured however loose.
    seen = watch(on_cpu, monkeypatch)
    model, callback = train(epochs=2)
    # Once: the second epoch's plan, replanned with the same actions, is not
    # measured again.
    assert len(seen) == 1
    monkeypatch.setattr(on_cpu, "device", lambda: None)
    plain, unmeasured = train(epochs=2)
    for a, b in zip(weights(model), weights(plain)):
        np.testing.assert_array_equal(a, b)
    assert int(model.optimizer.iterations) == 2 * STEPS
    stats = dict(callback._runtime.stats)
    assert stats.pop("first_step_peak_bytes") > 0
    assert stats == unmeasured._runtime.stats


def traced(function, name):
    """How many times the `tf.function` `name` in Keras's training
    `function` (or in the wrappers it closes over) was traced."""
    for cell in function.__closure__ or ():
        inner = cell.cell_contents
        if getattr(inner, "__name__", "") == name and hasattr(
                inner, "experimental_get_tracing_count"):
            return inner.experimental_get_tracing_count()
        if callable(inner) and getattr(inner, "__closure__", None):
            count = traced(inner, name)
            if count is not None:
                return count
    return None


def test_the_measured_step_is_the_function_the_fit_runs(on_cpu, monkeypatch):
    """Measured through an iterator over its batch alone, with the fit's
    element spec: the measured step runs Keras's iterator function, traced
    once for the fit, and the step after it is timed."""
    monkeypatch.setattr(on_cpu, "TIGHT", float("inf"))
    measured = []
    real_ran = on_cpu.FirstSteps._ran

    def ran(self, plan, peak, logs, warming=False):
        measured.append((self, traced(self.function, "multi_step_on_iterator"),
                         self.runtime.untimed_steps))
        return real_ran(self, plan, peak, logs, warming)

    monkeypatch.setattr(on_cpu.FirstSteps, "_ran", ran)
    model, _ = train(epochs=2)
    [(steps, traces_then, untimed)] = measured
    assert traces_then == 1 and untimed == 1
    assert traced(steps.function, "multi_step_on_iterator") == 1
    assert int(model.optimizer.iterations) == 2 * STEPS


Batch = collections.namedtuple("Batch", "x y")


@pytest.mark.parametrize("kind", ["tuple", "nested", "namedtuple"])
def test_a_one_batch_iterator_has_the_fits_element_spec(on_cpu, kind):
    import tensorflow as tf

    from keras_autovm.mechanisms.tensorflow import one_batch

    x, y = np.zeros((8, 4, 4, 3), "float32"), np.zeros((8, 2), "float32")
    element = {"tuple": (x, y), "nested": ({"image": x}, y), "namedtuple": Batch(x, y)}[kind]
    fits = iter(tf.data.Dataset.from_tensor_slices(element).batch(3))  # Last batch short.
    spec = one_batch.tensor_spec(fits)
    assert tf.nest.flatten(spec)[0].shape.as_list() == [None, 4, 4, 3]
    data = one_batch.next_batch(fits)
    one = one_batch.one_batch_iterator(data, spec)
    assert one.element_spec == spec
    for got, want in zip(tf.nest.flatten(next(one)), tf.nest.flatten(data)):
        np.testing.assert_array_equal(got, want)
    assert one_batch.tensor_spec(iter([data])) is None  # Not a tf.data iterator.
    assert isinstance(one_batch.batch_for(data, spec)(), tf.data.Iterator)
    # A batch whose structure is not the spec's goes in a list.
    assert one_batch.batch_for(data, {"other": spec})() == [data]


def dropout_cnn(size):
    """The small CNN with dropout (a seed generator's state) before its head."""
    model = small_cnn(size)
    return keras.Sequential([keras.Input((size, size, 3)), *model.layers[:-1],
                             keras.layers.Dropout(0.3, name="drop"), model.layers[-1]])


def fits(n, plan, measured):
    """The measured peak of a plan that fits: its prediction (the CPU
    allocator's own counts every tensor the test process holds)."""
    return plan.result.peak_bytes


def test_a_step_out_of_memory_is_undone_replanned_and_run_again(on_cpu, monkeypatch):
    """Adam's slots and the compiled metrics, which Keras builds as the
    first step is traced, and dropout's seed are put back too: a step that
    ran before running out of memory trains as one that failed at once."""
    from keras_autovm import oom
    budget = tight_budget()
    trained = []
    for runs in (True, False):
        monkeypatch.undo()
        forget_learnt_overheads()  # Each fit runs out of memory once.
        monkeypatch.setattr(on_cpu, "device", lambda: "CPU:0")
        skip_warmup(on_cpu, monkeypatch)
        seen = watch(on_cpu, monkeypatch, peak=fits, fail=lambda n: n == 1, runs=runs)
        said = []
        monkeypatch.setattr(keras_autovm.callback.console_lib.Console, "warn",
                            lambda self, text: said.append(text))
        model, callback = train(policy="auto", budget=budget, model_fn=dropout_cnn,
                                optimizer=keras.optimizers.Adam(0.01), metrics=["mae"])
        plans = callback._runtime.plans
        assert len(seen) == 2 and callback._runtime.stats["out_of_memory_replans"] == 1
        assert plans.memory_scale == pytest.approx(
            oom.overhead_after_oom(seen[0], plans, budget), rel=1e-6)
        assert seen[1].result.peak_bytes * oom.MARGIN <= seen[0].result.peak_bytes
        # It needed at least the device: the bytes over its plan, learnt too.
        assert plans.memory_extra == budget - seen[0].result.peak_bytes
        assert seen[1].budget <= budget * (1 - plans.headroom) - plans.memory_extra
        assert "ran out of GPU memory" in said[0] and "Replanned" in said[0]
        assert int(model.optimizer.iterations) == STEPS
        # It trained: the next fit takes the same path (`keras_autovm.learnt`).
        assert kept_overhead(callback) == (1.0, 0)
        trained.append((weights(model), model.history_))
    for a, b in zip(trained[0][0], trained[1][0]):
        np.testing.assert_array_equal(a, b)
    assert trained[0][1] == trained[1][1]  # Loss and mae.


def test_a_step_within_its_limit_is_kept_and_learns_nothing(on_cpu, monkeypatch, said):
    seen = watch(on_cpu, monkeypatch, peak=fits)
    model, callback = train(policy="auto", budget=tight_budget())
    plans = callback._runtime.plans
    assert len(seen) == 1 and "first_step_replans" not in callback._runtime.stats
    assert plans.memory_scale == 1 and plans.memory_extra == 0 and not said
    assert int(model.optimizer.iterations) == STEPS


def test_a_step_over_its_limit_within_the_budget_is_followed_by_a_new_plan(
        on_cpu, monkeypatch, tuned, said):
    """The headroom is kept free of what a step measures too: on an H200 a
    first step within 0.5% of its 8 GiB cap, over its limit, was followed
    by a step that ran out of memory."""
    budget = tight_budget()
    over = lambda plan: int(plan.result.peak_bytes * 1.2)  # noqa: E731
    seen = watch(on_cpu, monkeypatch, peak=lambda n, plan, measured:
                 over(plan) if n == 1 else plan.result.peak_bytes)
    model, callback = train(policy="auto", budget=budget)
    plans = callback._runtime.plans
    assert limit_of(plans) < over(seen[0]) <= budget
    assert len(seen) == 2 and callback._runtime.stats["first_step_replans"] == 1
    assert plans.memory_scale == pytest.approx(1.2, rel=1e-6)
    assert "over its limit" in said[0] and "Replanned" in said[0]
    assert seen[1].result.peak_bytes < seen[0].result.peak_bytes
    assert int(model.optimizer.iterations) == STEPS  # The first step stood.


def test_no_plan_that_fits_a_step_over_its_limit_is_a_plan_error(on_cpu, monkeypatch):
    monkeypatch.setattr(on_cpu, "_ratio", lambda peak, plan: 100.0)  # Nothing fits.
    no_least(monkeypatch)
    budget = tight_budget()
    watch(on_cpu, monkeypatch, peak=lambda n, plan, measured: budget)
    with pytest.raises(keras_autovm.PlanError) as raised:
        train(policy="auto", budget=budget)
    text = str(raised.value)
    # The first step, which tunes cuDNN's convolutions, was not judged.
    assert text.startswith("AutoVM: the second step under its plan for batch size 8 "
                           "peaked at") and "over its limit" in text
    assert text.count("The smallest feasible budget is") == 1


def test_a_replan_allows_for_the_bytes_measured_over_the_plan(
        on_cpu, monkeypatch, tuned, said):
    """On an H200, what a TensorFlow step used beyond its plan held in bytes
    across plans, not as a ratio (`first_step._learn`): the next plan fits
    the budget less the headroom less those bytes."""
    from keras_autovm.budget import limit_for
    budget = tight_budget()
    seen = watch(on_cpu, monkeypatch, peak=lambda n, plan, measured:
                 budget + 1 if n == 1 else plan.result.peak_bytes)
    train(policy="auto", budget=budget)
    extra = budget + 1 - seen[0].result.peak_bytes
    assert seen[1].memory_extra == extra and seen[1].memory_scale > 1
    # Below its budget, the bytes leave less than the ratio would.
    room = budget * (1 - seen[1].headroom)
    assert seen[1].budget == limit_for(budget, seen[1].headroom, seen[1].memory_scale,
                                       extra) == int(room - extra)
    assert seen[1].result.peak_bytes <= room - extra < room / seen[1].memory_scale
    assert "whichever leaves less" in said[0]


def test_a_step_over_the_budget_is_followed_by_a_new_plan(on_cpu, monkeypatch, tuned, said):
    budget = tight_budget()
    seen = watch(on_cpu, monkeypatch, peak=lambda n, plan, measured:
                 budget + 1 if n == 1 else plan.result.peak_bytes)
    model, callback = train(policy="auto", budget=budget)
    plans = callback._runtime.plans
    assert len(seen) == 2 and callback._runtime.stats["first_step_replans"] == 1
    assert plans.memory_scale == pytest.approx((budget + 1) / seen[0].result.peak_bytes)
    assert "over the budget" in said[0] and "Replanned" in said[0]
    assert seen[1].result.peak_bytes < seen[0].result.peak_bytes
    assert int(model.optimizer.iterations) == STEPS  # The first step stood.


@pytest.mark.parametrize("second", ["within", "over"])
def test_a_first_step_over_its_limit_is_followed_by_one_under_the_same_plan(
        on_cpu, monkeypatch, said, second):
    """The first step tunes cuDNN's convolutions with scratch taken where
    memory is free: over its limit, it is not judged; the next step, under
    the same plan, is, and only its peak is learnt from."""
    budget = tight_budget()
    over = lambda plan, scale: int(plan.result.peak_bytes * scale)  # noqa: E731
    later = 1.3 if second == "over" else 1.0
    seen = watch(on_cpu, monkeypatch, peak=lambda n, plan, measured:
                 over(plan, 1.4 if n == 1 else later if n == 2 else 1.0))
    model, callback = train(policy="auto", budget=budget)
    runtime = callback._runtime
    assert limit_of(runtime.plans) < over(seen[0], 1.3)
    assert seen[1] is seen[0]  # Not replanned after the first step.
    assert runtime.stats["warmup_peak_bytes"] == over(seen[0], 1.4)
    assert not said if second == "within" else (
        said[0].startswith("AutoVM: the second step under its plan")
        and "over its limit" in said[0])
    if second == "within":
        assert len(seen) == 2 and runtime.plans.memory_scale == 1
        assert runtime.stats["first_step_peak_bytes"] == over(seen[0], 1.0)
        assert "first_step_replans" not in runtime.stats
    else:  # Learnt from the second step's peak, not the first's.
        assert len(seen) == 3 and runtime.stats["first_step_replans"] == 1
        assert runtime.plans.memory_scale == pytest.approx(1.3, rel=1e-6)
        assert seen[2].result.peak_bytes < seen[0].result.peak_bytes
    assert int(model.optimizer.iterations) == STEPS  # Every step stood.


def test_a_first_step_out_of_memory_is_undone_and_run_again_under_its_plan(
        on_cpu, monkeypatch, said):
    """Once: where the step after it runs out of memory too, that one is
    learnt from and replanned, as any later step."""
    budget = tight_budget()
    seen = watch(on_cpu, monkeypatch, peak=fits, fail=lambda n: n == 1)
    model, callback = train(policy="auto", budget=budget, model_fn=dropout_cnn,
                            optimizer=keras.optimizers.Adam(0.01))
    runtime = callback._runtime
    assert len(seen) == 2 and seen[1] is seen[0]
    assert runtime.stats["warmup_reruns"] == 1 and "out_of_memory_replans" not in runtime.stats
    assert runtime.plans.memory_scale == 1 and runtime.plans.memory_extra == 0
    assert len(said) == 1 and "tunes each new convolution" in said[0]
    assert "run again under the same plan" in said[0]
    assert kept_overhead(callback) == (1.0, 0)
    # Undone: it trains as a fit whose first step did not fail.
    monkeypatch.setattr(on_cpu, "device", lambda: None)
    plain, _ = train(policy="auto", budget=budget, model_fn=dropout_cnn,
                     optimizer=keras.optimizers.Adam(0.01))
    for a, b in zip(weights(model), weights(plain)):
        np.testing.assert_array_equal(a, b)
    assert model.history_ == plain.history_
    # Out of memory again: learnt, replanned, and the next plan runs.
    monkeypatch.setattr(on_cpu, "device", lambda: "CPU:0")
    seen = watch(on_cpu, monkeypatch, peak=fits, fail=lambda n: n <= 2)
    model, callback = train(policy="auto", budget=budget)
    assert len(seen) == 3 and seen[1] is seen[0] and seen[2].actions != seen[0].actions
    assert callback._runtime.stats["out_of_memory_replans"] == 1
    assert int(model.optimizer.iterations) == STEPS


def test_a_plan_made_at_an_epochs_end_is_judged_from_its_first_step(
        on_cpu, monkeypatch, said):
    """cuDNN tunes each new convolution once in a process: a plan made at an
    epoch's end (measured through a new training function) runs the same
    ones, so its first step is judged. The allocator's peak is reset after a
    first step not judged, so that the epoch's end does not learn from it
    either."""
    import tensorflow as tf

    seen = watch(on_cpu, monkeypatch, peak=lambda n, plan, measured: int(
        plan.result.peak_bytes * (1.4 if plan not in seen[:-1] else 1.0)))
    resets = []
    real_reset = tf.config.experimental.reset_memory_stats
    monkeypatch.setattr(tf.config.experimental, "reset_memory_stats",
                        lambda where: (resets.append(len(seen)), real_reset(where)))
    model, callback = train(policy="auto", budget=tight_budget(), epochs=2,
                            callbacks=[replan_after_first_epoch(monkeypatch, seen)])
    # Epoch 1: not judged, then judged within its limit. Epoch 2: the new
    # plan judged at its first step (over its limit: replanned), and the
    # plan after it.
    assert len(seen) == 4 and seen[1] is seen[0] and seen[2].actions != seen[0].actions
    assert said[0].startswith("AutoVM: the first step under its plan for batch size 8 "
                              "peaked at") and "over its limit" in said[0]
    stats = callback._runtime.stats
    assert stats["warmup_peak_bytes"] == int(seen[0].result.peak_bytes * 1.4)
    assert stats["first_step_replans"] == 1
    # Each measured step resets the peak before it runs; the one not judged
    # once more after it.
    assert resets.count(1) == 2 and resets.count(2) == 1 and resets.count(3) == 1
    assert int(model.optimizer.iterations) == 2 * STEPS


def test_under_xla_the_first_step_is_judged_as_it_ran(on_cpu, monkeypatch, said):
    """XLA tunes as it compiles, and a step under it that runs out of
    memory cannot be undone: no second step under the same plan."""
    monkeypatch.setattr(on_cpu, "XLA_OVERHEAD", 0.0)  # XLA stays on.
    seen = watch(on_cpu, monkeypatch, peak=lambda n, plan, measured:
                 int(plan.result.peak_bytes * (1.2 if n == 1 else 1.0)))
    _, callback = train(policy="auto", budget=tight_budget(), jit_compile=True)
    assert seen.jit[0] and len(seen) == 2 and seen[1].actions != seen[0].actions
    assert callback._runtime.stats["first_step_replans"] == 1
    assert "warmup_peak_bytes" not in callback._runtime.stats


def test_under_xla_no_least_plan_runs(on_cpu, monkeypatch):
    """Made without the overhead, a plan that does not swap would keep the
    step's XLA, where running out of memory cannot be undone."""
    monkeypatch.setattr(on_cpu, "XLA_OVERHEAD", 0.0)  # XLA stays on.
    monkeypatch.setattr(on_cpu, "_ratio", lambda peak, plan: 100.0)  # Nothing fits.
    budget = tight_budget()
    seen = watch(on_cpu, monkeypatch, peak=lambda n, plan, measured: budget)
    with pytest.raises(keras_autovm.PlanError, match="the first step .* over its limit"):
        train(policy="auto", budget=budget, jit_compile=True)
    assert seen.jit == [True]


@pytest.fixture
def cap_at_budget(monkeypatch):
    """The allocator's limit is the budget, as under the GPU recipes' cap."""
    from keras_autovm.mechanisms.tensorflow.mechanism import TensorFlowMechanism
    budget = tight_budget()
    monkeypatch.setattr(TensorFlowMechanism, "device_memory", lambda self: budget)
    return budget


def test_a_step_that_filled_the_allocator_is_followed_by_a_new_plan(
        on_cpu, monkeypatch, tuned, said, cap_at_budget):
    budget = cap_at_budget
    filled = budget - FILLED_WITHIN // 2  # Within the budget.
    seen = watch(on_cpu, monkeypatch, peak=lambda n, plan, measured:
                 filled if n == 1 else plan.result.peak_bytes)
    model, callback = train(policy="auto", budget=budget)
    assert len(seen) == 2 and callback._runtime.stats["first_step_replans"] == 1
    assert "filled the allocator's limit" in said[0] and "Replanned" in said[0]
    assert seen[1].result.peak_bytes < seen[0].result.peak_bytes
    assert int(model.optimizer.iterations) == STEPS  # The first step stood.


def test_where_nothing_fits_after_filling_the_allocator_it_is_a_plan_error(
        on_cpu, monkeypatch, cap_at_budget):
    monkeypatch.setattr(on_cpu, "_ratio", lambda peak, plan: 100.0)  # Nothing fits.
    watch(on_cpu, monkeypatch, peak=lambda n, plan, measured: cap_at_budget)
    with pytest.raises(keras_autovm.PlanError, match="filled the allocator's limit"):
        train(policy="auto", budget=cap_at_budget)


def test_a_plan_over_its_limit_is_no_fallback_after_running_out(
        on_cpu, monkeypatch, tuned, cap_at_budget):
    """It ran, within the budget but over its limit: where the plan after it
    runs out of memory and no plan fits what that showed, the error is the
    user's, not a return to a plan that may run out later."""
    from keras_autovm import oom
    monkeypatch.setattr(oom, "overhead_after_oom", lambda plan, plans, memory: 100.0)
    no_least(monkeypatch)
    seen = watch(on_cpu, monkeypatch, fail=lambda n: n == 2,
                 peak=lambda n, plan, measured: cap_at_budget - FILLED_WITHIN // 2)
    with pytest.raises(keras_autovm.PlanError, match="ran out of GPU memory"):
        train(policy="auto", budget=cap_at_budget)
    assert len(seen) == 2
    # What it learnt is kept: the next fit is refused before any step.
    with pytest.raises(keras_autovm.PlanError, match="kept by an earlier fit"):
        train(policy="auto", budget=cap_at_budget)
    assert len(seen) == 2


def test_over_the_budget_after_the_retries_training_goes_on_and_says_so(
        on_cpu, monkeypatch, tuned, said):
    monkeypatch.setattr(on_cpu, "RETRIES", 1)  # The small CNN has few plans.
    budget = tight_budget()
    seen = watch(on_cpu, monkeypatch, peak=lambda n, plan, measured: budget + 1)
    _, callback = train(policy="auto", budget=budget)
    assert len(seen) == on_cpu.RETRIES + 1
    assert callback._runtime.stats["first_step_replans"] == on_cpu.RETRIES
    kept = [s for s in said if f"Kept: over its limit after {on_cpu.RETRIES} replans" in s]
    assert len(kept) == 1
    # Kept, not measured again, and no fallback: it did not run within its limit.
    assert callback._runtime.fitted_plans == {}
    assert callback.plan.memory_scale < callback._runtime.plans.memory_scale
    assert kept_overhead(callback) == (1.0, 0)  # It trained: nothing kept.


def test_out_of_memory_after_the_retries_is_the_users_error_and_undone(
        on_cpu, monkeypatch, tuned):
    import tensorflow as tf

    from keras_autovm import oom
    monkeypatch.setattr(oom, "overhead_after_oom", lambda plan, plans, memory: 1.0)
    monkeypatch.setattr(oom, "extra_after_oom", lambda plan, memory: 0)
    seen = watch(on_cpu, monkeypatch, fail=lambda n: True)
    keras.utils.set_random_seed(3)
    initial = small_cnn(SIZE).get_weights()
    built = []
    with pytest.raises(tf.errors.ResourceExhaustedError):
        train(policy="auto", budget=tight_budget(), built=built)
    assert len(seen) == on_cpu.RETRIES + 1
    # Each step ran before failing; every one was undone.
    for a, b in zip(built[0].get_weights(), initial):
        np.testing.assert_array_equal(a, b)
    assert int(built[0].optimizer.iterations) == 0


def test_no_plan_that_fits_what_the_step_showed_is_a_plan_error(on_cpu, monkeypatch):
    from keras_autovm import oom
    monkeypatch.setattr(oom, "overhead_after_oom", lambda plan, plans, memory: 10.0)
    no_least(monkeypatch)
    watch(on_cpu, monkeypatch, fail=lambda n: True)
    with pytest.raises(keras_autovm.PlanError) as raised:
        train(policy="auto", budget=tight_budget())
    text = str(raised.value)
    # The first, which tunes cuDNN's convolutions, ran again: the second failed.
    assert text.startswith("AutoVM: the second step under its plan for batch size 8 "
                           "ran out of GPU memory")
    assert text.count("The smallest feasible budget is") == 1
    # What it learnt is kept: the next fit is refused before any step.
    with pytest.raises(keras_autovm.PlanError, match="kept by an earlier fit"):
        train(policy="auto", budget=tight_budget())


@pytest.mark.parametrize("first", ["out of memory", "over its limit"])
def test_where_the_overhead_leaves_no_plan_the_least_plan_runs_and_is_kept(
        on_cpu, monkeypatch, tuned, said, first):
    """The overhead one plan's step showed need not be another's: on an
    H200, VGG-19's `auto` plan peaked 0.71 GiB over its prediction where
    `offload_all`'s trained under its own (results/tensorflow/oversub/).
    So the plan of least predicted peak, made without the overhead, runs
    and is judged by its own step before any `PlanError`."""
    from keras_autovm import oom
    budget = tight_budget()
    monkeypatch.setattr(on_cpu, "_ratio", lambda peak, plan: 100.0)  # Nothing fits.
    monkeypatch.setattr(oom, "overhead_after_oom", lambda plan, plans, memory: 100.0)
    seen = watch(on_cpu, monkeypatch, fail=lambda n: n == 1 and first == "out of memory",
                 peak=lambda n, plan, measured: budget if n == 1 else plan.result.peak_bytes)
    model, callback = train(policy="auto", budget=budget)
    runtime = callback._runtime
    assert len(seen) == 2 and seen[1].actions != seen[0].actions
    assert seen[1].result.peak_bytes < seen[0].result.peak_bytes
    assert "least predicted peak" in seen[1].notes[-1]
    # The same plan, though predicted again where an epoch's replan failed
    # with the times it measured (`AutoVM._keep`).
    assert runtime.stats["least_plan_runs"] == 1
    assert plan_key(runtime.fitted_plans[8]) == plan_key(seen[1])
    assert any("the plan of least predicted peak" in line for line in said)
    assert callback.plan.actions == seen[1].actions
    # Over its limit, the first step stood; out of memory, it ran again.
    assert int(model.optimizer.iterations) == STEPS
    assert kept_overhead(callback) == (1.0, 0)  # It trained: nothing kept.


def test_a_least_plan_kept_at_each_epochs_end_is_said_once(on_cpu, monkeypatch, tuned, said):
    """The overhead stays learnt, so each epoch's replan finds no plan: the
    plan that trains is kept, said once, without a smallest budget."""
    from keras_autovm import callback as callback_lib
    monkeypatch.setattr(callback_lib, "_REPLAN_RATIO", 1.0 + 1e-9)  # Replan each epoch.
    monkeypatch.setattr(on_cpu, "_ratio", lambda peak, plan: 100.0)  # Nothing fits.
    budget = tight_budget()
    seen = watch(on_cpu, monkeypatch, peak=lambda n, plan, measured:
                 budget if n == 1 else plan.result.peak_bytes)
    model, _ = train(policy="auto", budget=budget, epochs=3)
    assert len(seen) == 2 and int(model.optimizer.iterations) == 3 * STEPS
    kept = [line for line in said if line.startswith("AutoVM kept its plan")]
    assert len(kept) == 1 and "ran within its limit" in kept[0]
    assert not any("smallest feasible" in line for line in said)


def test_the_least_plan_over_its_limit_is_a_plan_error_that_names_its_step(
        on_cpu, monkeypatch, tuned):
    monkeypatch.setattr(on_cpu, "_ratio", lambda peak, plan: 100.0)  # Nothing fits.
    budget = tight_budget()
    seen = watch(on_cpu, monkeypatch, peak=lambda n, plan, measured: budget)
    with pytest.raises(keras_autovm.PlanError) as raised:
        train(policy="auto", budget=budget)
    assert len(seen) == 2 and "least predicted peak" in seen[1].notes[-1]
    text = str(raised.value)
    assert text.startswith("AutoVM: the first step under its plan for batch size 8 "
                           "peaked at") and "over its limit" in text
    plan = f"plan: {keras_autovm.planner.format_bytes(seen[1].result.peak_bytes)}"
    assert plan in text  # The least plan's step, not the first plan's.
    # Tried once: what it learnt is kept, and the next fit is refused.
    with pytest.raises(keras_autovm.PlanError, match="kept by an earlier fit"):
        train(policy="auto", budget=budget)
    assert len(seen) == 2


def test_a_least_plan_far_under_its_limit_is_measured_too(on_cpu, monkeypatch, tuned):
    """Plans predicted under 1/`TIGHT` of their limit are not measured; a
    least plan is, since the overhead learnt says it may not fit."""
    monkeypatch.setattr(on_cpu, "TIGHT", 1.5)
    monkeypatch.setattr(on_cpu, "_ratio", lambda peak, plan: 100.0)  # Nothing fits.
    budget = tight_budget()
    seen = watch(on_cpu, monkeypatch, peak=lambda n, plan, measured: budget)
    with pytest.raises(keras_autovm.PlanError, match="over its limit"):
        train(policy="auto", budget=budget)
    limit = budget * (1 - seen[0].headroom)
    assert len(seen) == 2 and seen[1].result.peak_bytes * on_cpu.TIGHT < limit
    assert seen[0].result.peak_bytes * on_cpu.TIGHT > limit


def test_the_least_plan_is_not_run_again_where_it_is_the_plan_that_failed(
        on_cpu, monkeypatch, tuned):
    from keras_autovm.budget import PlanBook
    monkeypatch.setattr(on_cpu, "_ratio", lambda peak, plan: 100.0)  # Nothing fits.
    budget = tight_budget()
    seen = watch(on_cpu, monkeypatch, peak=lambda n, plan, measured: budget)
    monkeypatch.setattr(PlanBook, "least", lambda self, batch_size: seen[-1])
    with pytest.raises(keras_autovm.PlanError, match="over its limit"):
        train(policy="auto", budget=budget)
    assert len(seen) == 1


@pytest.mark.parametrize("second", ["out of memory", "over its limit"])
def test_no_plan_after_the_next_plans_first_step_goes_back_to_one_that_ran(
        on_cpu, monkeypatch, tuned, said, second):
    """The second epoch's plan (made with a larger overhead, as a replan at
    an epoch's end is) runs out of memory, or runs over its limit, and no
    plan fits what it showed: the plan measured within its limit in the
    first epoch comes back."""
    from keras_autovm import oom
    budget = tight_budget()
    if second == "out of memory":
        monkeypatch.setattr(oom, "overhead_after_oom", lambda plan, plans, memory: 10.0)
        seen = watch(on_cpu, monkeypatch, peak=fits, fail=lambda n: n == 2)
    else:
        monkeypatch.setattr(on_cpu, "_ratio", lambda peak, plan: 100.0)  # Nothing fits.
        seen = watch(on_cpu, monkeypatch, peak=lambda n, plan, measured:
                     budget if n == 2 else plan.result.peak_bytes)

    model, callback = train(policy="auto", budget=budget, epochs=2,
                            callbacks=[replan_after_first_epoch(monkeypatch, seen)])
    assert len(seen) == 2 and seen[1].actions != seen[0].actions
    counter = "out_of_memory_replans" if second == "out of memory" else "first_step_replans"
    assert callback._runtime.stats[counter] == 1
    assert any("back to the plan measured within its limit" in line for line in said)
    assert callback._runtime.current.plan.actions == seen[0].actions
    assert int(model.optimizer.iterations) == 2 * STEPS
    # It trained, on the plan that ran: nothing is kept for the next fit.
    assert not os.path.exists(callback._learnt_at[0])


def dict_input_cnn(size):
    inputs = {"image": keras.Input((size, size, 3), name="image")}
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c1")(inputs["image"])
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c2")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(x))


def test_swap_plans_and_dict_inputs_are_measured(on_cpu, monkeypatch):
    monkeypatch.setattr(on_cpu, "TIGHT", float("inf"))
    seen = watch(on_cpu, monkeypatch)
    train(policy="offload_all")
    assert len(seen) == 1 and seen[0].counts()["swap"] > 0
    train(model_fn=dict_input_cnn)
    assert len(seen) == 2


def test_loose_plans_several_steps_a_call_and_no_gpu_are_not_measured(
        on_cpu, monkeypatch):
    seen = watch(on_cpu, monkeypatch)
    train(policy="sqrt_recompute", budget=2**30)  # Fits twice over and more.
    monkeypatch.setattr(on_cpu, "TIGHT", float("inf"))
    train(steps_per_execution=2)
    monkeypatch.setattr(on_cpu, "device", lambda: None)
    train()
    assert seen == []


def test_a_plan_that_would_not_fit_under_xla_runs_without_it_and_says_so(
        on_cpu, monkeypatch):
    said = []
    monkeypatch.setattr(keras_autovm.callback.console_lib.Console, "print",
                        lambda self, text: said.append(text))
    seen = watch(on_cpu, monkeypatch)
    monkeypatch.setattr(on_cpu, "TIGHT", float("inf"))
    monkeypatch.setattr(on_cpu, "XLA_OVERHEAD", float("inf"))  # Never fits under XLA.
    model, _ = train(jit_compile=True)
    assert seen.jit == [False] and model.jit_compile  # Given back after `fit`.
    assert any("AutoVM set jit_compile=False: under XLA its plan" in line
               for line in said)
    # Fits under XLA: XLA stays, and the first step is measured under it.
    monkeypatch.setattr(on_cpu, "XLA_OVERHEAD", 0.0)
    said.clear()
    train(jit_compile=True)
    assert not [line for line in said if "jit_compile" in line]
    assert seen.jit == [False, True]


def test_out_of_memory_under_xla_is_not_undone_and_says_why(on_cpu, monkeypatch):
    import tensorflow as tf
    seen = watch(on_cpu, monkeypatch, fail=lambda n: True, runs=False)
    restored = []
    monkeypatch.setattr(on_cpu, "_restore", lambda saved, model: restored.append(1))
    monkeypatch.setattr(on_cpu, "TIGHT", float("inf"))
    monkeypatch.setattr(on_cpu, "XLA_OVERHEAD", 0.0)  # XLA stays on.
    built = []
    with pytest.raises(tf.errors.ResourceExhaustedError, match="jit_compile=False"):
        train(jit_compile=True, built=built)
    assert seen.jit == [True] and not restored
    assert built[0].call.__func__ is type(built[0]).call  # AutoVM's changes undone.
