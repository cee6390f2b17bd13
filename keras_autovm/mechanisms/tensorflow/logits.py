"""Keeping the logits Keras's TensorFlow losses read from a layer output.

On TensorFlow, Keras's cross-entropy losses compute from logits, not from
the probabilities, where they find them: attached to the output by Keras's
softmax and sigmoid (`tf_internals.tf_logits`), or, for a graph tensor
without those, as the input of the `Softmax` or `Sigmoid` op that made it
(a raw `tf.nn.softmax` in a `Lambda`; `tf_internals.tf_op_logits`). A
tensor AutoVM puts in a layer output's place (a recompute segment's output,
an identity that marks where the backward pass reaches, a pass-through that
moves pages) must offer the same logits, ones the gradient tape reaches:
without them the loss is computed from the probabilities, which rounds
differently. MobileNet, whose classifier is a softmax, then got gradients a
few ulps off, and a model that sensitive trained to weights 1.1e-2 away in
two steps; a saturating model with a raw softmax head, 2.9 away.
"""

import tensorflow as tf

from keras_autovm.mechanisms.tensorflow import internals as tf_internals

# The op a loss recognises probabilities by, made again on given logits.
_REMAKE = {"Softmax": lambda logits: tf.raw_ops.Softmax(logits=logits),
           "Sigmoid": lambda logits: tf.raw_ops.Sigmoid(x=logits)}


def of(x):
    """`(logits, op_type)`: the logits a Keras loss reads from `x` and how
    it finds them: attached (`op_type` is `None`) or as the input of `x`'s
    op (`"Softmax"` or `"Sigmoid"`); `(None, None)` where it reads `x`."""
    logits = tf_internals.tf_logits(x)
    if logits is not None:
        return logits, None
    op_type, logits = tf_internals.tf_op_logits(x)
    return logits, op_type


def attach(x, logits, op_type):
    """`x` (or what replaces it) offering `logits` as `of` found them.

    Attached logits are attached to `x`. Where the loss found them through
    `x`'s op, the replacement is that op again on `logits`, the same
    values as `x`: attaching them instead would make every cross-entropy
    loss read them, while the op type is read only by the losses that
    read it without AutoVM (a softmax's by the categorical ones, not by
    binary cross-entropy)."""
    if op_type is None:
        tf_internals.tf_set_logits(x, logits)
        return x
    return _REMAKE[op_type](logits)


def recompute(fn, run):
    """`run(fn)`, a recompute of the segment `fn`, keeping the logits of its
    last output: the recomputed function returns them as one more output,
    so that the gradient of a loss that reads them reaches the segment."""
    found = []  # [op_type] once the forward found logits, [False] if none.

    def with_logits(*inputs):
        outputs = fn(*inputs)
        logits, op_type = of(outputs[-1])
        if not found:  # The forward; replays return the same.
            found.append(False if logits is None else op_type)
        return outputs if logits is None else (*outputs, logits)

    recomputed = run(with_logits)

    def call(*inputs):
        outputs = recomputed(*inputs)
        if found[0] is False:
            return outputs
        outputs, logits = tuple(outputs[:-1]), outputs[-1]
        return (*outputs[:-1], attach(outputs[-1], logits, found[0]))

    return call


def carried(outputs):
    """How many of a recomputed segment's last outputs carry a gradient: the
    last, and the one before it when the last is its logits."""
    if len(outputs) > 1 and of(outputs[-2])[0] is outputs[-1]:
        return 2
    return 1


def through(x, op, on_logits=True):
    """`op(x)` for a pass-through `op` on a layer output, carrying the logits
    of `x`: `op` applied to them too, or, with `on_logits=False` (an op
    whose backward does nothing), the logits themselves.

    Where the loss finds the logits through `x`'s op, the result is that op
    again on the logits (`attach`), which then carry the pass-through: `op`
    on them, or `op(x)` as a control dependency."""
    logits, op_type = of(x)
    if op_type is None:
        y = op(x)
        if logits is not None:
            attach(y, op(logits) if on_logits else logits, None)
        return y
    if on_logits:
        return attach(None, op(logits), op_type)
    with tf.control_dependencies([op(x)]):
        return attach(None, logits, op_type)
