import keras
import pytest

import keras_autovm
from conftest import BACKEND
from keras_autovm.mechanisms.tensorflow import managed

pytestmark = pytest.mark.skipif(BACKEND != "tensorflow",
                                reason="managed memory is TensorFlow's allocator")


@pytest.mark.parametrize("value", [0, -1, True, "0.5"])
def test_bad_memory_fraction(value):
    with pytest.raises(ValueError, match="memory_fraction"):
        keras_autovm.enable_managed_memory(memory_fraction=value)


def test_too_late_once_tensorflow_is_initialised():
    import tensorflow as tf
    tf.constant(1.0) + 1.0  # Initialises TensorFlow's devices.
    with pytest.raises(RuntimeError, match="before TensorFlow initialises"):
        keras_autovm.enable_managed_memory(memory_fraction=0.5)
    assert not managed.managed_memory_enabled()


def test_swap_needs_managed_memory_on_a_gpu(monkeypatch):
    mechanism = keras_autovm.mechanisms.get()
    monkeypatch.setattr(mechanism, "gpu_available", lambda: True)
    assert "swap" not in mechanism.actions()
    monkeypatch.setitem(managed._state, "enabled", True)
    assert "swap" in mechanism.actions()


def test_install_turns_xla_off_when_swapping_and_close_restores_it():
    from keras_autovm.patches import Patches
    mechanism = keras_autovm.mechanisms.get()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse", jit_compile=True)
    patches = Patches()
    message = mechanism.install(model, None, patches)
    assert model.jit_compile is False
    assert "jit_compile=False" in message
    assert mechanism.install(model, None, patches) is None
    patches.close()
    assert model.jit_compile is True


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
