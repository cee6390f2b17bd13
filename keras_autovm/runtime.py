"""What the wrappers of one model consult while it trains.

A `Runtime` holds the plan applied for each batch size it has seen (planned
on first use, since Keras tells callbacks no batch size) and runs each
wrapped layer call under it: recompute segments for backends that
rematerialise per function (the first layer of a segment runs the whole
segment under `mechanism.recompute`, the later layers hand back the
outputs it computed); everything else is the mechanism's
(`call_layer`, `after_layer`, `tag`).
"""

import contextlib
import warnings

import keras

from keras_autovm import internals


def plan_key(plan):
    """What makes two plans run the same step: batch size and actions."""
    return plan.graph.batch_size, tuple(sorted(plan.actions.items()))


class Runtime:
    """Applies plans to the layer calls of one wrapped model.

    Args:
        mechanism: the backend's `keras_autovm.mechanisms.base.Mechanism`.
        plans: a `keras_autovm.budget.PlanBook` (batch size -> `Plan`).
        layers: maps op name to the (unwrapped) layer object.
        batch_size: the batch size to use when a traced batch has no static
            size (TensorFlow's input pipelines). Defaults to `None`.
        warn: called with the text of each warning issued while training
            (the callback's `Console.warn`, which keeps them off Keras's
            progress bar). Defaults to `warnings.warn`.
    """

    def __init__(self, mechanism, plans, layers, batch_size=None, warn=None):
        self.mechanism = mechanism
        self.plans = plans
        self.batch_size = batch_size
        self.warn = warn or warnings.warn
        self.current = None  # The `AppliedPlan` of the largest batch size.
        self._layers = layers
        self._applied = {}  # (batch size, input shapes or None) -> AppliedPlan
        self._active = None  # The plan of the step being traced.
        self._stash = {}
        # Applied plans a training step has completed under (see `oom`).
        self.proven = set()
        # TensorFlow's measured first steps (`first_step.py`): the plans,
        # by batch size and actions, whose step was measured within the
        # budget, the last such plan per batch size, and how many steps to
        # come compile (the callback does not time them).
        self.fitted_keys = set()
        self.fitted_plans = {}
        self.untimed_steps = 0
        # Batch sizes whose first measured step ran (or ran out of memory)
        # without XLA: cuDNN has tuned their convolutions.
        self.tuned = set()
        # Plans of least predicted peak put in force where the overhead a
        # step showed left no plan: measured however loose (`first_step`).
        self.least_keys = set()
        # Whether a failed replan kept a plan that ran within its limit,
        # said once a fit (`AutoVM._kept`).
        self.kept_said = False
        # Whether a step was left as Keras runs it (see `plan_for_inputs`).
        self.declined = False
        # What was carried out, for reports and tests.
        self.stats = {"segments_run": 0, "segments_replayed": 0}
        # Set while a step runs unchanged (`stepping_aside`).
        self.aside = False

    def ran_within_limit(self, plan):
        """Whether `plan` is the last plan whose measured step ran within
        its limit for its batch size (TensorFlow's `first_step`)."""
        fitted = self.fitted_plans.get(plan.graph.batch_size)
        return fitted is not None and plan_key(fitted) == plan_key(plan)

    @contextlib.contextmanager
    def stepping_aside(self):
        """While a mechanism runs a step unchanged (`Plan.unchanged`): the
        wrappers call their layers directly, as if they were not there."""
        before, self.aside = self.aside, True
        try:
            yield
        finally:
            self.aside = before

    def replace(self, plan):
        """Applies `plan` from now on; other batch sizes are planned anew."""
        self._applied, self._active = {}, None
        batch_size = plan.graph.batch_size
        self._add((batch_size, self.plans.shapes_at(batch_size)), plan)

    def repredict(self, old, new):
        """Puts `new`, plan `old` predicted again with its actions kept, in
        `old`'s place: for the batch size and input shapes `old` is applied
        for (the plans of other sizes and shapes, and what they proved,
        stay), and as the size's measured plan where `old`'s actions are."""
        found = [a for a in self._applied.values() if a.plan is old]
        if not found:
            return self.replace(new)
        for applied in found:
            applied.plan = new
        size = new.graph.batch_size
        fitted = self.fitted_plans.get(size)
        if fitted is not None and plan_key(fitted) == plan_key(new):
            self.fitted_plans[size] = new
        return None

    def plan_for(self, batch_size, input_shapes=None):
        """The `AppliedPlan` for `batch_size` (and, for a model whose inputs
        have unknown dimensions, `input_shapes`), made on first use; the
        plan in force when the size is unknown, or the shapes are needed and
        were never seen."""
        batch_size = batch_size or self.batch_size
        if self.plans.needs_input_shapes:
            input_shapes = input_shapes or self.plans.shapes_at(batch_size)
            if input_shapes is None:
                return self.current
        else:
            input_shapes = None
        if batch_size is None:
            return self.current
        key = (batch_size, input_shapes)
        if key not in self._applied:
            self._add(key, self.plans.plan(batch_size, input_shapes))
        return self._applied[key]

    def plan_for_inputs(self, inputs):
        """The `AppliedPlan` for a batch of model inputs, used by the layer
        calls of the step being traced; fails if its size is unknown.
        `None` (the step runs as Keras runs it, keeping every activation)
        where the model's inputs have unknown dimensions besides the batch
        and the step was traced without them: there is nothing to size a
        plan with. That is said once."""
        batch_size = _batch_size(inputs) or self.batch_size
        if batch_size is None:
            raise ValueError(
                "AutoVM could not tell the training batch size: the traced "
                "batch has no static size and the data does not say. Pass "
                "AutoVM(batch_size=...).")
        shapes = None
        if self.plans.needs_input_shapes:
            shapes = tuple(tuple(x.shape)[1:] for x in keras.tree.flatten(inputs))
            if any(d is None for shape in shapes for d in shape):
                self._decline(shapes)
                return None
        self._active = self.plan_for(batch_size, shapes)
        return self._active

    def _decline(self, shapes):
        self._active = _DECLINED
        if not self.declined:
            self.declined = True
            self.warn(
                "AutoVM leaves this training step as Keras runs it, keeping "
                "every activation, and training goes on: the model's inputs "
                "have unknown dimensions besides the batch, which AutoVM "
                "sizes from the batches, but the step was traced with input "
                f"shapes {shapes} (None: unknown). Give batches of one shape "
                "(pad to a fixed length) to let AutoVM plan it.")

    def _add(self, key, plan):
        self._applied[key] = AppliedPlan(plan, runnable=self._layers)
        # Reports show the plan of the full batch, not of a last partial one.
        self.current = self._applied[max(self._applied, key=lambda k: k[0])]

    def call(self, wrapper, inputs, args, kwargs, training):
        """Runs `wrapper`'s layer in training, applying the plan."""
        name, tags = wrapper._autovm_op
        applied = self._step_plan(inputs)
        if name not in self._stash:
            inputs = self.mechanism.before_layer(name, inputs, applied)
        segment = (applied.segment_starting.get(name)
                   if applied and self.mechanism.replays_segments else None)
        if name in self._stash:
            outputs = self._stash.pop(name)
        elif segment and not args and set(kwargs) <= {"training"}:
            outputs = self._run_segment(segment, inputs, training)
        else:
            outputs = self._tag(tags, self.mechanism.call_layer(
                wrapper.layer, inputs, args, kwargs, applied))
        return self.mechanism.after_layer(name, outputs, applied)

    def _step_plan(self, inputs):
        """The plan for a layer call: the step's, when its batch size is
        the call's."""
        batch_size = _batch_size(inputs)
        active = self._active
        if active is _DECLINED:
            return None
        if active is not None and batch_size in (None, active.plan.graph.batch_size):
            return active
        return self.plan_for(batch_size)

    def _tag(self, names, outputs):
        if len(names) == 1:
            return self.mechanism.tag(outputs, names[0])
        flat = keras.tree.flatten(outputs)
        tagged = [self.mechanism.tag(x, n) for x, n in zip(flat, names)]
        return keras.tree.pack_sequence_as(outputs, tagged)

    def _run_segment(self, names, inputs, training):
        segment = _Segment([self._layers[n] for n in names], training, self.stats)
        self.stats["segments_run"] += 1
        outputs = self.mechanism.run_segment(segment, inputs)
        for name, output in zip(names[1:], outputs[1:]):
            self._stash[name] = output
        return outputs[0]


