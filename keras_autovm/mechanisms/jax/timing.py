"""Times layer calls on JAX: each call's jitted forward and its jitted
pullback, compiled together before any is timed.

The forward is the layer's `stateless_call`, compiled by `jax.jit` the way
the training step compiles it; the backward is the pullback of `jax.vjp`
(a pytree holding the forward's residuals), compiled on its own, so its time
holds no forward. Both run on the layer's variables and on zeros of the
shapes the call saw, residuals included, so a call is timed from its
shapes: the profiling pass runs abstractly (`jax.eval_shape`), and no layer
runs op by op. Run eagerly, JAX
compiles every operation of every call apart: on this project's CPU,
ResNet50 at 64x64, batch 2, profiled in 24.5 to 27.9 s with the pass and
each `jax.vjp` run eagerly, in 11.2 to 14.0 s as here. XLA compiles without
Python's lock, so while Python lowers one call the last one compiles, on
a thread pool without a GPU. Clocks stop after `block_until_ready`; only
one call's arrays exist at a time.
"""

import concurrent.futures
import os

import jax
import jax.numpy as jnp
import keras

from keras_autovm.mechanisms.timing import CallTimer
from keras_autovm.mechanisms.timing import call_values
from keras_autovm.mechanisms.timing import link_gbps
from keras_autovm.mechanisms.timing import median_seconds
from keras_autovm.mechanisms.timing import variable_values
from keras_autovm.mechanisms.jax.calls import is_float
from keras_autovm.mechanisms.jax.swap import host_kind

# Programs compiled at once without a GPU: on this project's 2-core CPU, 2
# threads compiled ResNet50's calls in 6.4 s, 1 thread in 8.7 s. On a GPU
# one: XLA times candidate kernels on the device as it compiles, and
# compiles side by side disturbed each other (ResNet-152 at batch 64 on an
# H100: the whole profile took 56.6 s with 8 threads, 47.2 s with 4, 26.5
# and 27.6 s with 1; docs/planner.md).
THREADS = max(1, min(8, os.cpu_count() or 1))


def time_call(operation, args, kwargs, repeats):
    """`(forward_s, backward_s)` of one layer call; see `Mechanism.time_call`."""
    call = _Call(operation, args, kwargs)
    call.compile()
    return call.time(repeats)


def abstract_pass(run, inputs):
    """`run(inputs)` traced on the inputs' shapes (`jax.eval_shape`): the
    layers run on tracers, nothing is computed."""
    return jax.eval_shape(run, jax.tree.map(_spec, inputs))


class CompiledTimer(CallTimer):
    """A `CallTimer` that keeps each call's shapes as it is added. Its
    `results()` (once) lowers every call's two programs and compiles them
    on `threads` worker threads (`THREADS` without a GPU, one with one),
    then times them one call at a time. `progress` counts calls compiled."""

    def __init__(self, repeats, progress=None, threads=1):
        super().__init__(None, repeats, progress)
        self.threads = threads
        self.calls = {}

    def __contains__(self, key):
        return key in self.calls

    def add(self, key, operation, args, kwargs):
        self.calls[key] = _Call(operation, args, kwargs)

    def results(self):
        pool = concurrent.futures.ThreadPoolExecutor(self.threads)
        try:
            compiling = []
            for call in self.calls.values():
                # Tracing runs Keras's Python, here; XLA compiles meanwhile.
                call.lower()
                compiling.append(pool.submit(call.compile))
            for done, future in enumerate(concurrent.futures.as_completed(compiling)):
                future.result()
                if self.progress is not None:  # Compiling is most of the time.
                    self.progress(done + 1)
        finally:  # An error (or Ctrl-C) does not wait for the queued compiles.
            pool.shutdown(cancel_futures=True)
        for key, call in self.calls.items():
            self.times[key] = call.time(self.repeats)
        return dict(self.times)


