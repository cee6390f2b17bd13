import keras
import pytest

import keras_autovm
from conftest import BACKEND
from keras_autovm.mechanisms.tensorflow import managed

tensorflow_only = pytest.mark.skipif(BACKEND != "tensorflow",
                                     reason="managed memory is TensorFlow's allocator")


@pytest.mark.skipif(BACKEND == "tensorflow", reason="the backend lacks the feature")
def test_other_backends_say_they_lack_managed_memory():
    with pytest.raises(NotImplementedError, match=f"backend is '{BACKEND}'"):
        keras_autovm.enable_managed_memory(memory_fraction=0.5)
    assert not managed.managed_memory_enabled()


@tensorflow_only
@pytest.mark.parametrize("value", [0, -1, True, "0.5"])
def test_bad_memory_fraction(value):
    with pytest.raises(ValueError, match="memory_fraction"):
        keras_autovm.enable_managed_memory(memory_fraction=value)


@tensorflow_only
def test_too_late_once_tensorflow_is_initialised():
    import tensorflow as tf
    tf.constant(1.0) + 1.0  # Initialises TensorFlow's devices.
    with pytest.raises(RuntimeError, match="before TensorFlow initialises"):
        keras_autovm.enable_managed_memory(memory_fraction=0.5)
    assert not managed.managed_memory_enabled()


@tensorflow_only
@pytest.mark.parametrize("enabled", [False, True])
def test_managed_memory_picks_the_swap_mode(monkeypatch, enabled):
    monkeypatch.setitem(managed._state, "enabled", enabled)
    mechanism = keras_autovm.mechanisms.get()
    monkeypatch.setattr(mechanism, "gpu_available", lambda: True)
    assert mechanism.managed is enabled
    assert "swap" in mechanism.actions()
    # Explicit copies too: a tight plan's first step is measured on a GPU.
    assert "swap" in mechanism.auto_actions()
    assert mechanism.copy_link == ("managed_prefetch" if enabled else "pinned")


@tensorflow_only
@pytest.mark.parametrize("enabled", [False, True])
def test_install_turns_xla_off_when_swapping_and_close_restores_it(monkeypatch, enabled):
    from keras_autovm.patches import Patches
    monkeypatch.setitem(managed._state, "enabled", enabled)
    mechanism = keras_autovm.mechanisms.get()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse", jit_compile=True)
    patches = Patches()
    message = mechanism.install(model, None, patches)
    assert model.jit_compile is False
    assert "jit_compile=False" in message
    assert ("page-moving" in message) is enabled
    assert mechanism.install(model, None, patches) is None
    patches.close()
    assert model.jit_compile is True


@pytest.mark.parametrize("policy, in_force, off, hooked", [
    ("sqrt_recompute", None, False, False),
    ("auto", "sqrt_recompute", False, True),
    ("auto", None, True, True),  # No plan yet: it may swap.
    ("offload_all", "sqrt_recompute", True, True),
    ("sqrt_offload", None, True, True)])
@tensorflow_only
def test_xla_stays_on_for_plans_that_do_not_swap(policy, in_force, off, hooked):
    patches, model, _, _ = installed(policy, in_force)
    assert model.jit_compile is not off
    # The explicit swap's own hook, where the policy may swap.
    assert ("train_step" in vars(model)) is hooked
    patches.close()
    assert model.jit_compile is True and "train_step" not in vars(model)


def installed(policy, in_force=None):
    """`policy`'s install on a small model compiled with XLA, with the plan
    of the policy `in_force` in force (none if `None`): (patches, model,
    runtime, what was said: install's message, then the runtime's
    warnings)."""
    from keras_autovm.budget import PlanBook
    from keras_autovm.patches import Patches
    from keras_autovm.runtime import Runtime
    mechanism = keras_autovm.mechanisms.get()
    model = small_dense()
    model.compile("sgd", "mse", jit_compile=True)
    plans = PlanBook(model, 2**30, 0.15, policy, None, mechanism)
    said = []
    runtime = Runtime(mechanism, plans, {}, warn=said.append)
    if in_force:
        runtime.replace(plan_of(model, in_force))
    patches = Patches()
    said.append(mechanism.install(model, runtime, patches))
    return patches, model, runtime, said


