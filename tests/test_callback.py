import dataclasses
import warnings

import keras
import numpy as np
import pytest

import keras_autovm
from conftest import BACKEND, data, skip_model, small_cnn

# JAX swaps through host copies in an unjitted step; TensorFlow through explicit host
# copies (host to host on a CPU, so the plumbing and numbers are checked
# here; tests/test_tf_swap.py has more, and the page-moving mode); torch
# through saved-tensor hooks and a host pool.


def train(model_fn, callbacks=(), epochs=2, batch_size=8):
    keras.utils.set_random_seed(7)
    model = model_fn()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    x, y = data(32)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False,
              callbacks=list(callbacks), verbose=0)
    return model


def autovm(**kwargs):
    kwargs.setdefault("budget", "1GiB")
    return keras_autovm.AutoVM(verbose=0, apply_without_gpu=True, **kwargs)


def assert_same_weights(a, b, exact):
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        if exact:
            np.testing.assert_array_equal(wa, wb)
        else:
            np.testing.assert_allclose(wa, wb, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("model_fn", [small_cnn, skip_model])
def test_recompute_trains_like_without_autovm(model_fn):
    reference = train(model_fn)
    callback = autovm(policy="sqrt_recompute")
    model = train(model_fn, [callback])
    counts = callback.report.plan.counts()
    assert counts["recompute"] > 0, counts
    stats = callback.report.stats
    if BACKEND == "jax":
        assert stats["checkpointed_traces"] > 0, stats
    else:
        # Each segment ran in forward and was replayed in backward.
        assert stats["segments_run"] > 0 and stats["segments_replayed"] > 0, stats
    assert_same_weights(reference, model, exact=False)


@pytest.mark.parametrize("model_fn", [small_cnn, skip_model])
@pytest.mark.parametrize("policy", ["offload_all", "sqrt_offload"])
def test_swap_trains_like_without_autovm(model_fn, policy, swap_small_tensors):
    reference = train(model_fn)
    callback = autovm(policy=policy)
    model = train(model_fn, [callback])
    swaps = callback.report.plan.counts()["swap"]
    assert swaps > 0
    stats = callback.report.stats
    if BACKEND == "jax":
        # Eager steps with host copies (tests/test_jax_swap.py has more).
        assert stats["eager_steps"] > 0 and stats["bytes_freed"] > 0, stats
    elif BACKEND == "tensorflow":
        # Every swapped tensor was copied to the host; the backward reads
        # copies brought back.
        assert stats["host_copies"] >= swaps, stats
        assert stats["copy_backs"] > 0 and stats["reads_rewired"] > 0, stats
    else:
        # Copied out and back, and the device copies freed in the forward.
        assert stats["bytes_to_host"] > 0 and stats["bytes_to_device"] > 0, stats
        assert stats["bytes_freed_early"] >= stats["bytes_to_host"], stats
    # Copying to the host and back changes no number (JAX: the reference is
    # jitted, the swap step is not; tests/test_jax_swap.py compares eager).
    assert_same_weights(reference, model, exact=BACKEND != "jax")


def test_auto_under_a_tight_budget_fits_and_trains():
    model = small_cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    keep = keras_autovm.plan(model, 8, budget=2**40, policy="keep_all")
    # Below keep-all's least peak: with outputs freed early, not as torch's
    # unchanged step holds them.
    budget = int(keras_autovm.planner.simulate(keep.graph, cost=keep.cost).peak_bytes * 0.97)
    callback = autovm(budget=budget)
    reference = train(small_cnn)
    trained = train(small_cnn, [callback])
    plan = callback.report.plan
    assert plan.result.peak_bytes <= budget
    assert plan.counts()["keep"] < len(plan.actions)
    assert_same_weights(reference, trained, exact=False)


def test_budget_below_feasible_minimum_fails_before_training(monkeypatch):
    # Before timing layers too: on a GPU under a tight cap, the timing pass
    # ran out of memory before the PlanError could name the budget.
    from keras_autovm import profiling
    timed = []
    obtain = profiling.obtain
    monkeypatch.setattr(profiling, "obtain",
                        lambda *a, **k: timed.append(1) or obtain(*a, **k))
    with pytest.raises(keras_autovm.PlanError, match="smallest feasible budget"):
        train(small_cnn, [autovm(budget=1000, profile="auto", batch_size=8)])
    assert not timed


def test_model_is_restored_after_training():
    callback = autovm(policy="sqrt_recompute")
    model = train(small_cnn, [callback])
    assert "call" not in model.__dict__
    x, _ = data(4)
    before = model.predict(x, verbose=0)
    model.fit(*data(8), epochs=1, verbose=0)  # Reuse works without AutoVM.
    model.fit(*data(8), epochs=1, verbose=0, callbacks=[callback])
    assert not np.array_equal(before, model.predict(x, verbose=0))


def test_no_gpu_warns_and_changes_nothing():
    if keras_autovm.mechanisms.get().gpu_available():
        pytest.skip("a GPU is present")
    reference = train(small_cnn)
    callback = keras_autovm.AutoVM(budget="1MiB", verbose=0)
    # Recorded, not pytest.warns: torch's numpy interop warns here as well.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = train(small_cnn, [callback])
    assert any(w.category is UserWarning and "no GPU" in str(w.message)
               for w in caught)
    assert callback.report is None
    assert_same_weights(reference, model, exact=True)


@pytest.mark.parametrize("budget", [None, 0.5])
def test_relative_budget_without_gpu_fails_before_training(budget):
    # docs/api.md, Budgets: applied without a GPU, AutoVM has no device
    # memory for `None` (all of it) or a fraction to refer to.
    if keras_autovm.mechanisms.get().gpu_available():
        pytest.skip("a GPU is present")
    model = small_cnn()
    model.compile(optimizer="sgd", loss="mse")
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="no GPU was found. Pass an absolute budget"):
        model.fit(*data(8), epochs=1, verbose=0,
                  callbacks=[keras_autovm.AutoVM(budget=budget, apply_without_gpu=True)])
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)  # Nothing was trained.


