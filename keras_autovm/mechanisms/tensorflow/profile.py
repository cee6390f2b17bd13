"""Each layer call's transient device memory on TensorFlow, measured.

TensorFlow's GPU kernels allocate temporaries that the planner's table of
layer outputs does not list. A float32 channels-last convolution runs in
cuDNN's channels-first layout, so its backward holds transposed copies of
its input, its output gradient and its input gradient: on an H100, VGG-19's
`block1_conv2` backward at batch 64 held three 784 MiB temporaries beside
the tensors the plan had live (results/tensorflow/trace/). `measure(model)`
runs the forward pass at two small batch sizes and, for each distinct layer
call, its forward and its backward alone (`timing.transient_bytes`);
`adjust(graph, measured)` makes the larger of the two each op's
`workspace_bytes`, sized `fixed + per_sample * batch_size` from the two
runs. Only where the allocator is a GPU's: without one, nothing is measured
and the graph is left as it is.
"""

import dataclasses

import keras
import tensorflow as tf

from keras_autovm import internals
from keras_autovm.mechanisms.base import bytes_at
from keras_autovm.mechanisms.base import line_through
from keras_autovm.mechanisms.tensorflow import timing
from keras_autovm.model_graph import call_names
from keras_autovm.model_graph import layer_calls
from keras_autovm.profile_cache import call_key

# The batch sizes of the two measuring runs.
SIZES = (2, 4)


def device():
    """The device whose allocator is measured: the first GPU, or `None`."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else None


def measure(model, input_shapes=None, where=None):
    """Maps op name to its transient bytes as `(fixed, per sample)`, for
    every layer call of `model` run on inputs of `input_shapes` (one tuple
    per input, without the batch) or of the model's own; `{}` where there is
    no device to measure (`where`, default `device()`)."""
    where = where or device()
    if where is None:
        return {}
    (b0, b1), (first, second) = SIZES, [_run(model, size, input_shapes, where)
                                        for size in SIZES]
    return {name: line_through(b0, first[name], b1, second[name]) for name in first}


def adjust(graph, measured):
    """`graph` with each measured op's transient bytes as its workspace."""
    if not measured:
        return graph
    ops = tuple(dataclasses.replace(op, workspace_bytes=max(
        op.workspace_bytes, bytes_at(measured[op.name], graph.batch_size)))
        if op.name in measured else op for op in graph.ops)
    return dataclasses.replace(graph, ops=ops)


def _run(model, batch_size, input_shapes, where):
    """{op name: transient bytes} at `batch_size`; identical calls (the
    repeated blocks of a ResNet) are measured once."""
    names = [name for name, _ in call_names(model)]
    keys = [call_key(layer, node) for layer, node in layer_calls(model)]
    fn = internals.functional_of(model)
    shapes = input_shapes or [tuple(x.shape[1:]) for x in fn.inputs]
    inputs = [keras.ops.zeros((batch_size,) + tuple(shape), x.dtype)
              for x, shape in zip(fn.inputs, shapes)]
    found, seen = {}, {}

    def around(operation, run, args, kwargs):
        outputs = run()
        key = keys[len(found)]
        if key not in seen:
            seen[key] = timing.transient_bytes(operation, args, kwargs, where)
        found[names[len(found)]] = seen[key]
        return outputs

    # Layer state a training-mode call updates stays as it was.
    state = [(v, v.value) for v in model.non_trainable_variables]
    with keras.StatelessScope(state_mapping=state):
        internals.run_calls(model, inputs, around)
    return found
