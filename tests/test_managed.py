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


@pytest.mark.parametrize("policy, off, hooked", [("sqrt_recompute", False, False),
                                                  ("auto", False, True),
                                                  ("offload_all", True, True),
                                                  ("sqrt_offload", True, True)])
@tensorflow_only
def test_xla_stays_on_for_plans_that_do_not_swap(policy, off, hooked):
    patches, model, _, _ = installed(policy)
    assert model.jit_compile is not off
    # The explicit swap's own hook, where the policy may swap.
    assert ("train_step" in vars(model)) is hooked
    patches.close()
    assert model.jit_compile is True and "train_step" not in vars(model)


def installed(policy, swapping=False):
    """`policy`'s install on a small model compiled with XLA, the plan in
    force swapping (`offload_all`'s) where `swapping`: (patches, model,
    runtime, what was said: install's message, then the runtime's
    warnings)."""
    from keras_autovm.budget import PlanBook
    from keras_autovm.patches import Patches
    from keras_autovm.runtime import Runtime
    mechanism = keras_autovm.mechanisms.get()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(64),
                              keras.layers.ReLU(), keras.layers.Dense(2)])
    model.compile("sgd", "mse", jit_compile=True)
    plans = PlanBook(model, 2**30, 0.15, policy, None, mechanism)
    said = []
    runtime = Runtime(mechanism, plans, {}, warn=said.append)
    if swapping:
        runtime.replace(swapping_plan(model))
    patches = Patches()
    said.append(mechanism.install(model, runtime, patches))
    return patches, model, runtime, said


def swapping_plan(model):
    plan = keras_autovm.plan(model, 8, budget=2**30, policy="offload_all")
    assert plan.counts()["swap"] > 0
    return plan


@tensorflow_only
def test_auto_turns_xla_off_for_a_plan_that_swaps_and_says_so():
    patches, model, _, said = installed("auto", swapping=True)
    assert model.jit_compile is False
    assert "jit_compile=False: XLA cannot compile the control dependencies" in said[0]
    patches.close()
    assert model.jit_compile is True


@tensorflow_only
def test_a_replan_that_brings_swaps_turns_xla_off_before_the_step_is_traced():
    patches, model, runtime, said = installed("auto")
    model.make_train_function(force=True)
    assert model.jit_compile is True and said == [None]  # No swaps yet.
    mechanism = runtime.mechanism
    assert not mechanism._own_recompute  # Keras's own under XLA.
    runtime.replace(swapping_plan(model))
    model.make_train_function(force=True)
    assert model.jit_compile is False and mechanism._own_recompute
    assert "its new plan swaps" in said[-1]
    patches.close()
    assert model.jit_compile is True and "make_train_function" not in vars(model)


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