@pytest.mark.parametrize("kwargs, match", [
    ({"budget": "16 gigs"}, "budget='16 gigs'"),
    ({"budget": -1}, "budget=-1"),
    ({"budget": 2.0}, "budget=2.0"),
    ({"policy": "magic"}, "policy='magic'"),
    ({"verbose": 3}, "verbose=3"),
    ({"profile_steps": 0}, "profile_steps=0"),
])
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        keras_autovm.AutoVM(**kwargs)


def test_report_is_written(tmp_path):
    callback = autovm(policy="sqrt_recompute", report_dir=str(tmp_path))
    train(small_cnn, [callback])
    assert (tmp_path / "report.json").stat().st_size > 0
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert len(callback.report.epochs) == 2
    lines = []
    callback.report.summary(print_fn=lines.append)
    text = "\n".join(lines)
    assert "recompute" in text and "AutoVM epoch 2" in text


def ops_model():
    """A functional model with raw keras.ops calls between layers."""
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", name="c1")(inputs)
    x = keras.ops.relu(x) * 2.0
    x = keras.layers.Conv2D(8, 3, padding="same", name="c2")(x)
    x = keras.layers.ReLU(name="r2")(x)
    x = keras.layers.Conv2D(8, 3, padding="same", name="c3")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(x))


