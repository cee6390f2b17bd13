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
