"""JAX: what XLA's compiled step needs, read before it runs: a keep-all plan
runs Keras's own step where that fits, and a plan it does not fit is made
again (as on a GPU)."""

import keras
import numpy as np
import pytest

import keras_autovm
from conftest import BACKEND, data, small_cnn

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="JAX's compiled step")


def train(callbacks=()):
    keras.utils.set_random_seed(7)
    model = small_cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(*data(32), batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=list(callbacks))
    return model


def keep_all(budget):
    return keras_autovm.AutoVM(budget=budget, policy="keep_all", headroom=0.0,
                               verbose=0, apply_without_gpu=True)


def assert_same_weights(a, b):
    for x, y in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_array_equal(x, y)


def test_keep_all_runs_unchanged_where_xlas_step_fits():
    reference = train()
    callback = keep_all("1GiB")
    model = train([callback])
    plan, stats = callback.plan, callback.report.stats
    assert plan.unchanged and "memory analysis" in plan.notes[-1]
    # The peak is XLA's, not the planner's keep-all figure (which on a CPU
    # is about half of it for this model).
    simulated = keras_autovm.planner.simulate(plan.graph, cost=plan.cost).peak_bytes
    assert plan.result.peak_bytes != simulated
    assert stats["unchanged_traces"] >= 1
    assert stats["unchanged_check_s"] > 0
    # Keras's own compiled step: the same numbers exactly.
    assert_same_weights(reference, model)


