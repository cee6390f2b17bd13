"""The memory overhead a fit learns is kept for the next fit of the same
model, batch size and budget (`keras_autovm.learnt`)."""

import dataclasses
import json
import os
import warnings

import keras
import pytest
from conftest import data
from conftest import kept_overhead
from conftest import small_cnn

import keras_autovm
from keras_autovm import learnt
from keras_autovm import mechanisms
from keras_autovm import profiling
from keras_autovm.budget import PlanBook
from keras_autovm.planner import CostModel
from keras_autovm.profile_cache import cache_path
from keras_autovm.profile_cache import learnt_path

GIB = 2**30


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_AUTOVM_CACHE_DIR", str(tmp_path))
    return tmp_path


KEY = learnt.key(GIB, 0.05, "auto", False)


def test_what_is_kept_is_recalled_under_its_key_only(tmp_path):
    path = str(tmp_path / "m.learnt.json")
    assert learnt.recall(path, KEY) == learnt.NOTHING
    learnt.keep(path, KEY, 1.25, 4096)
    other = learnt.key(2 * GIB, 0.05, "auto", False)
    learnt.keep(path, other, 1.5, 0)
    assert learnt.recall(path, KEY) == (1.25, 4096)
    assert learnt.recall(path, other) == (1.5, 0)
    for key in (learnt.key(GIB, 0.15, "auto", False), learnt.key(GIB, 0.05, "swap", False),
                learnt.key(GIB, 0.05, "auto", True)):
        assert learnt.recall(path, key) == learnt.NOTHING
    learnt.forget(path)
    learnt.forget(path)  # Nothing there: no error.
    assert learnt.recall(path, KEY) == learnt.NOTHING
    assert os.listdir(tmp_path) == []  # No temporary file left.


@pytest.mark.parametrize("entry", [[0.5, 0], [1.2, -1], ["nan", 0], [1.2, "inf"], [1.2], "1.2"])
def test_a_damaged_entry_recalls_nothing(tmp_path, entry):
    path = tmp_path / "m.learnt.json"
    path.write_text(json.dumps({"format": 1, "learnt": {KEY: entry}}))
    assert learnt.recall(str(path), KEY) == learnt.NOTHING


@pytest.mark.parametrize("text", [
    "not json", json.dumps({"format": 999, "learnt": {KEY: [1.2, 0]}}),
    json.dumps({"format": 1, "learnt": []})])
def test_a_damaged_file_recalls_nothing(tmp_path, text):
    path = tmp_path / "m.learnt.json"
    path.write_text(text)
    assert learnt.recall(str(path), KEY) == learnt.NOTHING


def book(remember=None):
    return PlanBook(small_cnn(), GIB, 0.05, "auto", CostModel(), mechanisms.get(),
                    remember=remember)


def test_a_plan_book_learns_upwards_and_tells_only_when_asked_to_keep():
    told = []
    plans = book(lambda *overhead: told.append(overhead))
    plans.learn(1.2, 100)
    plans.learn(1.1, 50)  # Less than learnt: nothing changes.
    plans.learn(1.0, 200)
    assert (plans.memory_scale, plans.memory_extra) == (1.2, 200)
    assert told == []
    plans.keep_learnt()
    assert told == [(1.2, 200)]
    book().keep_learnt()  # No `remember`: nothing to tell.


def test_the_least_plan_is_made_without_the_learnt_overhead():
    """What a mechanism that measures steps may run where the overhead one
    plan's step showed leaves no plan (`PlanBook.least`)."""
    from keras_autovm import budget as budget_lib
    from keras_autovm import planner
    plans = book()
    first = plans.plan(8)
    plans.learn(1e6)  # Nothing fits now.
    with pytest.raises(planner.PlanError):
        plans.plan(8)
    least = plans.least(8)
    graph = plans._graphs[(8, None)]
    cost = budget_lib.planning_cost(plans.cost, plans.mechanism)
    with pytest.raises(planner.PlanError) as raised:  # Its figure for the least.
        planner.make_plan(graph, 1, cost=cost, allowed=plans.mechanism.auto_actions())
    assert least.result.peak_bytes == raised.value.min_budget
    assert least.result.peak_bytes < first.result.peak_bytes
    assert (least.memory_scale, least.device_budget, least.headroom) == (1e6, GIB, 0.05)
    assert "least predicted peak" in least.notes[-1]
    plans.budget_bytes = least.result.peak_bytes  # Less the headroom, under it.
    assert plans.least(8) is None


