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
the optimizer's, built first if Keras has not yet, layer state and
metrics), and runs Keras's training function on it, through an iterator
over that batch alone whose element spec is the fit's
(`one_batch.one_batch_iterator`): the function traced and measured is the one the
steps after it run. Keras's function for a batch given outside an
iterator is another program: on an H200, ResNet-152's at batch 264 under
an 8 GiB cap peaked at 7.85 and 7.91 GiB, and the iterator function's
first step after it filled the cap; in two of three runs the step after
that ran out of memory (results/tensorflow/rerun/). The measured
step compiles and is not timed. The first one (without XLA) also tunes
cuDNN's convolutions (the fit's first at its batch size), with scratch
taken wherever memory is free, so it is not judged where it did not run
within its limit (`FirstSteps._warming`): over it, the next step is
measured under the same plan (the messages call it the second step); out
of memory, it is undone and run again under the same plan, once. Then a
measured step:

- it ran out of memory: the variables are put back (metrics Keras built
  as the step was traced are reset), the overhead is learnt as on the
  other backends (`oom.overhead_after_oom`), the batch size is replanned,
  the step retraced and run again; where no plan fits what it showed, see
  below;
- it ran within its limit (the budget less the headroom): the plan is kept;
- it ran over its limit, over the budget, or its peak reached the
  allocator's limit (`Mechanism.fills_allocator`): the step stands, the
  overhead (measured peak over predicted) is learnt, the batch size is
  replanned, and the next step runs under the new plan, measured in its
  turn. A step within the budget but over its limit is not kept: on an
  H200, ResNet-152's at batch 264 (8 GiB cap) peaked 1.8 KB and, with 5%
  headroom, 45 MB short of the cap, and each time the third step ran out
  of memory; another first step, 218 MB short, trained
  (results/tensorflow/rerun/, results/tensorflow/workspace/).

Where no plan fits what a step showed, the last plan measured within its
limit for the batch size comes back; without one, the plan of least
predicted peak, made without the overhead just learnt (`PlanBook.least`),
runs next and is measured in its turn (however loose), since one plan's
overhead need not be another's (VGG-19 at batch 64 under a 6.47 GiB cap
on an H200: `auto`'s plan peaked 0.71 GiB over its prediction, and the
least plan trained at 0.99x its own; results/tensorflow/oversub/); where
that plan is the one that just ran, is over the limit even without the
overhead, or would run under XLA (a step there cannot be undone), the
`PlanError` is the user's.

After `RETRIES` replans, a plan over its limit is kept and said, and a
step out of memory is the user's error. Only with `steps_per_execution=1`
(one batch a call). The allocator's peak is reset before each measured
step: an epoch's peak counts from its last measured step, the highest
judged is `first_step_peak_bytes` in the runtime's stats, and a first step
not judged is `warmup_peak_bytes` (over its limit) or `warmup_reruns` (out
of memory); `least_plan_runs` counts the least plans run.

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
from keras_autovm.mechanisms.tensorflow.one_batch import batch_for
from keras_autovm.mechanisms.tensorflow.one_batch import next_batch
from keras_autovm.mechanisms.tensorflow.one_batch import tensor_spec
from keras_autovm.planner import PlanError
from keras_autovm.planner import format_bytes
from keras_autovm.planner import overhead_text
from keras_autovm.runtime import plan_key as _key

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
            and applied.plan.result.peak_bytes * (TIGHT if factor is None else factor)
            > plans.headroom_limit)