# The step being traced runs without a plan (`Runtime.plan_for_inputs`).
_DECLINED = object()


class AppliedPlan:
    """A plan with the look-ups the runtime and the mechanisms need.

    Attributes:
        plan: the `keras_autovm.Plan`.
        actions: dict tensor name -> action.
        segments: the plan's recompute segments the runtime can replay.
        segment_starting: dict op name -> the segment it starts.
        changes_anything: whether any tensor is not kept.
    """

    def __init__(self, plan, runnable):
        self.plan = plan
        self.actions = dict(plan.actions)
        # A segment holding a raw `keras.ops` call cannot be replayed layer by
        # layer: its outputs stay as computed (kept), at a cost in memory.
        self.segments = [tuple(seg) for seg in plan.segments
                         if len(seg) > 1 and all(op in runnable for op in seg)]
        self.segment_starting = {seg[0]: seg for seg in self.segments}
        self.changes_anything = any(a != "keep" for a in self.actions.values())

    def names(self, action):
        """The tags whose action is `action`."""
        return [t for t, a in self.actions.items() if a == action]


class _Segment:
    """Runs a chain of layers; replays it with the forward's layer state.

    The backward pass calls it a second time to recompute. Layer state that
    the forward updated (batch-norm moving statistics, seed generators) is
    read from a snapshot taken before the forward, and updates made while
    replaying are discarded, so recomputing changes no variable.
    """

    def __init__(self, layers, training, stats):
        self.layers = layers
        self.stats = stats
        self.kwargs = {} if training is None else {"training": training}
        self.snapshot = [(v, keras.ops.copy(v.value)) for layer in layers
                         for v in layer.non_trainable_variables]
        self.calls = 0

    def __call__(self, x):
        # `training` is passed explicitly: the replay runs in the backward
        # pass, outside the call context that carried it in the forward.
        replaying = self.calls > 0
        self.calls += 1
        self.stats["segments_replayed"] += replaying
        scope = (keras.StatelessScope(state_mapping=self.snapshot)
                 if replaying and self.snapshot else contextlib.nullcontext())
        with scope:
            return self.run_layers(x)

    def run_layers(self, x):
        """The layers' outputs on `x`, run once, in the current scope."""
        return run_layers(self.layers, self.kwargs, x)


def run_layers(layers, kwargs, x):
    """The outputs of `layers` chained on `x`; `kwargs` (`training`) to
    those whose `call` takes it."""
    outputs = []
    for layer in layers:
        x = layer(x, **(kwargs if internals.call_takes_training(layer) else {}))
        outputs.append(x)
    return tuple(outputs)


def _batch_size(inputs):
    if hasattr(inputs, "shape") and not isinstance(inputs, (tuple, list, dict)):
        # One tensor: every layer call asks, and a tree walk costs more.
        shape = inputs.shape
    else:
        leaves = keras.tree.flatten(inputs)
        shape = getattr(leaves[0], "shape", None) if leaves else None
    if not shape:
        return None
    size = shape[0]
    return int(size) if size is not None else None
