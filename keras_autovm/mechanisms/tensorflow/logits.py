"""Keeping the logits Keras's TensorFlow losses read from a layer output.

On TensorFlow, Keras's softmax and sigmoid attach their input to their
output (`tf_internals.tf_logits`), and the cross-entropy losses compute from
those logits, not from the probabilities. A tensor AutoVM puts in a layer
output's place (a recompute segment's output, an identity that marks where
the backward pass reaches, a pass-through that moves pages) must carry
logits too, ones the gradient tape reaches: without them the loss is
computed from the probabilities, which rounds differently. MobileNet, whose
classifier is a softmax, then got gradients a few ulps off, and a model
that sensitive trained to weights 1.1e-2 away in two steps.
"""

from keras_autovm.mechanisms.tensorflow import internals as tf_internals


def recompute(fn, run):
    """`run(fn)`, a recompute of the segment `fn`, keeping the logits of its
    last output: the recomputed function returns them as one more output,
    so that the gradient of a loss that reads them reaches the segment."""
    has_logits = []

    def with_logits(*inputs):
        outputs = fn(*inputs)
        logits = tf_internals.tf_logits(outputs[-1])
        if not has_logits:  # The forward; replays return the same.
            has_logits.append(logits is not None)
        return outputs if logits is None else (*outputs, logits)

    recomputed = run(with_logits)

    def call(*inputs):
        outputs = recomputed(*inputs)
        if not has_logits[0]:
            return outputs
        outputs, logits = tuple(outputs[:-1]), outputs[-1]
        tf_internals.tf_set_logits(outputs[-1], logits)
        return outputs

    return call


def carried(outputs):
    """How many of a recomputed segment's last outputs carry a gradient: the
    last, and the one before it when the last is its logits."""
    if len(outputs) > 1 and tf_internals.tf_logits(outputs[-2]) is outputs[-1]:
        return 2
    return 1


def through(x, op, on_logits=True):
    """`op(x)` for a pass-through `op` on a layer output, carrying the logits
    of `x`: `op` applied to them too, or, with `on_logits=False` (an op
    whose backward does nothing), the logits themselves."""
    logits = tf_internals.tf_logits(x)
    y = op(x)
    if logits is not None:
        tf_internals.tf_set_logits(y, op(logits) if on_logits else logits)
    return y