class FirstSteps:
    """`fit`'s training function `function`, measuring the first step of
    each tight plan on the GPU (see the module's docstring)."""

    def __init__(self, model, runtime, function):
        self.model, self.runtime, self.function = model, runtime, function
        self.where = device()
        self.replans = 0
        # The plan whose first step was not judged (`_warming`): its next
        # measured step is its second.
        self.second = None

    def __call__(self, iterator):
        if self.where is None or not self._wanted(self.runtime.current):
            return self.function(iterator)
        return self._measured(next_batch(iterator), tensor_spec(iterator))

    def _wanted(self, applied):
        runtime = self.runtime  # A least plan is measured however loose.
        least = runtime.least_keys and _key(applied.plan) in runtime.least_keys
        return (self.model.steps_per_execution == 1
                and (_tight(runtime, applied) or least)
                and _key(applied.plan) not in runtime.fitted_keys)

    def _measured(self, data, spec):
        """Runs the step on `data` (the batch taken from the fit's iterator,
        whose element spec is `spec`, or `None` where Keras's iterator
        function cannot be given it alone) until it runs."""
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        batch = batch_for(data, spec)
        while True:
            applied = self.runtime.plan_for_inputs(x)
            if not self._wanted(applied):  # Another batch size, or measured.
                return self.function(batch())
            saved = _host_copies(self.model)
            warming = self._warming(applied.plan)
            try:
                logs, peak = run_measured(self.function, batch(), self.where)
            except tf.errors.ResourceExhaustedError as raised:
                # Without its traceback: its frames hold the step's tensors.
                error = raised.with_traceback(None)
            else:
                # This step compiled; in a list, Keras compiles its
                # iterator function on the next step too. Neither times
                # the plan.
                self.runtime.untimed_steps = 1 if spec is not None else 2
                return self._ran(applied.plan, peak, logs, warming)
            if self.model.jit_compile:
                raise _under_xla(error) from error
            _restore(saved, self.model)
            del saved
            gc.collect()
            if warming:  # The same plan again, its convolutions now tuned.
                self._count("warmup_reruns")
                self.second = _key(applied.plan)
                self.runtime.warn(
                    f"{_seen(applied.plan, 'ran out of GPU memory', self.runtime.plans)} "
                    "TensorFlow tunes each new convolution in the first step "
                    "that runs it, with scratch taken where memory is free: "
                    "run again under the same plan.")
                continue
            self._after_out_of_memory(applied.plan, error)

    def _warming(self, plan):
        """Whether the step about to be measured under `plan` is the fit's
        first at its batch size without XLA: cuDNN's autotuning runs in it,
        so it is not judged. TensorFlow times each new convolution's
        algorithms in the first step that runs it, with scratch of up to
        4 GiB taken wherever memory is free (the logs of
        results/tensorflow/warmup/ show attempts of 0.6 to 3.6 GiB it let
        fail). On an H200 under an 8 GiB cap a VGG-19 plan at batch 96 ran
        at 6.63 GiB after another step, but ran out of memory as a
        process's first step
        (results/tensorflow/kept_overhead/8081a74/); the step after the
        first peaked 0.04 to 0.15 GiB lower in five runs
        (results/tensorflow/warmup/). A first step that runs over its limit
        is followed by another under the same plan, measured and judged;
        one that runs out of memory is undone and run again once. Another
        plan at that batch size runs the same convolutions, tuned: its first
        step is judged. Under XLA a step out of memory cannot be undone, and
        XLA tunes as it compiles: judged as it ran."""
        batch = plan.graph.batch_size
        if self.model.jit_compile or batch in self.runtime.tuned:
            return False
        self.runtime.tuned.add(batch)
        return True

    def _nth(self, plan):
        """Which step of `plan` was judged: its second after a first step
        that was not (`_warming`)."""
        return "second" if _key(plan) == self.second else "first"

    def _count(self, counter):
        stats = self.runtime.stats
        stats[counter] = stats.get(counter, 0) + 1

    def _ran(self, plan, peak, logs, warming=False):
        """A measured step that ran: kept within its limit (the budget less
        the headroom); else, where it was the first (`warming`), the next
        step is measured under the same plan; else replanned for the next
        step (`_replan`: where no plan fits what it showed)."""
        runtime, plans = self.runtime, self.runtime.plans
        stats = runtime.stats
        full = runtime.mechanism.fills_allocator(peak)
        within = peak <= plans.headroom_limit and not full
        if warming and not within:  # Not judged: the next step is measured.
            stats["warmup_peak_bytes"] = max(stats.get("warmup_peak_bytes", 0), peak)
            self.second = _key(plan)
            # Nor learnt from at the epoch's end, should it be the last step.
            tf.config.experimental.reset_memory_stats(self.where)
            return logs
        stats["first_step_peak_bytes"] = max(stats.get("first_step_peak_bytes", 0), peak)
        if within:
            self._fitted(plan)
            return logs
        if self.replans == RETRIES:
            _learn(plans, plan, peak)
            runtime.fitted_keys.add(_key(plan))  # Not measured again; no fallback.
            runtime.warn(
                f"{_seen(plan, f'peaked at {format_bytes(peak)}', plans, self._nth(plan))} Kept: "
                f"over its limit after {RETRIES} replans; plans made from now "
                f"on allow for a measured memory overhead of {_overhead(plans)}.")
            return logs
        _learn(plans, plan, peak)
        # Within the budget is not enough: on an H200, ResNet-152's first
        # step at batch 264 (8 GiB cap, 5% headroom) peaked 45 MB short of
        # the cap, over its limit, and the third step ran out of memory
        # (results/tensorflow/workspace/). The step stood; the next one runs
        # under the new plan.
        seen = _seen(plan, f"peaked at {format_bytes(peak)}, {_where(peak, full, plans)}",
                     plans, self._nth(plan))
        self._replan(plan, seen, "first_step_replans",
                     runtime.fitted_plans.get(plan.graph.batch_size))
        return logs

    def _fitted(self, plan):
        self.runtime.fitted_keys.add(_key(plan))
        self.runtime.fitted_plans[plan.graph.batch_size] = plan

    def _after_out_of_memory(self, plan, error):
        """Learns from a step that ran out of memory, and replans so that the
        same batch runs again (`_replan`)."""
        runtime, plans = self.runtime, self.runtime.plans
        if self.replans == RETRIES:
            raise error
        memory = runtime.mechanism.device_memory() or plans.budget_bytes
        plans.learn(oom.overhead_after_oom(plan, plans, memory),
                    oom.extra_after_oom(plan, memory))
        seen = _seen(plan, "ran out of GPU memory", plans, self._nth(plan))
        fallback = runtime.fitted_plans.get(plan.graph.batch_size)
        self._replan(plan, seen, "out_of_memory_replans", fallback)

    def _replan(self, plan, seen, counter, fallback=None):
        """Puts a new plan for `plan`'s batch size in force; where none fits
        what the step showed, `fallback` (a plan measured within its limit
        before), else the least plan (`_least`), else the `PlanError` is
        the user's."""
        runtime, plans = self.runtime, self.runtime.plans
        batch = plan.graph.batch_size
        try:
            new = plans.plan(batch, plans.shapes_at(batch))
            said = (f"Replanned with a measured memory overhead of "
                    f"{_overhead(plans)} (predicted peak now "
                    f"{format_bytes(new.result.peak_bytes)}).")
        except PlanError as no_plan:
            if fallback is not None:
                new, said = fallback, ("No plan fits what it showed; back to the "
                                       "plan measured within its limit before.")
                runtime.fitted_keys.add(_key(new))  # It ran: not measured again.
            else:
                new, said = self._least(plan), ("No plan fits what it showed; the plan "
                                                "of least predicted peak, made without "
                                                "that overhead, runs next, judged by its "
                                                "own step.")
            if new is None:  # The user's, saying what was measured.
                no_plan.args = (f"{seen} {no_plan.args[0]}",)
                raise
        self.replans += 1
        self._count(counter)
        runtime.replace(new)
        runtime.warn(f"{seen} {said}")
        self.function = self._retraced()

    def _least(self, plan):
        """The plan of least predicted peak for `plan`'s batch size, made
        without the learnt overhead (`PlanBook.least`); `None` where it is
        `plan` (so it runs once), is over the limit even without the
        overhead, or would run under XLA: a plan that does not swap keeps
        the step's XLA, and made without the overhead it may well run out
        of memory there, which cannot be undone."""
        if self.model.jit_compile:
            return None
        least = self.runtime.plans.least(plan.graph.batch_size)
        if least is None or _key(least) == _key(plan):
            return None
        self._count("least_plan_runs")
        self.runtime.least_keys.add(_key(least))
        return least

    def _retraced(self):
        """Keras's training function traced anew, leaving this one in place."""
        model = self.model
        installed = vars(model).get("train_function")
        model.make_train_function(force=True)
        fresh = model.train_function
        vars(model)["train_function"] = installed
        return fresh