def prewrapped_model():
    """A model built from AutoVMWrappers, as the wrapper's docstring shows."""
    wrap = keras_autovm.AutoVMWrapper
    inputs = keras.Input((16, 16, 3))
    x = wrap(keras.layers.Conv2D(8, 3, padding="same", name="c1"))(inputs)
    x = wrap(keras.layers.ReLU(name="r1"))(x)
    x = wrap(keras.layers.Conv2D(8, 3, padding="same", name="c2"))(x)
    x = wrap(keras.layers.ReLU(name="r2"))(x)
    x = wrap(keras.layers.Conv2D(8, 3, padding="same", name="c3"))(x)
    x = wrap(keras.layers.GlobalAveragePooling2D(name="gap"))(x)
    return keras.Model(inputs, wrap(keras.layers.Dense(4, name="head"))(x))


@pytest.mark.parametrize("model_fn", [ops_model, prewrapped_model])
def test_unusual_functional_models_train_like_without_autovm(model_fn):
    reference = train(model_fn)
    callback = autovm(policy="sqrt_recompute")
    model = train(model_fn, [callback])
    assert callback.report.plan.counts()["recompute"] > 0
    if BACKEND != "jax":
        assert callback.report.stats["segments_replayed"] > 0
    assert_same_weights(reference, model, exact=False)


def test_failed_fit_leaves_the_model_usable():
    model = small_cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    x, y = data(16)
    with pytest.raises(keras_autovm.PlanError):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[autovm(budget=1000)])
    assert "call" not in model.__dict__ and "train_step" not in model.__dict__
    model.fit(x, y, batch_size=8, verbose=0)  # Plain training works again.


def test_subclassed_model_trains_unchanged_with_one_line():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(4)

        def call(self, x):
            return self.dense(keras.ops.mean(x, axis=(1, 2)))

    model = Net()
    model.compile(optimizer="sgd", loss="mse")
    x, y = data(8)
    callback = autovm()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, verbose=0, callbacks=[callback])
    assert any("leaves the model unchanged" in str(w.message)
               and "subclassed" in str(w.message) for w in caught)
    assert callback.report is None and callback.plan is None


def test_failed_replan_keeps_the_plan_in_use(monkeypatch):
    callback = autovm(policy="sqrt_recompute")
    train(small_cnn, [callback], epochs=1)
    # As if mid-training: the runtime holds the plan the traced step uses.
    plan = callback.plan

    def fail(batch_size):
        raise keras_autovm.PlanError("no plan", 1)

    monkeypatch.setattr(callback._runtime.plans, "plan", fail)
    retraces = []
    monkeypatch.setattr(keras_autovm.callback.patches_lib, "retrace",
                        lambda *args: retraces.append(args))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not callback._calibrate(plan.result.step_time * 10, None, plan)
    assert any("kept its plan" in str(w.message) for w in caught)
    # The same actions, nothing traced again; predicted with the times
    # just measured.
    assert callback.plan.actions == plan.actions and not retraces
    assert callback.plan.result.step_time == pytest.approx(plan.result.step_time * 10,
                                                           rel=0.05)


def replan_to(callback, monkeypatch, step_time):
    """After a fit: the next replan gives a plan with other actions,
    predicted at `step_time`; retraces are counted, not made."""
    plan, plans = callback.plan, callback._runtime.plans
    first, action = next(iter(plan.actions.items()))
    other = dict(plan.actions, **{first: "keep" if action != "keep" else "recompute"})
    new = dataclasses.replace(plan, actions=other,
                              result=dataclasses.replace(plan.result, step_time=step_time))
    monkeypatch.setattr(plans, "plan", lambda batch_size: new)
    retraces = []
    monkeypatch.setattr(keras_autovm.callback.patches_lib, "retrace",
                        lambda *args: retraces.append(args))
    return plan, new, retraces


