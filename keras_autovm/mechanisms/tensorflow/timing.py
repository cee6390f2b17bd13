"""Times one layer call on TensorFlow, inside `tf.function`s as it trains.

The forward is the layer's `stateless_call` in one `tf.function`; the
backward is measured as the forward and its `tf.GradientTape` gradient in
another, less the forward (a tape's backward cannot run twice). Clocks stop
after `tf.test.experimental.sync_devices()`, which waits for the GPU.
"""

import tensorflow as tf

from keras_autovm.mechanisms.base import call_values
from keras_autovm.mechanisms.base import median_seconds
from keras_autovm.mechanisms.base import variable_values


def _wait(result=None):
    if tf.config.list_logical_devices("GPU"):
        tf.test.experimental.sync_devices()


def _is_float(x):
    return isinstance(x, tf.Tensor) and x.dtype.is_floating


def time_call(operation, args, kwargs, repeats):
    """`(forward_s, backward_s)` of one layer call; see `Mechanism.time_call`."""
    tv, ntv = variable_values(operation)
    tv = [tf.identity(x) for x in tv]
    leaves = tf.nest.flatten(args)
    floats = [i for i, x in enumerate(leaves) if _is_float(x)]

    def forward(tv, xs):
        full = list(leaves)
        for i, x in zip(floats, xs):
            full[i] = x
        return call_values(operation, tv, ntv,
                           tf.nest.pack_sequence_as(args, full), kwargs)

    xs = [leaves[i] for i in floats]

    @tf.function
    def fwd(tv, xs):
        return forward(tv, xs)

    @tf.function
    def fwd_bwd(tv, xs):
        with tf.GradientTape() as tape:
            tape.watch([tv, xs])
            outputs = tf.nest.flatten(forward(tv, xs))
        return tape.gradient([y for y in outputs if y.dtype.is_floating], [tv, xs])

    fwd_s = median_seconds(lambda: fwd(tv, xs), _wait, repeats)
    if not (tv or xs):
        return fwd_s, 0.0
    both_s = median_seconds(lambda: fwd_bwd(tv, xs), _wait, repeats)
    return fwd_s, max(both_s - fwd_s, 0.0)
