"""Times one layer call on TensorFlow, inside `tf.function`s as it trains,
and measures the device memory it allocates beyond what it keeps.

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


def _passes(operation, args, kwargs):
    """`(forward, backward)`: callables running the call's forward, and its
    backward alone (`None` when nothing in it is differentiable)."""
    tv, ntv = variable_values(operation)
    tv = [tf.identity(x) for x in tv]
    leaves = tf.nest.flatten(args)
    floats = [i for i, x in enumerate(leaves) if _is_float(x)]
    xs = [leaves[i] for i in floats]

    @tf.function
    def fwd(tv, xs):
        full = list(leaves)
        for i, x in zip(floats, xs):
            full[i] = x
        return call_values(operation, tv, ntv,
                           tf.nest.pack_sequence_as(args, full), kwargs)

    with tf.GradientTape(persistent=True) as tape:
        tape.watch([tv, xs])
        outputs = [y for y in tf.nest.flatten(fwd(tv, xs)) if y.dtype.is_floating]
    if not (tv or xs) or not outputs:
        return (lambda: fwd(tv, xs)), None
    return (lambda: fwd(tv, xs)), (lambda: tape.gradient(outputs, [tv, xs]))


def time_call(operation, args, kwargs, repeats):
    """`(forward_s, backward_s)` of one layer call; see `Mechanism.time_call`."""
    forward, backward = _passes(operation, args, kwargs)
    fwd_s = median_seconds(forward, _wait, repeats)
    if backward is None:
        return fwd_s, 0.0
    return fwd_s, median_seconds(backward, _wait, repeats)


def transient_bytes(operation, args, kwargs, device):
    """The most bytes the allocator of `device` ("GPU:0") handed out while
    the call's forward, or its backward, ran, above the larger of what was
    allocated before and after it: the kernels' temporaries. Each pass runs
    once before it is measured (tracing, cuDNN's algorithm search)."""
    top = 0
    for run in _passes(operation, args, kwargs):
        if run is not None:
            _wait(run())
            top = max(top, _above_ends(run, device))
    return top


def _above_ends(run, device):
    _wait()
    before = tf.config.experimental.get_memory_info(device)["current"]
    tf.config.experimental.reset_memory_stats(device)
    result = run()  # Held until `current` is read: it is what the call keeps.
    _wait()
    info = tf.config.experimental.get_memory_info(device)
    del result
    return max(0, info["peak"] - max(before, info["current"]))