def _ratio(peak, plan):
    return peak / max(plan.result.peak_bytes, 1)


def _learn(plans, plan, peak):
    """Learns how far a measured peak is over `plan`'s prediction, as a
    ratio and in bytes; plans made from then on fit whichever leaves less
    (`budget.limit_for`). On an H200, ResNet-152 at batch 264 used 2.68 to
    3.03 GiB more than plans of 4.87 to 6.80 GiB predicted, 1.43x to 1.62x:
    a ratio learnt from a larger plan under-counted a smaller one by 12%,
    the bytes by 1% (results/tensorflow/trace/)."""
    plans.learn(_ratio(peak, plan), peak - plan.result.peak_bytes)


def _where(peak, full, plans):
    if full:
        return "filled the allocator's limit"
    return "over the budget" if peak > plans.budget_bytes else "over its limit"


def _overhead(plans):
    return overhead_text(plans.memory_scale, plans.memory_extra)


def _seen(plan, what, plans, nth="first"):
    return (f"AutoVM: the {nth} step under its plan for batch size "
            f"{plan.graph.batch_size} {what} (plan: "
            f"{format_bytes(plan.result.peak_bytes)}, limit "
            f"{format_bytes(plans.headroom_limit)}, budget "
            f"{format_bytes(plans.budget_bytes)}).")


