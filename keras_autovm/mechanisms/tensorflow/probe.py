"""A plan's training step on TensorFlow, measured before the first step.

Under XLA (Keras's default on TensorFlow) the training step is one compiled
program whose scratch the planner does not model: on an H100, VGG-19's
needed 1.51x to 1.58x the peak its plan predicted, and recompute-only plans
AutoVM had accepted ran out of memory in their first step (docs/results.md,
"Where TensorFlow's memory goes"). A TensorFlow step fails as a whole and is
not run again (`oom.py`), so before the first step under a plan, `fit_plan`
runs the model's forward and backward once, compiled as the step is, on
zeros of the batch's shape, and reads the allocator's peak. Over the plan's
limit, AutoVM learns the overhead (the measured peak over the predicted
one; as after a step that ran out of memory, if the probe itself did),
replans and measures again, `RETRIES` times at most. Only plans within
`TIGHT` times their limit are measured.

The probe leaves out the loss and the optimizer's update, and its program
is not the step's: on an H100, VGG-19 at batch 45 under an 8 GiB cap was
replanned after its probe (6.83 GiB against 4.96 predicted), the new plan's
probe fitted, and its step still ran out of memory
(results/tensorflow/probe/).
"""

import gc

import keras
import tensorflow as tf

from keras_autovm import internals
from keras_autovm import oom
from keras_autovm.planner import format_bytes

# Replans after a probe over the limit, before the plan is kept as it is.
RETRIES = 2
# Plans predicted to fit this many times over are not measured (a
# measurement compiles the step once more). TensorFlow steps were measured
# at 1.58x their plan (VGG-19 under XLA, no cap) and at least 1.69x (batch
# 45 under an 8 GiB cap, replanned after its probe), on an H100.
TIGHT = 2.0


def device():
    """The device whose allocator is measured: the first GPU, or `None`."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else None


def fit_plan(model, runtime):
    """Measures the step under `runtime.current` and replans while it is over
    the plan's limit, saying so (`runtime.warn`)."""
    where = device()
    if where is None or not _measurable(runtime):
        return
    plans = runtime.plans
    limit = plans.headroom_limit
    for attempt in range(RETRIES + 1):
        plan = runtime.current.plan
        batch = plan.graph.batch_size
        peak = _peak_apart(model, runtime, batch, where)
        if peak is not None and peak <= limit:
            return
        seen = ("ran out of memory" if peak is None else
                f"peaked at {format_bytes(peak)}")
        seen += f" (plan: {format_bytes(plan.result.peak_bytes)})"
        if attempt == RETRIES:
            runtime.warn(f"AutoVM measured its step for batch size {batch} before "
                         f"training: it {seen}, over the limit of "
                         f"{format_bytes(limit)} after {RETRIES} replans; "
                         "training goes on with that plan.")
            return
        plans.memory_scale = max(plans.memory_scale, _overhead(plan, runtime, peak))
        new = plans.plan(batch, plans.shapes_at(batch))  # A PlanError is the user's.
        runtime.replace(new)
        runtime.stats["probe_replans"] = runtime.stats.get("probe_replans", 0) + 1
        runtime.warn(f"AutoVM measured its step for batch size {batch} before "
                     f"training: it {seen}. Replanned with a measured memory "
                     f"overhead of {plans.memory_scale:.2f}x (predicted peak now "
                     f"{format_bytes(new.result.peak_bytes)}).")


def _measurable(runtime):
    plans, current = runtime.plans, runtime.current
    if (current is None or plans.needs_input_shapes or plans.budget_bytes is None
            or current.names("swap")):
        # Explicit swap rewires the step's backward, which a probe would not.
        return False
    return current.plan.result.peak_bytes * TIGHT > plans.headroom_limit


def _overhead(plan, runtime, peak):
    """How much more memory than predicted the plan was measured to need:
    its measured peak over its prediction, or, where the probe ran out of
    memory, what a step that did teaches (`oom.overhead_after_oom`)."""
    if peak is None:
        device = runtime.mechanism.device_memory() or runtime.plans.budget_bytes
        return oom.overhead_after_oom(plan, runtime.plans, device)
    return peak / max(plan.result.peak_bytes, 1)


def _peak_apart(model, runtime, batch_size, where):
    """`step_peak`, leaving the runtime's counts and the allocator's peak as
    they were before it (the first epoch's peak is the training's own)."""
    stats = dict(runtime.stats)
    try:
        return step_peak(model, runtime, batch_size, where)
    finally:
        runtime.stats.clear()
        runtime.stats.update(stats)
        tf.config.experimental.reset_memory_stats(where)


def step_peak(model, runtime, batch_size, where):
    """The allocator's peak, in bytes, while the model's forward and
    backward run once at `batch_size` under the runtime's plan, compiled
    with the model's `jit_compile`; `None` if that ran out of memory. No
    variable changes: layer state is read from, and written to, a scope."""
    fn = internals.functional_of(model)
    x = keras.tree.map_structure(
        lambda t: tf.zeros((batch_size,) + tuple(t.shape[1:]), t.dtype), fn.input)
    state = [(v, v.value) for v in model.non_trainable_variables]
    weights = model.trainable_variables

    @tf.function(jit_compile=bool(model.jit_compile))
    def forward_backward(x):
        runtime.plan_for_inputs(x)
        with tf.GradientTape() as tape, keras.StatelessScope(state_mapping=state):
            outputs = model(x, training=True)
            loss = tf.add_n([tf.reduce_sum(tf.cast(y, tf.float32))
                             for y in tf.nest.flatten(outputs)])
        return tape.gradient(loss, weights)

    _sync(where)
    tf.config.experimental.reset_memory_stats(where)
    try:
        grads = forward_backward(x)
        _sync(where)
        peak = tf.config.experimental.get_memory_info(where)["peak"]
    except tf.errors.ResourceExhaustedError:
        peak = None
    finally:
        grads = forward_backward = None
        gc.collect()
    return peak


def _sync(where):
    if where.startswith("GPU"):
        tf.test.experimental.sync_devices()
