"""Times one layer call on JAX: its jitted forward and its jitted pullback.

The forward is the layer's `stateless_call`, compiled by `jax.jit` the way
the training step compiles it; the backward is the pullback of `jax.vjp`
(a pytree holding the forward's residuals), compiled on its own, so its time
holds no forward. Clocks stop after `block_until_ready`.
"""

import jax
import jax.numpy as jnp

from keras_autovm.mechanisms.base import call_values
from keras_autovm.mechanisms.base import median_seconds
from keras_autovm.mechanisms.base import variable_values


def time_call(operation, args, kwargs, repeats):
    """`(forward_s, backward_s)` of one layer call; see `Mechanism.time_call`."""
    tv, ntv = variable_values(operation)
    leaves, tree = jax.tree.flatten(args)
    # Differentiate for the float inputs only: integer ones have no gradient.
    floats = [i for i, x in enumerate(leaves) if _is_float(x)]

    def forward(tv, xs):
        full = list(leaves)
        for i, x in zip(floats, xs):
            full[i] = x
        return call_values(operation, tv, ntv, jax.tree.unflatten(tree, full), kwargs)

    xs = [leaves[i] for i in floats]
    fwd = jax.jit(forward)
    fwd_s = median_seconds(lambda: fwd(tv, xs), jax.block_until_ready, repeats)
    outputs, pullback = jax.vjp(forward, tv, xs)
    if not all(_is_float(x) for x in jax.tree.leaves(outputs)):
        return fwd_s, 0.0  # Nothing to differentiate (integer outputs).
    cotangent = jax.tree.map(jnp.ones_like, outputs)
    bwd = jax.jit(lambda pullback, cotangent: pullback(cotangent))
    bwd_s = median_seconds(lambda: bwd(pullback, cotangent),
                           jax.block_until_ready, repeats)
    return fwd_s, bwd_s


def _is_float(x):
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
