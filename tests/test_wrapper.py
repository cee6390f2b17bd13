import os

import keras
import numpy as np

import keras_autovm
from conftest import data, small_cnn


def wrapped_model():
    inputs = keras.Input((16, 16, 3))
    x = keras_autovm.AutoVMWrapper(keras.layers.Conv2D(8, 3, name="conv"))(inputs)
    x = keras_autovm.AutoVMWrapper(keras.layers.BatchNormalization(name="bn"))(x)
    x = keras_autovm.AutoVMWrapper(keras.layers.GlobalAveragePooling2D(name="gap"))(x)
    outputs = keras_autovm.AutoVMWrapper(keras.layers.Dense(4, name="head"))(x)
    return keras.Model(inputs, outputs)


def test_wrapper_is_transparent_for_inference():
    keras.utils.set_random_seed(0)
    plain = small_cnn()
    wrapped = keras.models.clone_model(
        plain, clone_function=lambda layer: keras_autovm.AutoVMWrapper(layer))
    x, _ = data(8)
    np.testing.assert_array_equal(plain.predict(x, verbose=0),
                                  wrapped.predict(x, verbose=0))
    assert len(wrapped.weights) == len(plain.weights)


def test_wrapped_model_saves_and_loads(tmp_path):
    keras.utils.set_random_seed(0)
    model = wrapped_model()
    model.compile("sgd", "mse")
    x, y = data(16)
    model.fit(x, y, epochs=1, verbose=0)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.layers[1], keras_autovm.AutoVMWrapper)
    assert loaded.layers[1].layer.name == "conv"
    np.testing.assert_allclose(model.predict(x, verbose=0),
                               loaded.predict(x, verbose=0), rtol=1e-6, atol=1e-6)
    assert np.isclose(model.evaluate(x, y, verbose=0),
                      loaded.evaluate(x, y, verbose=0), rtol=1e-6)


def test_wrapper_rejects_non_layers():
    import pytest
    with pytest.raises(ValueError, match="supported layer"):
        keras_autovm.AutoVMWrapper("conv")


def _masked_model():
    inputs = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(12, 8, mask_zero=True, name="embed")(inputs)
    x = keras.layers.LSTM(8, name="lstm")(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(x))


def _fit_masked(callbacks=()):
    keras.utils.set_random_seed(1)
    model = _masked_model()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    # Trailing zeros: the mask changes what the LSTM returns.
    x = rng.integers(1, 12, size=(8, 6)) * (np.arange(6) < rng.integers(2, 7, (8, 1)))
    model.fit(x, rng.integers(0, 3, 8), batch_size=4, epochs=1, shuffle=False,
              verbose=0, callbacks=list(callbacks))
    return model


def test_masked_model_trains_like_keras_own():
    theirs = _fit_masked()
    for policy in ("keep_all", "sqrt_recompute"):
        callback = keras_autovm.AutoVM(budget="1GiB", policy=policy, verbose=0,
                                       apply_without_gpu=True)
        ours = _fit_masked([callback])
        for wa, wb in zip(theirs.get_weights(), ours.get_weights()):
            np.testing.assert_allclose(wa, wb, rtol=2e-5, atol=2e-6, err_msg=policy)


def test_wrapper_runs_keras_layer_call_once_in_an_eager_step(monkeypatch):
    # Keras's `Layer.__call__` for the wrapper and again for the layer in
    # it: twice the Python of each step, which torch pays every step.
    import pytest
    if keras.backend.backend() != "torch":
        pytest.skip("only an eager step runs the layers' Python each step")
    calls = []
    original = keras.layers.Layer.__call__

    def counting(self, *args, **kwargs):
        if kwargs.get("training") and isinstance(self, keras_autovm.AutoVMWrapper):
            calls.append(self.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(keras.layers.Layer, "__call__", counting)
    x, y = data(8)
    model = small_cnn()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[keras_autovm.AutoVM(
        budget="1GiB", policy="keep_all", verbose=0, apply_without_gpu=True)])
    assert not calls
    calls.clear()
    _fit_masked([keras_autovm.AutoVM(budget="1GiB", policy="keep_all", verbose=0,
                                     apply_without_gpu=True)])
    assert calls  # A masked input takes Keras's whole call, which sets masks.
