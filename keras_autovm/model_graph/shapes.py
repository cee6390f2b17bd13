"""Concrete shapes for models whose inputs have unknown dimensions.

A text backbone takes token ids of any length (`keras.Input((None,))`), so
its activations have no size until a batch shape is given: `plan()` takes
one as `input_shape`, `AutoVM` reads it from the batches `fit` gives. Every
layer output is then sized by asking each call for its output spec at those
inputs (`internals.output_specs`), without changing the model.
"""

import keras

from keras_autovm import internals


def input_shapes_of(model, input_shapes):
    """`input_shapes` (see `build_graph`) checked against the model, as a
    tuple with one tuple per model input; `None` stays `None`."""
    if input_shapes is None:
        return None
    return tuple(_input_shape_list(internals.functional_of(model), input_shapes))


def needs_input_shapes(model):
    """Whether a model's inputs have unknown dimensions besides the batch,
    so that planning needs the shapes of real batches."""
    fn = internals.functional_of(model)
    return fn is not None and any(None in tuple(x.shape)[1:] for x in fn.inputs)


def specs(fn, batch_size, input_shapes):
    """Concrete specs of every tensor of `fn` at these input shapes, or
    `None` where the model's own shapes serve."""
    if input_shapes is None:
        for x in fn.inputs:
            if None in tuple(x.shape)[1:]:
                raise ValueError(
                    f"Model input '{x.name}' has shape {tuple(x.shape)}: a "
                    "dimension besides the batch is unknown (a sequence "
                    "length, say), so its activations cannot be sized. Pass "
                    "the shape of a batch without its batch dimension, e.g. "
                    "`keras_autovm.plan(model, batch_size, input_shape=(128,))`; "
                    "`AutoVM` reads it from the batches `fit` gives.")
        return None
    shapes = _input_shape_list(fn, input_shapes)
    inputs = [keras.KerasTensor((batch_size,) + shape, dtype=x.dtype)
              for x, shape in zip(fn.inputs, shapes)]
    return internals.output_specs(fn, inputs)


def _input_shape_list(fn, input_shapes):
    """`input_shapes` as one tuple per model input, checked."""
    if isinstance(input_shapes, dict):
        missing = [x.name for x in fn.inputs if x.name not in input_shapes]
        if missing:
            raise ValueError(f"`input_shape` names no shape for inputs {missing}. "
                             f"Received: input_shape={input_shapes!r}")
        shapes = [input_shapes[x.name] for x in fn.inputs]
    elif len(fn.inputs) == 1 and input_shapes and not isinstance(
            input_shapes[0], (list, tuple)):
        shapes = [input_shapes]
    else:
        shapes = list(input_shapes)
    if len(shapes) != len(fn.inputs):
        raise ValueError(f"`input_shape` must give {len(fn.inputs)} shapes, one per "
                         f"model input. Received: input_shape={input_shapes!r}")
    checked = []
    for x, shape in zip(fn.inputs, shapes):
        shape = tuple(shape)
        model_shape = tuple(x.shape)[1:]
        if len(shape) != len(model_shape) or any(
                isinstance(d, bool) or not isinstance(d, int) or d < 1
                or (m is not None and d != m) for d, m in zip(shape, model_shape)):
            raise ValueError(
                f"`input_shape` for input '{x.name}' must be {len(model_shape)} "
                f"positive ints (no batch dimension) matching {model_shape}. "
                f"Received: input_shape={input_shapes!r}")
        checked.append(shape)
    return checked