@pytest.mark.parametrize("timed", [True, False])
@pytest.mark.parametrize("faster", [False, True])
def test_a_plan_that_ran_within_the_budget_gives_way_only_to_a_faster_one(
        monkeypatch, faster, timed):
    """Faster than it is now predicted: with the cost scaled to its measured
    steps or, where none was timed (TensorFlow's first steps of a plan
    compile), with the cost it was planned with."""
    callback = autovm(policy="sqrt_recompute")
    train(small_cnn, [callback], epochs=1)
    predicted = callback.plan.result.step_time
    measured = predicted * 10 if timed else None  # Far off: a replan is due.
    plan, new, retraces = replan_to(callback, monkeypatch,
                                    (measured or predicted) * (0.5 if faster else 2))
    peak = callback._runtime.plans.budget_bytes  # Over the limit, within the budget.
    assert callback._calibrate(measured, peak, plan) is faster
    assert callback.plan.actions == (new if faster else plan).actions
    assert len(retraces) == faster
    assert callback._runtime.stats.get("replans_declined", 0) == (not faster)
    # What was learnt stays for other plans.
    assert callback._runtime.plans.memory_scale > 1


def test_a_plan_that_stays_is_calibrated_once(monkeypatch):
    """It stays with what it is now predicted to cost: the same measured
    step time does not scale the cost again at the next epoch's end."""
    callback = autovm(policy="sqrt_recompute")
    train(small_cnn, [callback], epochs=1)
    measured = callback.plan.result.step_time * 10
    plan, _, retraces = replan_to(callback, monkeypatch, measured * 2)
    plans, peak = callback._runtime.plans, callback._runtime.plans.budget_bytes
    assert not callback._calibrate(measured, peak, plan)
    scaled = plans.cost
    assert callback.plan.actions == plan.actions
    assert callback.plan.result.step_time == pytest.approx(measured, rel=0.05)
    assert not callback._calibrate(measured, peak, callback.plan)
    assert plans.cost == scaled and not retraces
    assert callback._runtime.stats["replans_declined"] == 1


def test_a_plan_whose_epoch_filled_the_allocator_gives_way(monkeypatch):
    callback = autovm(policy="sqrt_recompute")
    train(small_cnn, [callback], epochs=1)
    measured = callback.plan.result.step_time * 10
    plan, new, retraces = replan_to(callback, monkeypatch, measured * 2)
    monkeypatch.setattr(type(callback._mechanism), "device_memory",
                        lambda self: callback._runtime.plans.budget_bytes)
    assert callback._calibrate(measured, callback._runtime.plans.budget_bytes, plan)
    assert callback.plan.actions == new.actions and len(retraces) == 1


def test_a_plan_over_the_budget_gives_way_to_a_slower_one(monkeypatch):
    callback = autovm(policy="sqrt_recompute")
    train(small_cnn, [callback], epochs=1)
    measured = callback.plan.result.step_time * 10
    plan, new, retraces = replan_to(callback, monkeypatch, measured * 2)
    assert callback._calibrate(measured, callback._runtime.plans.budget_bytes + 1, plan)
    assert callback.plan.actions == new.actions and len(retraces) == 1


def test_a_replan_only_tracing_could_accept_keeps_the_plan_in_use(monkeypatch):
    """A replan the planner refuses, whose step only tracing could check
    (`Plan.refused`, JAX), is a failed replan: the plan that runs stays."""
    callback = autovm(policy="sqrt_recompute")
    train(small_cnn, [callback], epochs=1)
    plan, plans = callback.plan, callback._runtime.plans
    before = plans.cost, plans.memory_scale
    refused = dataclasses.replace(plan, refused=keras_autovm.PlanError("none fits", 1))
    monkeypatch.setattr(plans, "plan", lambda batch_size: refused)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not callback._calibrate(plan.result.step_time * 10, None, plan)
    assert any("kept its plan" in str(w.message) and "none fits" in str(w.message)
               for w in caught)
    # The plan that runs, predicted with the times just measured; the
    # memory overhead it was planned with.
    assert callback.plan.actions == plan.actions and callback.plan.refused is None
    assert plans.cost != before[0] and plans.memory_scale == before[1]
    assert callback.plan.result.step_time == pytest.approx(plan.result.step_time * 10,
                                                           rel=0.05)