def test_a_keeper_writes_what_changed(tmp_path):
    path = str(tmp_path / "m.learnt.json")
    remember = learnt.keeper(path, KEY, recalled=(1.1, 0))
    remember(1.1, 0)  # What was recalled: nothing written.
    assert not os.path.exists(path)
    remember(1.3, 7)
    assert learnt.recall(path, KEY) == (1.3, 7)
    remember(1.0, 0)  # Less than before: the last writer wins.
    assert learnt.recall(path, KEY) == learnt.NOTHING


def test_putting_a_plan_in_force_keeps_nothing(cache):
    callback = fit(autovm())
    runtime, told = callback._runtime, []
    runtime.plans.memory_scale = 1.5
    runtime.plans.remember = lambda *overhead: told.append(overhead)
    assert runtime.plan_for(4).plan.memory_scale == 1.5
    assert told == []


def test_a_cache_it_cannot_write_is_said_once(tmp_path):
    (tmp_path / "file").write_text("")
    remember = learnt.keeper(str(tmp_path / "file" / "m.learnt.json"), KEY)
    with pytest.warns(UserWarning, match="could not keep the memory overhead"):
        remember(1.3, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remember(1.4, 7)


def test_a_profile_measured_again_forgets_what_was_learnt(cache):
    model, mechanism = small_cnn(), mechanisms.get()
    path = learnt_path(cache_path(mechanism.device_name(), mechanism.backend,
                                  profiling.fingerprint(model), 8))
    learnt.keep(path, KEY, 1.2, 0)
    _, measured = profiling.obtain(model, 8, mechanism)
    assert measured and not os.path.exists(path)
    learnt.keep(path, KEY, 1.2, 0)
    _, measured = profiling.obtain(model, 8, mechanism)  # From the cache.
    assert not measured and learnt.recall(path, KEY) == (1.2, 0)


def test_a_profile_measured_again_at_a_larger_batch_keeps_it(cache):
    """Timed at a smaller batch under a tighter limit, then again with
    room: the model is the same, and so is what its steps showed."""
    from keras_autovm.model_graph import build_graph
    model, mechanism = small_cnn(), mechanisms.get()
    one = build_graph(model, 1)
    tight = one.persistent_bytes + 2 * sum(t.nbytes for t in one.tensors) * 3
    path = learnt_path(cache_path(mechanism.device_name(), mechanism.backend,
                                  profiling.fingerprint(model), 8))
    first, _ = profiling.obtain(model, 8, mechanism, limit_bytes=tight)
    learnt.keep(path, KEY, 1.2, 0)
    roomy, measured = profiling.obtain(model, 8, mechanism)
    assert measured and roomy.batch_size > first.batch_size
    assert learnt.recall(path, KEY) == (1.2, 0)


def fit(callback, *others):
    keras.utils.set_random_seed(7)
    model = small_cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    x, y = data(16)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback, *others])
    return callback


class Stops(keras.callbacks.Callback):
    """After the first step, has `autovm` learn `overhead` and stop the fit
    with `error`, as a replan that finds no plan for what a step showed
    does (the training function and the hooks are guarded alike)."""

    def __init__(self, autovm, overhead=(1.25, 3 * 2**20), error=None):
        super().__init__()
        self.autovm, self.overhead = autovm, overhead
        self.error = error or keras_autovm.PlanError("No plan fits.", 1)

    def on_train_batch_end(self, batch, logs=None):
        self.autovm._runtime.plans.learn(*self.overhead)
        raise self.error


def stopped(callback, **kwargs):
    """`callback` after a fit that `Stops` stopped."""
    error = kwargs.get("error")
    with pytest.raises(type(error) if error else keras_autovm.PlanError):
        fit(callback, Stops(callback, **kwargs))
    return callback


def autovm(**kwargs):
    kwargs.setdefault("budget", "1GiB")
    return keras_autovm.AutoVM(verbose=0, apply_without_gpu=True, **kwargs)


def test_the_next_fit_plans_with_what_a_fit_that_found_no_plan_learnt(cache):
    first = stopped(autovm())
    assert first._patches.closed and isinstance(first._patches.error, keras_autovm.PlanError)
    assert kept_overhead(first) == (1.25, 3 * 2**20)
    second = fit(autovm())
    assert (second.plan.memory_scale, second.plan.memory_extra) == (1.25, 3 * 2**20)
    assert second.report.stats["recalled_memory_scale"] == 1.25
    for other in (autovm(budget="2GiB"), autovm(policy="sqrt_recompute")):
        fit(other)  # Another budget or policy learnt nothing.
        assert (other.plan.memory_scale, other.plan.memory_extra) == learnt.NOTHING
        assert "recalled_memory_scale" not in other.report.stats


