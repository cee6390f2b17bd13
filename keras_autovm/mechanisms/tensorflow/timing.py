"""Times one layer call on TensorFlow, inside `tf.function`s as it trains.

The forward is the layer's `stateless_call` in one `tf.function`. A
persistent `tf.GradientTape` records one call of it as one operation, whose
gradient is the function's own compiled backward; `tape.gradient` then runs
that backward alone, as often as asked. Clocks stop after
`tf.test.experimental.sync_devices()`, which waits for the GPU.
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

    fwd_s = median_seconds(lambda: fwd(tv, xs), _wait, repeats)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([tv, xs])
        outputs = [y for y in tf.nest.flatten(fwd(tv, xs)) if y.dtype.is_floating]
    if not (tv or xs) or not outputs:
        return fwd_s, 0.0
    bwd_s = median_seconds(lambda: tape.gradient(outputs, [tv, xs]), _wait, repeats)
    return fwd_s, bwd_s
