"""Times one layer call on TensorFlow, inside `tf.function`s as it trains.

The forward is the layer's `stateless_call` in one `tf.function`. A
persistent `tf.GradientTape` records one call of it as one operation, whose
gradient is the function's own compiled backward; `tape.gradient` then runs
that backward alone, as often as asked. Clocks stop after
`tf.test.experimental.sync_devices()`, which waits for the GPU.
"""

import warnings

import tensorflow as tf

from keras_autovm.mechanisms.base import call_values
from keras_autovm.mechanisms.base import median_seconds
from keras_autovm.mechanisms.base import variable_values

# Bytes each copy of the link measurement moves.
LINK_BYTES = 64 << 20


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


def measure_link(device="GPU:0", host="CPU:0", repeats=3):
    """GB/s of TensorFlow's own copies as the explicit swap makes them (a
    `Snapshot` placed on the other device, in a `tf.function`): to the
    host, to the device, and both at once; `None` without a GPU, or, with
    a warning, where TensorFlow refuses a copy. TensorFlow allocates what
    a copy to the host lands in itself (pinned where its GPU host
    allocator serves it), so these are the figures its swaps plan with,
    under the pinned link's keys. `device` and `host` name the two ends
    (tests copy between two CPU placements)."""
    if device.startswith("GPU") and not tf.config.list_logical_devices("GPU"):
        return None
    try:
        return _link_gbps(device, host, repeats)
    except tf.errors.OpError as error:
        warnings.warn(f"AutoVM could not time TensorFlow's copies: {error.message}",
                      stacklevel=2)
        return None


def _link_gbps(device, host, repeats):
    with tf.device(device):
        on_device = tf.zeros([LINK_BYTES], tf.uint8)
    with tf.device(host):
        on_host = tf.ones([LINK_BYTES], tf.uint8)

    def copy(x, where):
        with tf.device(where):
            return tf.raw_ops.Snapshot(input=x)

    d2h = tf.function(lambda x: copy(x, host))
    h2d = tf.function(lambda h: copy(h, device))
    both = tf.function(lambda x, h: (copy(x, host), copy(h, device)))
    gbps = lambda seconds: LINK_BYTES / seconds / 1e9  # noqa: E731
    at_once = median_seconds(lambda: both(on_device, on_host), _wait, repeats)
    return {"pinned_d2h": gbps(median_seconds(lambda: d2h(on_device), _wait, repeats)),
            "pinned_h2d": gbps(median_seconds(lambda: h2d(on_host), _wait, repeats)),
            "pinned_both_d2h": gbps(at_once), "pinned_both_h2d": gbps(at_once)}