def test_with_no_profile_or_a_given_one_nothing_is_kept(cache):
    first = fit(autovm())  # Its profile is the cache's from now on.
    for setting in (None, first.measured):
        stopped(autovm(profile=setting))
    assert not [n for n in os.listdir(cache) if n.endswith(".learnt.json")]
    assert fit(autovm()).plan.memory_scale == 1.0


def test_an_overhead_no_plan_meets_fails_before_training_and_says_whence(cache):
    stopped(autovm(), overhead=(1.0, 2 * GIB))  # More than the whole budget.
    with pytest.raises(keras_autovm.PlanError, match="kept by an earlier fit") as caught:
        fit(autovm())
    assert ".learnt.json; delete that file" in str(caught.value)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), MemoryError("host")])
def test_a_fit_stopped_by_anything_else_keeps_nothing(cache, error):
    assert kept_overhead(stopped(autovm(), error=error)) == learnt.NOTHING


def test_a_fit_that_trains_leaves_what_was_kept_as_it_was(cache):
    """It recalled 1.25x and learnt more, then trained: the next fit
    plans as it did, from 1.25x (`keras_autovm.learnt`)."""
    first = stopped(autovm())
    second = autovm()
    fit(second, Learns(second, (1.5, 0)))
    assert second._runtime.plans.memory_scale == 1.5
    assert kept_overhead(second) == (1.25, 3 * 2**20)
    fresh = stopped(autovm(budget="2GiB"), overhead=(1.0, 0))  # Learnt nothing.
    assert kept_overhead(fresh) == learnt.NOTHING and kept_overhead(first) == (1.25, 3 * 2**20)


class Learns(keras.callbacks.Callback):
    def __init__(self, autovm, overhead):
        super().__init__()
        self.autovm, self.overhead = autovm, overhead

    def on_train_batch_end(self, batch, logs=None):
        self.autovm._runtime.plans.learn(*self.overhead)


def test_an_epoch_that_peaked_over_its_plan_in_a_fit_that_trained_keeps_nothing(
        cache, monkeypatch):
    callback = autovm()
    mechanism = type(mechanisms.get())
    with monkeypatch.context() as patch:  # Each epoch peaks 1.2x its plan.
        patch.setattr(mechanism, "reset_peak", lambda self: True)
        patch.setattr(mechanism, "peak_memory",
                      lambda self: int(callback.plan.result.peak_bytes * 1.2))
        fit(callback)
    assert callback._runtime.plans.memory_scale == pytest.approx(1.2, rel=0.01)
    assert kept_overhead(callback) == learnt.NOTHING
    assert fit(autovm()).plan.memory_scale == 1.0


@pytest.mark.parametrize("faster", [True, False])
def test_a_replan_at_an_epochs_end_keeps_nothing(cache, monkeypatch, faster):
    """An epoch that peaked 1.5x its plan, within the budget: a replan made
    with that overhead, taken or declined (`AutoVM._stayed`), in a fit
    that goes on."""
    callback = fit(autovm())
    plan, plans = callback.plan, callback._runtime.plans
    first, action = next(iter(plan.actions.items()))
    actions = dict(plan.actions, **{first: "keep" if action != "keep" else "recompute"})
    step = plan.result.step_time * (0.5 if faster else 2)
    new = dataclasses.replace(plan, actions=actions, memory_scale=1.5,
                              result=dataclasses.replace(plan.result, step_time=step))
    with monkeypatch.context() as patch:
        patch.setattr(plans, "plan", lambda batch_size: new)
        patch.setattr(keras_autovm.callback.patches_lib, "retrace", lambda *args: None)
        callback._calibrate(None, int(plan.result.peak_bytes * 1.5), plan)
    assert plans.memory_scale == pytest.approx(1.5)
    assert callback._runtime.stats.get("replans_declined", 0) == (not faster)
    assert kept_overhead(callback) == learnt.NOTHING


def test_a_replan_that_fails_keeps_nothing(cache, monkeypatch):
    callback = fit(autovm())

    def fail(batch_size):
        raise keras_autovm.PlanError("no plan", 1)

    monkeypatch.setattr(callback._runtime.plans, "plan", fail)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        callback._calibrate(None, int(callback.plan.result.peak_bytes * 1.5), callback.plan)
    assert kept_overhead(callback) == learnt.NOTHING