def test_keep_all_checkpoints_layers_where_xlas_step_does_not_fit():
    first = keep_all("1GiB")
    train([first])
    xla = first.plan.result.peak_bytes
    simulated = keras_autovm.planner.simulate(first.plan.graph,
                                              cost=first.plan.cost).peak_bytes
    assert simulated < xla  # What makes a budget between them possible.
    callback = keep_all((simulated + xla) // 2)
    model = train([callback])
    assert not callback.plan.unchanged and callback.plan.policy == "keep_all"
    assert callback.report.stats["unchanged_traces"] == 0
    assert callback.report.stats["unchanged_check_s"] > 0
    # Per-layer checkpoints recompute inside layers: close, not bit-equal.
    for x, y in zip(train().get_weights(), model.get_weights()):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.fixture
def checking(monkeypatch):
    """Plans checked against XLA's compiled step, as on a GPU."""
    from keras_autovm.mechanisms.jax import mechanism
    monkeypatch.setattr(mechanism.JaxMechanism, "checks_compiled_peak", lambda self: True)


def recompute(budget):
    return keras_autovm.AutoVM(budget=budget, policy="sqrt_recompute", headroom=0.0,
                               verbose=0, apply_without_gpu=True)


def test_a_plan_xlas_step_fits_trains_as_planned(checking):
    callback = recompute("1GiB")
    train([callback])
    stats = callback.report.stats
    assert stats["compiled_check_s"] > 0 and stats["compiled_replans"] == 0
    assert 0 < stats["compiled_peak_bytes"] <= callback.plan.budget
    assert stats["checkpointed_traces"] >= 1


def test_a_plan_xlas_step_exceeds_is_made_again_or_refused(checking):
    first = recompute("1GiB")
    train([first])
    xla = first.report.stats["compiled_peak_bytes"]
    # On a CPU, XLA's step needs about 2.6x what the planner predicts for
    # this model: below XLA's figure the plan fits the planner, not XLA.
    assert first.plan.result.peak_bytes < xla - 1
    callback = recompute(xla - 1)
    with pytest.warns(UserWarning, match="planned again"):
        with pytest.raises(keras_autovm.PlanError) as error:
            train([callback])
    assert error.value.min_budget >= xla


def test_plans_are_not_checked_without_a_gpu():
    first = recompute("1GiB")
    train([first])
    assert first.report.stats["compiled_check_s"] == 0
    assert first.report.stats["compiled_peak_bytes"] is None


def test_an_unchanged_step_stays_unchanged_across_a_replan(monkeypatch):
    """A replan that keeps the actions does not retrace: the plan that
    replaces an unchanged one says so, with XLA's peak."""
    from keras_autovm.mechanisms.jax import mechanism
    carried = []
    keep_traced = mechanism.JaxMechanism.keep_traced

    def record(self, old, new):
        keep_traced(self, old, new)
        carried.append((old, new))

    monkeypatch.setattr(mechanism.JaxMechanism, "keep_traced", record)
    # Default device figures: the predicted step is far off the measured
    # one, so the first epoch replans.
    callback = keras_autovm.AutoVM(budget="1GiB", policy="keep_all", headroom=0.0,
                                   verbose=0, apply_without_gpu=True, profile=None)
    train([callback])
    old, new = carried[0]
    assert old.unchanged and new.unchanged and new is not old
    assert new.result.peak_bytes == old.result.peak_bytes
    assert callback.report.stats["unchanged_traces"] == 1  # Not traced again.
    assert not any(e.get("replanned") for e in callback.report.epochs)


def under_least(policy="auto"):
    """A budget 20% under the least any `policy` plan of `small_cnn` at
    batch 8 fits with the default costs (measured costs move the least a
    little: the search's ties break by time)."""
    keras.utils.set_random_seed(7)
    with pytest.raises(keras_autovm.PlanError) as error:
        keras_autovm.plan(small_cnn(), 8, budget=1024, policy=policy, headroom=0.0)
    return int(error.value.min_budget * 0.8)


def refused_fit(budget, policy="auto"):
    return keras_autovm.AutoVM(budget=budget, policy=policy, headroom=0.0, verbose=0,
                               apply_without_gpu=True)


@pytest.mark.parametrize("policy", ["auto", "keep_all"])
def test_a_budget_the_planner_refuses_runs_keras_own_step_where_xla_fits_it(
        checking, monkeypatch, policy):
    """Under every plan's least, Keras's own step still runs where XLA's
    analysis of it fits (on a GPU that is what XLA's fusion and
    rematerialization allow: ResNet-152 on JAX, results.md)."""
    from keras_autovm.mechanisms.jax import compiled
    budget = under_least(policy)
    monkeypatch.setattr(compiled, "peak", lambda fn, args: budget // 2)
    marked = []
    run_unchanged = compiled.run_unchanged
    monkeypatch.setattr(compiled, "run_unchanged",
                        lambda plan, peak: marked.append(plan) or run_unchanged(plan, peak))
    reference = train()
    callback = refused_fit(budget, policy)
    model = train([callback])
    plan = callback.plan
    assert plan.unchanged and plan.refused is None and plan.fits
    assert plan.result.peak_bytes == budget // 2
    # The first plan was the planner's refusal, run unchanged once traced.
    assert any("No plan fits by AutoVM's model" in n for n in marked[0].notes)
    assert marked[0].unchanged and marked[0].refused is None
    assert callback.report.stats["unchanged_traces"] >= 1
    assert_same_weights(reference, model)


def test_a_budget_the_planner_refuses_fails_before_a_step_where_xla_does_not_fit(
        checking):
    budget = under_least()
    keras.utils.set_random_seed(7)
    model = small_cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(keras_autovm.PlanError, match="Keras's own compiled step needs") as error:
        model.fit(*data(32), batch_size=8, epochs=1, verbose=0,
                  callbacks=[refused_fit(budget)])
    # The planner's least (XLA's own step needs more on a CPU), and no step ran.
    assert budget < error.value.min_budget < budget / 0.8 * 1.1
    assert "No plan fits" in str(error.value)
    for x, y in zip(before, model.get_weights()):
        np.testing.assert_array_equal(x, y)


def test_without_a_gpu_a_budget_the_planner_refuses_fails_at_once():
    with pytest.raises(keras_autovm.PlanError, match="No plan fits"):
        train([refused_fit(under_least())])


def test_keras_own_step_replaces_a_plan_that_changes_it_where_xla_fits_it(
        checking, monkeypatch):
    """A budget the planner meets only by recomputing, where XLA's analysis
    of Keras's own step fits it: Keras's step runs, for the whole fit."""
    from keras_autovm.mechanisms.jax import compiled
    keras.utils.set_random_seed(7)
    held = keras_autovm.plan(small_cnn(), 8, budget="1GiB",
                             policy="keep_all").result.peak_bytes
    budget = (int(under_least() / 0.8) + held) // 2
    monkeypatch.setattr(compiled, "peak", lambda fn, args: budget // 2)
    reference = train()
    callback = refused_fit(budget)
    model = train([callback])
    plan, stats = callback.plan, callback.report.stats
    assert plan.unchanged and plan.policy == "keep_all" and plan.fits
    assert sum("runs unchanged" in n for n in plan.notes) == 1
    # Traced once: the replan at the first epoch's end gave Keras's step again.
    assert stats["checkpointed_traces"] == 0 and stats["unchanged_traces"] == 1
    assert_same_weights(reference, model)
    # The same budget without the check: the planner's plan recomputes.
    keras.utils.set_random_seed(7)
    planned = keras_autovm.plan(small_cnn(), 8, budget=budget, headroom=0.0)
    assert planned.counts()["recompute"] > 0


def test_a_replan_the_planner_refuses_after_xlas_figure_is_raised_at_once(
        checking, monkeypatch):
    """XLA's figure far over every plan: the overhead learnt from it leaves
    no plan the planner accepts, and that refusal is the error (with
    Keras's own step's figure), not more compiles of a keep-all it refused
    (on an H200, ResNet-152 at batch 96 compiled it twice more, 22 s each,
    and named a 27 GiB budget)."""
    from keras_autovm.mechanisms.jax import compiled
    keras.utils.set_random_seed(7)
    held = keras_autovm.plan(small_cnn(), 8, budget="1GiB",
                             policy="keep_all").result.peak_bytes
    budget = (int(under_least() / 0.8) + held) // 2
    calls = []
    monkeypatch.setattr(compiled, "peak", lambda fn, args: calls.append(1) or 10 * budget)
    with pytest.warns(UserWarning, match="planned again"):
        with pytest.raises(keras_autovm.PlanError) as error:
            train([refused_fit(budget)])
    message = str(error.value)
    assert "measured memory overhead" in message
    assert "Keras's own compiled step needs" in message
    assert len(calls) == 2  # Keras's own step, then the plan.


def test_layers_of_a_plan_recomputing_runs_of_regions_have_no_checkpoints_of_their_own():
    import types

    import jax

    from keras_autovm.mechanisms.jax.mechanism import JaxMechanism
    layer = keras.layers.Dense(4)
    layer.build((2, 3))

    def traced(region_runs):
        applied = types.SimpleNamespace(plan=types.SimpleNamespace(region_runs=region_runs))
        call = lambda x: JaxMechanism().call_layer(layer, x, (), {}, applied)  # noqa: E731
        return str(jax.make_jaxpr(call)(np.ones((2, 3), "float32")))

    # A chain plan's layer runs under its own checkpoint; a region plan's
    # does not (XLA kept 1.51x the plan with them, ResNet-152 on a GPU).
    assert "checkpoint" in traced(False) or "remat" in traced(False)
    assert "checkpoint" not in traced(True) and "remat" not in traced(True)
