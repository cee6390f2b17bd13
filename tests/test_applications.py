"""`keras_autovm.applications`: every Keras Applications constructor, wrapped.

Every constructor is built once (module fixture) at its smallest input with
`weights=None` inside `keras.StatelessScope`, where Keras defers drawing the
initial weights: wrapping and planning read shapes only, and drawing the
weights of all forty models took minutes on a CPU. A few small models are
built for real, trained a step and saved.
"""

import inspect

import keras
import numpy as np
import pytest

import keras_autovm
from conftest import BACKEND
from keras_autovm import applications

NAMES = sorted(name for name, value in vars(keras.applications).items()
               if name[:1].isupper() and callable(value))
# The smallest input each accepts with weights=None: 32 for most; Xception
# needs 71, the Inceptions 75.
SIZES = (32, 75)


def build(name, **kwargs):
    """The wrapped model at its smallest input size, and that size."""
    for size in SIZES:
        try:
            return getattr(applications, name)(
                weights=None, input_shape=(size, size, 3), classes=4, **kwargs), size
        except ValueError as error:
            if "input" not in str(error).lower() or size == SIZES[-1]:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def shapes_only():
    """Every constructor's wrapped model, with weights left undrawn."""
    models = {}
    with keras.StatelessScope():
        for name in NAMES:
            models[name] = build(name)
    return models


def test_every_constructor_is_there():
    assert NAMES and set(NAMES) <= set(applications.__all__)
    assert len(NAMES) >= 40  # Keras 3.15 has 40.


@pytest.mark.parametrize("name", NAMES)
def test_constructor_keeps_signature_and_docstring(name):
    ours, theirs = getattr(applications, name), getattr(keras.applications, name)
    assert inspect.signature(ours) == inspect.signature(theirs)
    assert ours.__name__ == name
    assert ours.__doc__.startswith(theirs.__doc__.rstrip())


@pytest.mark.parametrize("name", NAMES)
def test_every_constructor_wraps_and_plans(shapes_only, name):
    model, size = shapes_only[name]
    layers = [layer for layer in model.layers
              if not isinstance(layer, keras.layers.InputLayer)]
    assert layers and all(isinstance(layer, keras_autovm.AutoVMWrapper)
                          for layer in layers)
    keep = keras_autovm.plan(model, batch_size=2, budget="64GiB", policy="keep_all")
    assert len(keep.actions) >= len(layers)
    # Under a budget below keeping everything, auto plans something else.
    tight = keras_autovm.plan(model, batch_size=2, policy="sqrt_recompute",
                              budget=2 * keep.result.peak_bytes)
    assert tight.counts()["recompute"] > 0, (name, size)