def small_dense(width=64):
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(width),
                             keras.layers.ReLU(), keras.layers.Dense(width),
                             keras.layers.ReLU(), keras.layers.Dense(2)])


def plan_of(model, policy):
    plan = keras_autovm.plan(model, 8, budget=2**30, policy=policy)
    assert (plan.counts()["swap"] > 0) is (policy == "offload_all")
    return plan


@tensorflow_only
def test_auto_turns_xla_off_for_a_plan_that_swaps_and_says_so():
    patches, model, _, said = installed("auto", "offload_all")
    assert model.jit_compile is False
    assert "jit_compile=False: XLA cannot compile the control dependencies" in said[0]
    patches.close()
    assert model.jit_compile is True


@tensorflow_only
def test_a_replan_that_brings_swaps_turns_xla_off_before_the_step_is_traced():
    patches, model, runtime, said = installed("auto", "sqrt_recompute")
    model.make_train_function(force=True)
    assert model.jit_compile is True and said == [None]  # No swaps yet.
    mechanism = runtime.mechanism
    assert not mechanism._own_recompute  # Keras's own under XLA.
    runtime.replace(plan_of(model, "offload_all"))
    model.make_train_function(force=True)
    assert model.jit_compile is False and mechanism._own_recompute
    model.test_function = "built without XLA by validation"
    assert "its new plan swaps" in said[-1]
    model.make_train_function(force=True)
    assert len([line for line in said if line and "jit_compile" in line]) == 1
    patches.close()
    assert model.jit_compile is True and "make_train_function" not in vars(model)
    assert model.test_function is None  # Built again, under XLA, after the fit.


@tensorflow_only
def test_auto_swaps_in_a_traced_step_without_xla(monkeypatch):
    """An `auto` plan that swaps (the only candidate here) trains with XLA
    off for the fit, copies to the host, and gives XLA back after it."""
    import numpy as np

    from keras_autovm.planner import choose
    monkeypatch.setattr(choose, "CANDIDATES", ("offload_all",))
    said = []
    monkeypatch.setattr(keras_autovm.callback.console_lib.Console, "print",
                        lambda self, text: said.append(text))
    model = small_dense(256)
    model.compile("sgd", "mse", jit_compile=True)
    callback = keras_autovm.AutoVM(budget="1GiB", verbose=0, apply_without_gpu=True)
    model.fit(np.ones((16, 4)), np.ones((16, 2)), batch_size=8, verbose=0,
              callbacks=[callback])
    assert callback.report.plan.counts()["swap"] > 0
    assert callback.report.stats["host_copies"] > 0
    assert any("AutoVM set jit_compile=False" in line for line in said)
    assert model.jit_compile is True


@tensorflow_only
def test_a_swap_in_a_step_under_xla_is_kept_and_said_once():
    """The plan of another batch size (a last partial batch) can swap in a
    step made under XLA: its outputs are kept."""
    import tensorflow as tf
    from keras_autovm.runtime import AppliedPlan
    mechanism = keras_autovm.mechanisms.get()
    said = []
    mechanism._under_xla, mechanism._warn = True, said.append
    applied = AppliedPlan(plan_of(small_dense(), "offload_all"), runnable={})
    found = []

    @tf.function
    def traced():
        found.extend(mechanism._explicit_for(applied) for _ in range(2))
        return tf.constant(0)

    traced()
    assert found == [None, None]
    assert len(said) == 1 and "kept the outputs its plan for batch size 8" in said[0]
    assert mechanism.stats["host_copies"] == 0


@tensorflow_only
def test_jit_compile_is_restored_after_training():
    import numpy as np
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                              keras.layers.ReLU(), keras.layers.Dense(2)])
    model.compile("sgd", "mse", jit_compile=True)
    callback = keras_autovm.AutoVM(budget="1GiB", policy="offload_all", verbose=0,
                                   apply_without_gpu=True)
    model.fit(np.ones((8, 4)), np.ones((8, 2)), verbose=0, callbacks=[callback])
    assert callback.report.plan.counts()["swap"] > 0
    assert model.jit_compile is True
