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

from keras_autovm import graph as graph_lib
from keras_autovm.wrapper import AutoVMWrapper


def wrap(model, runtime):
    """Routes `model`'s forward pass through wrapped layers; returns the clone.

    `train_step` is hooked too, so the plan for each batch size is made from
    the batch before any layer runs: an error (a budget no plan meets) then
    surfaces as itself, not re-wrapped by Keras's layer-call error handling.
    """
    sources = {}
    clone = keras.models.clone_model(
        model, clone_function=lambda layer: _wrap_layer(layer, sources))
    for layer in clone.layers:
        if isinstance(layer, AutoVMWrapper):
            source = sources.get(id(layer), layer)
            layer._autovm_op = (source.name, tuple(graph_lib.tag_names(source)))
            layer._autovm_runtime = runtime
    model.call = clone.call
    model.train_step = _planning_train_step(model, runtime)
    return clone


def unwrap(model, clone=None):
    """Undoes `wrap`; also clears what a failed `fit` left behind."""
    model.__dict__.pop("call", None)
    model.__dict__.pop("train_step", None)
    for layer in clone.layers if clone is not None else ():
        if isinstance(layer, AutoVMWrapper):
            layer._autovm_runtime = None


def inner_layers(model):
    """Maps each op name of the model's graph to the layer to run for it."""
    layers = {}
    for layer in model.layers:
        layers[layer.name] = layer.layer if isinstance(layer, AutoVMWrapper) else layer
    return layers


def _planning_train_step(model, runtime):
    original = type(model).train_step.__get__(model)

    @functools.wraps(original)
    def train_step(*args):
        # JAX passes (state, data), TensorFlow and torch (data).
        x, _, _ = data_adapters.data_adapter_utils.unpack_x_y_sample_weight(args[-1])
        try:
            runtime.plan_for_inputs(x)
        except Exception:
            # Keras calls no `on_train_end` when `fit` fails: restore here.
            runtime.abort()
            raise
        return original(*args)

    return train_step


def _wrap_layer(layer, sources):
    # Input layers and raw `keras.ops` calls stay as they are (kept); a
    # wrapper the user built is reused, so its name stays the op's name.
    if isinstance(layer, (keras.layers.InputLayer, AutoVMWrapper)) \
            or not isinstance(layer, keras.layers.Layer):
        return layer
    wrapper = AutoVMWrapper(layer)
    sources[id(wrapper)] = layer
    return wrapper
