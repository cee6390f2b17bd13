"""Putting `AutoVMWrapper`s around a built model's layers, and taking them off.

A Keras model's layers cannot be swapped in place, so the model is cloned
with each layer wrapped (the clone shares the original layers, hence the
same variables) and the original model's `call` is pointed at the clone's
for the duration of training. Nothing about the model's weights, config or
saved form changes.
"""

import functools

import keras
from keras.src.trainers import data_adapters

from keras_autovm.wrapper import AutoVMWrapper


def wrap(model, runtime):
    """Routes `model`'s forward pass through wrapped layers; returns the clone.

    `train_step` is hooked too, so the plan for each batch size is made from
    the batch before any layer runs: an error (a budget no plan meets) then
    surfaces as itself, not re-wrapped by Keras's layer-call error handling.
    """
    clone = keras.models.clone_model(model, clone_function=_wrap_layer)
    for layer in clone.layers:
        if isinstance(layer, AutoVMWrapper):
            layer._autovm_runtime = runtime
    model.call = clone.call
    model.train_step = _planning_train_step(model, runtime)
    return clone


def unwrap(model, clone):
    """Undoes `wrap`."""
    model.__dict__.pop("call", None)
    model.__dict__.pop("train_step", None)
    for layer in clone.layers:
        if isinstance(layer, AutoVMWrapper):
            layer._autovm_runtime = None


def inner_layers(model):
    """Maps layer name to layer, looking through `AutoVMWrapper`s."""
    layers = {}
    for layer in model.layers:
        inner = layer.layer if isinstance(layer, AutoVMWrapper) else layer
        layers[inner.name] = inner
    return layers


def _planning_train_step(model, runtime):
    original = type(model).train_step.__get__(model)

    @functools.wraps(original)
    def train_step(*args):
        # JAX passes (state, data), TensorFlow and torch (data).
        x, _, _ = data_adapters.data_adapter_utils.unpack_x_y_sample_weight(args[-1])
        runtime.plan_for_inputs(x)
        return original(*args)

    return train_step


def _wrap_layer(layer):
    if isinstance(layer, keras.layers.InputLayer):
        return layer
    if isinstance(layer, AutoVMWrapper):
        layer = layer.layer
    return AutoVMWrapper(layer)
