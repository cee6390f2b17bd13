"""Each layer call's transient device memory on TensorFlow, measured.

TensorFlow's GPU kernels allocate temporaries that the planner's table of
layer outputs does not list. A float32 channels-last convolution runs in
cuDNN's channels-first layout and with the workspace its algorithm search
chose: on an H100, VGG-19's `block1_conv2` backward at batch 64 held a
1.53 GiB cuDNN workspace and a 784 MiB channels-first copy beside the
tensors the plan had live (results/tensorflow/trace/). `measure(model,
batch_size)` runs the forward pass at that batch size and, for each
distinct layer call, its forward and its backward alone
(`timing.transient_bytes`); `adjust(graph, measured)` makes the larger of
the two each op's `workspace_bytes`, in proportion to the graph's batch
size. The algorithm search picks workspaces by batch size (at batch 2 and
4 they are no guide to batch 64), so the measuring batch is the one
planned for; where that runs out of memory, half of it, and so on. Only
where the allocator is a GPU's: without one, nothing is measured and the
graph is left as it is.
"""

import dataclasses

import keras
import tensorflow as tf

from keras_autovm import internals
from keras_autovm.mechanisms.tensorflow import timing
from keras_autovm.model_graph import call_names
from keras_autovm.model_graph import layer_calls
from keras_autovm.profile_cache import call_key


@dataclasses.dataclass(frozen=True)
class Transients:
    """Each op's transient bytes (`by_op`), measured at `batch_size`."""

    batch_size: int
    by_op: dict

    def at(self, name, batch_size):
        return int(round(self.by_op[name] * batch_size / self.batch_size))


def device():
    """The device whose allocator is measured: the first GPU, or `None`."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else None


def measure(model, batch_size, input_shapes=None, where=None):
    """The `Transients` of every layer call of `model` run at `batch_size`
    (or the largest half, quarter... of it that fits) on inputs of
    `input_shapes` (one tuple per input, without the batch) or of the
    model's own; `None` where there is no device to measure (`where`,
    default `device()`)."""
    where = where or device()
    if where is None:
        return None
    while True:
        try:
            return Transients(batch_size, _run(model, batch_size, input_shapes, where))
        except tf.errors.ResourceExhaustedError:
            if batch_size == 1:
                raise
            batch_size //= 2


def adjust(graph, measured):
    """`graph` with each measured op's transient bytes as its workspace."""
    if measured is None:
        return graph
    ops = tuple(dataclasses.replace(op, workspace_bytes=max(
        op.workspace_bytes, measured.at(op.name, graph.batch_size)))
        if op.name in measured.by_op else op for op in graph.ops)
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