class _Call:
    """One layer call, by its shapes: the non-array arguments as given,
    every array as its shape and dtype."""

    def __init__(self, operation, args, kwargs):
        self.operation = operation
        # Keras's tree, not JAX's: Keras's own containers (a `TrackedList` of
        # inputs) are leaves to JAX, and their tracers would outlive the pass.
        leaves = keras.tree.flatten((args, kwargs))
        self.structure = keras.tree.pack_sequence_as((args, kwargs), [0] * len(leaves))
        self.leaves = [_spec(x) if _is_array(x) else x for x in leaves]
        # Differentiated for the float inputs only: integers have no gradient.
        self.floats = [i for i, x in enumerate(self.leaves) if _is_float(x)]
        self.others = [i for i, x in enumerate(self.leaves)
                       if _is_array(x) and i not in self.floats]
        self.fwd = self.bwd = None

    def _forward(self, tv, ntv, xs, others):
        full = list(self.leaves)
        for i, x in zip(self.floats + self.others, list(xs) + list(others)):
            full[i] = x
        args, kwargs = keras.tree.pack_sequence_as(self.structure, full)
        return call_values(self.operation, tv, ntv, args, kwargs)

    def _arguments(self):
        """The forward's arguments: the layer's variables, then specs of the
        float inputs and of the other arrays."""
        tv, ntv = variable_values(self.operation)
        return (tv, ntv, [self.leaves[i] for i in self.floats],
                [self.leaves[i] for i in self.others])

    def lower(self):
        if self.fwd is not None:
            return
        tv, ntv, xs, others = self._arguments()
        self.fwd = jax.jit(self._forward).lower(tv, ntv, xs, others)

        def pullback(tv, ntv, xs, others):
            return jax.vjp(lambda tv, xs: self._forward(tv, ntv, xs, others), tv, xs)

        outputs, back = jax.eval_shape(pullback, tv, ntv, xs, others)
        if all(_is_float(x) for x in jax.tree.leaves(outputs)):
            self.bwd = jax.jit(lambda back, cotangent: back(cotangent)).lower(back, outputs)
            self.back = (back, outputs)

    def compile(self):
        self.lower()
        self.fwd = self.fwd.compile()
        if self.bwd is not None:
            self.bwd = self.bwd.compile()

    def time(self, repeats):
        """`(forward_s, backward_s)` on zeros (the backward's cotangents ones)."""
        tv, ntv, xs, others = self._arguments()
        xs, others = _zeros(xs), _zeros(others)
        fwd_s = median_seconds(lambda: self.fwd(tv, ntv, xs, others),
                               jax.block_until_ready, repeats)
        del xs, others
        if self.bwd is None:
            return fwd_s, 0.0  # Nothing to differentiate (integer outputs).
        back, outputs = self.back
        back = _zeros(back)
        cotangent = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), outputs)
        bwd_s = median_seconds(lambda: self.bwd(back, cotangent),
                               jax.block_until_ready, repeats)
        return fwd_s, bwd_s


def _zeros(tree):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def _spec(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _is_array(x):
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _is_float(x):
    return _is_array(x) and is_float(x)


# Bytes each copy of the link measurement moves.
LINK_BYTES = 64 << 20


def measure_link(device=None, repeats=3):
    """GB/s of JAX's own copies as its swap makes them (`jax.device_put`
    to the device's host memory kind, `swap.host_kind`, and back): to the
    host, to the device, and both at once, under the pinned link's keys;
    `None` without a GPU. `device` names the device to copy from (tests
    copy between a CPU's own memories); the first GPU by default."""
    if device is None:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if not gpus:
            return None
        device = gpus[0]
    on_device = jax.device_put(jnp.zeros((LINK_BYTES,), jnp.uint8), device)
    to_host = on_device.sharding.with_memory_kind(host_kind(device))
    to_device = on_device.sharding.with_memory_kind("device")
    # What a swap copies back is what its copy to the host made.
    on_host = jax.block_until_ready(jax.device_put(on_device, to_host))

    def d2h():
        return jax.device_put(on_device, to_host)

    def h2d():
        return jax.device_put(on_host, to_device)

    return link_gbps(LINK_BYTES, d2h, h2d, lambda: (d2h(), h2d()),
                     jax.block_until_ready, repeats)