def _under_xla(error):
    """`error` (a step under XLA ran out of memory), saying why AutoVM does
    not run it again: on an H100, TensorFlow aborted (`Check failed: h !=
    kInvalidChunkHandle` in its allocator) when a variable was assigned
    after such a step, which had taken the variables' buffers."""
    return type(error)(
        None, None,
        f"{error.message}\nAutoVM cannot undo a step that ran out of memory "
        "under XLA, so it does not run it again with a smaller plan: compile "
        "the model with jit_compile=False.")


def run_measured(function, batch, where):
    """Runs Keras's training `function` on `batch` (one batch, in a list or
    a one-batch iterator): its logs, and the allocator's peak in bytes
    while it ran."""
    _sync(where)
    tf.config.experimental.reset_memory_stats(where)
    logs = function(batch)
    _sync(where)
    return logs, tf.config.experimental.get_memory_info(where)["peak"]


def _host_copies(model):
    """A host copy of each variable a training step can change."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:
        # Keras builds it as the first step is traced (without a distribution
        # strategy): built now, its slots are copied too.
        optimizer.build(model.trainable_variables)
    variables = [*model.variables, *(optimizer.variables if optimizer else ()),
                 *model.metrics_variables]
    unique = {id(v): v for v in variables}
    return [(v, v.numpy()) for v in unique.values()]


def _restore(saved, model):
    for variable, value in saved:
        variable.assign(value)
    kept = {id(variable) for variable, _ in saved}
    for metric in model.metrics:
        # Built as the failed step was traced (Keras builds compiled metrics
        # then): before it, they were as reset.
        if any(id(v) not in kept for v in metric.variables):
            metric.reset_state()


def _sync(where):
    if where.startswith("GPU"):
        tf.test.experimental.sync_devices()
