"""A plan's first training step on TensorFlow: measured, and run again when
it ran out of memory.

Under XLA (Keras's default on TensorFlow) the training step is one compiled
program whose scratch the planner does not model: on an H100, VGG-19's
needed 1.51x to 1.58x the peak its plan predicted, and recompute-only plans
AutoVM had accepted ran out of memory in their first step (docs/results.md,
"Where TensorFlow's memory goes"). Measuring the forward and backward pass
alone, on zeros, before the first step did not save them: that is not the
step's program (no loss, no optimizer update), and at batch 45 under an
8 GiB cap the plan it passed ran out of memory (results/tensorflow/probe/).

So the measurement is the first step itself. For a plan predicted within
`TIGHT` times its limit, `FirstSteps` takes the step's batch from `fit`'s
iterator, keeps a host copy of every variable a step can change (weights,
optimizer and layer state, metrics), and runs Keras's compiled one-step
function on it (Keras compiles it once more for a batch given outside the
iterator: a second compile, once per measured plan):

- it ran out of memory: the variables are put back, the overhead is learnt
  as on the other backends (`oom.overhead_after_oom`), the batch size is
  replanned, the step retraced and run again;
- it ran over the plan's limit: the step stands, the overhead (measured
  peak over predicted) is learnt, and the next step runs under a new plan,
  measured in its turn.

After `RETRIES` replans, the plan is kept as it is and said, or, out of
memory, the error is the user's. Only with `steps_per_execution=1` (one
batch a call).

A step that ran out of memory under XLA is not run again: on an H100,
TensorFlow aborted its process when AutoVM put a variable back after one
(VGG-19, batch 51, 8 GiB cap; results/tensorflow/first_step/). So the
mechanism turns XLA off for plans predicted not to fit under it
(`turns_xla_off`, from `TensorFlowMechanism.install`), and a step under XLA
that runs out of memory is the user's error, saying so.
"""

import gc

import keras
import tensorflow as tf

from keras_autovm import oom
from keras_autovm.planner import PlanError
from keras_autovm.planner import format_bytes

# Replans after a first step over its limit or out of memory, per `fit`'s
# training function.
RETRIES = 3
# Plans predicted to fit this many times over are not measured (a
# measurement copies every variable to the host and compiles the step once
# more). TensorFlow steps were measured at 1.58x their plan (VGG-19 under
# XLA, no cap) and at least 1.69x (batch 45 under an 8 GiB cap), on an H100.
TIGHT = 2.0
# How much more than its plan a step under XLA is taken to need: VGG-19's
# measured 1.51x to 1.58x (keep-all plans, no cap) and at least 1.69x (a
# recompute plan at batch 45, 8 GiB cap), on an H100. Without XLA, 1.09x to
# 1.35x.
XLA_OVERHEAD = 1.7


