"""Any Keras model: training with AutoVM gives the weights training without
it gives, or AutoVM keeps what it cannot manage and says why in one line.

The zoo (tests/zoo.py): batch norm and dropout, a shared layer, a nested
model, several inputs and outputs, LSTM and GRU, attention, a keras-hub style
backbone built from a config (token ids of any length), a subclassed model,
and mixed precision.
"""

import contextlib
import warnings

import keras
import numpy as np
import pytest

import keras_autovm
from conftest import BACKEND
from zoo import MIXED
from zoo import ZOO

POLICIES = ("sqrt_recompute", "offload_all")
GRAPH_MODELS = sorted(set(ZOO) - {"subclassed"})


@contextlib.contextmanager
def policy_of(name):
    previous = keras.config.dtype_policy()
    if name == "mixed_precision":
        keras.config.set_dtype_policy(MIXED)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def fit(name, callbacks=()):
    keras.utils.set_random_seed(7)
    with policy_of(name):
        model, x, y, loss = ZOO[name]()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False,
                  callbacks=list(callbacks), verbose=0)
    return model


def autovm(policy):
    return keras_autovm.AutoVM(budget="1GiB", policy=policy, verbose=0,
                               apply_without_gpu=True)


@pytest.fixture(scope="module")
def references():
    """Weights after training without AutoVM, once per model."""
    return {}


def assert_same_weights(a, b):
    # The tolerance of docs/mechanisms.md: recompute reruns kernels whose
    # order of summation may differ.
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(wa, wb, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", GRAPH_MODELS)
def test_trains_like_without_autovm(name, policy, references, swap_small_tensors):
    if name not in references:
        references[name] = fit(name)
    callback = autovm(policy)
    model = fit(name, [callback])
    plan = callback.report.plan
    action = "recompute" if policy == "sqrt_recompute" else "swap"
    assert plan.counts()[action] > 0, (name, plan.counts(), plan.notes)
    assert_same_weights(references[name], model)