def device():
    """The device whose allocator is measured: the first GPU, or `None`."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else None


def turns_xla_off(runtime):
    """Whether the plan in force, on a GPU, is predicted not to fit its
    limit under XLA (`XLA_OVERHEAD`): its steps then run without XLA, where
    one that runs out of memory can be undone and run again."""
    return device() is not None and _tight(runtime, runtime.current, XLA_OVERHEAD)


def _tight(runtime, applied, factor=None):
    """Whether `applied`'s plan, with a budget, is predicted within
    `factor` (`TIGHT` by default) times its limit."""
    plans = runtime.plans
    return (applied is not None and plans.budget_bytes is not None
            and applied.plan.result.peak_bytes * (TIGHT if factor is None else factor) > plans.headroom_limit)


class FirstSteps:
    """`fit`'s training function `function`, measuring the first step of
    each tight plan on the GPU (see the module's docstring)."""

    def __init__(self, model, runtime, function):
        self.model, self.runtime, self.function = model, runtime, function
        self.replans = 0

    def __call__(self, iterator):
        where = device()
        if where is None or not self._wanted(self.runtime.current):
            return self.function(iterator)
        return self._measured(next_batch(iterator), where)

    def _wanted(self, applied):
        return (applied not in self.runtime.proven and self.model.steps_per_execution == 1
                and _tight(self.runtime, applied))

    def _measured(self, data, where):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        while True:
            applied = self.runtime.plan_for_inputs(x)
            if not self._wanted(applied):  # Another batch size, or proven.
                return self.function([data])
            saved = _host_copies(self.model)
            error = logs = peak = None
            try:
                logs, peak = run_measured(self.function, data, where)
            except tf.errors.ResourceExhaustedError as raised:
                # Without its traceback: its frames hold the step's tensors.
                error = raised.with_traceback(None)
            limit = self.runtime.plans.headroom_limit
            if error is None and peak <= limit:
                self.runtime.proven.add(applied)
                return logs
            if error is not None and self.model.jit_compile:
                raise _under_xla(error)
            if error is not None:
                _restore(saved)
            del saved
            gc.collect()
            if self.replans == RETRIES:
                return self._give_up(applied, logs, peak, error)
            self._replan(applied.plan, peak, error)
            if error is None:
                return logs  # The next step runs under the new plan.

    def _replan(self, plan, peak, error):
        runtime, plans = self.runtime, self.runtime.plans
        if error is None:
            overhead = peak / max(plan.result.peak_bytes, 1)
            seen = f"peaked at {format_bytes(peak)}"
        else:
            memory = runtime.mechanism.device_memory() or plans.budget_bytes
            overhead = oom.overhead_after_oom(plan, plans, memory)
            seen = "ran out of GPU memory"
        plans.memory_scale = max(plans.memory_scale, overhead)
        batch = plan.graph.batch_size
        what = (f"AutoVM: the first step under its plan for batch size {batch} {seen}"
                f" (plan: {format_bytes(plan.result.peak_bytes)}, limit "
                f"{format_bytes(plans.headroom_limit)}).")
        try:
            new = plans.plan(batch, plans.shapes_at(batch))
        except PlanError as error:  # The user's, saying what was measured.
            raise PlanError(f"{what} {error}", error.min_budget) from None
        runtime.replace(new)
        self.replans += 1
        key = "first_step_replans" if error is None else "out_of_memory_replans"
        runtime.stats[key] = runtime.stats.get(key, 0) + 1
        runtime.warn(
            f"{what} Replanned with a measured memory overhead of {plans.memory_scale:.2f}x (predicted peak now "
            f"{format_bytes(new.result.peak_bytes)})"
            + ("." if error is None else " and ran the step again."))
        self.function = self._retraced()

    def _give_up(self, applied, logs, peak, error):
        if error is not None:
            raise error
        self.runtime.proven.add(applied)
        self.runtime.warn(
            f"AutoVM: the first step under its plan for batch size "
            f"{applied.plan.graph.batch_size} peaked at {format_bytes(peak)}, over "
            f"the limit of {format_bytes(self.runtime.plans.headroom_limit)} "
            f"after {RETRIES} replans; training goes on with that plan.")
        return logs

    def _retraced(self):
        """Keras's training function traced anew, leaving this one in place."""
        model = self.model
        installed = vars(model).get("train_function")
        model.make_train_function(force=True)
        fresh = model.train_function
        vars(model)["train_function"] = installed
        return fresh


def _under_xla(error):
    """`error` (a step under XLA ran out of memory), saying why AutoVM does
    not run it again: on an H100, TensorFlow aborted (`Check failed: h !=
    kInvalidChunkHandle` in its allocator) when a variable was assigned
    after such a step, which had taken the variables' buffers."""
    return type(error)(
        None, None,
        f"{error.message}\nAutoVM cannot undo a step that ran out of memory "
        "under XLA, so it does not run it again with a smaller plan: compile "
        "the model with jit_compile=False (AutoVM turns XLA off itself from "
        "the start of `fit` for plans it predicts not to fit under XLA).")


def next_batch(iterator):
    """The next batch of `fit`'s iterator; `StopIteration` at its end, as
    Keras's training function raises."""
    if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            raise StopIteration
        return optional.get_value()
    return next(iter(iterator))


def run_measured(function, data, where):
    """Runs Keras's training `function` on one batch `data`: its logs, and
    the allocator's peak in bytes while it ran."""
    _sync(where)
    tf.config.experimental.reset_memory_stats(where)
    logs = function([data])  # Keras runs a batch given in a list as one step.
    _sync(where)
    return logs, tf.config.experimental.get_memory_info(where)["peak"]


def _host_copies(model):
    """A host copy of each variable a training step can change."""
    optimizer = getattr(model, "optimizer", None)
    variables = [*model.variables, *(optimizer.variables if optimizer else ()),
                 *model.metrics_variables]
    unique = {id(v): v for v in variables}
    return [(v, v.numpy()) for v in unique.values()]


def _restore(saved):
    for variable, value in saved:
        variable.assign(value)


def _sync(where):
    if where.startswith("GPU"):
        tf.test.experimental.sync_devices()
