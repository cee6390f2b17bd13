"""The memory budget: parsing it, the headroom, and planning within it.

Words used throughout: the **budget** is the device memory the user gives
(`budget=`); the **headroom** is the share of it kept free for memory the
planner does not model; a plan must fit the **limit**, the budget less the
headroom.
"""

import dataclasses
import math
import numbers
import re

import keras

from keras_autovm import planner
from keras_autovm.model_graph import build_graph
from keras_autovm.model_graph import input_shapes_of
from keras_autovm.model_graph import needs_input_shapes

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_budget(budget, device_bytes=None, argument="budget"):
    """Turns a budget into bytes.

    Args:
        budget: an int (bytes), a string such as `"16GiB"`, `"512MiB"` or
            `"2.5GB"`, a float in (0, 1] (a fraction of `device_bytes`), or
            `None` (all of `device_bytes`).
        device_bytes: the device's memory in bytes, or `None` when unknown
            (no GPU). Needed only for `None` and fractions.
        argument: the argument name used in error messages.

    Returns:
        The budget in bytes, an int.
    """
    if budget is None or isinstance(budget, float):
        return _relative_budget(budget, device_bytes, argument)
    if isinstance(budget, bool) or not isinstance(budget, (numbers.Integral, str)):
        raise ValueError(
            f"`{argument}` must be an int (bytes), a string such as '16GiB', "
            f"a float in (0, 1] or None. Received: {argument}={budget!r}"
        )
    if isinstance(budget, str):
        return _parse_string(budget, argument)
    if budget <= 0:
        raise ValueError(
            f"`{argument}` must be a positive number of bytes. "
            f"Received: {argument}={budget!r}"
        )
    return int(budget)


def _relative_budget(fraction, device_bytes, argument):
    if fraction is not None and not 0.0 < fraction <= 1.0:
        raise ValueError(
            f"A float `{argument}` is a fraction of device memory and must be "
            f"in (0, 1]. Received: {argument}={fraction!r}"
        )
    if device_bytes is None:
        raise ValueError(
            f"`{argument}={fraction!r}` is relative to the GPU's memory, but no "
            "GPU was found. Pass an absolute budget such as '8GiB'."
        )
    return int(device_bytes * (1.0 if fraction is None else fraction))


def _parse_string(text, argument):
    match = _PATTERN.match(text)
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise ValueError(
            f"`{argument}` string must be a number and a unit "
            f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), such as '16GiB'. "
            f"Received: {argument}={text!r}"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if value < 1:
        raise ValueError(
            f"`{argument}` must be at least one byte. Received: {argument}={text!r}"
        )
    return int(value)


def check_headroom(headroom):
    """Rejects a headroom outside [0, 1) that is not `None`, naming the
    argument."""
    if headroom is None:
        return
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) \
            or not 0 <= headroom < 1:
        raise ValueError("`headroom` must be a number in [0, 1) or None. "
                         f"Received: headroom={headroom!r}")


def headroom_for(headroom, mechanism):
    """`headroom`, or the backend's own default (`Mechanism.default_headroom`)
    when it is `None`."""
    return mechanism.default_headroom if headroom is None else headroom


def graph_for(model, batch_size, mechanism, profile=None, input_shapes=None):
    """The planner graph of `model` at `batch_size` (and `input_shapes`, see
    `model_graph.build_graph`), as `mechanism` runs it, with the layer times
    of `profile` (a `keras_autovm.profiling.Profile`) when given."""
    graph = build_graph(model, batch_size, input_shapes=input_shapes)
    graph = mechanism.adjust_graph(graph, model, input_shapes_of(model, input_shapes))
    return graph if profile is None else profile.apply(graph)


def planning_cost(cost, mechanism):
    """`cost` as `mechanism` runs plans: its swap costs, whether it replays
    recompute segments whole, whether an unchanged step holds outputs."""
    return dataclasses.replace(mechanism.swap_cost(cost),
                               replay_segments=mechanism.replays_segments,
                               holds_outputs=mechanism.holds_outputs)


def limit_for(budget_bytes, headroom, memory_scale=1.0, memory_extra=0):
    """The limit plans must fit: the budget less the headroom, divided by
    the measured overhead `memory_scale`, or less the measured overhead in
    bytes `memory_extra`, whichever leaves less."""
    room = budget_bytes * (1 - headroom)
    return int(min(room / memory_scale, room - memory_extra))


def room_for(limit, memory_scale=1.0, memory_extra=0):
    """The real bytes a plan of `limit` predicted bytes may take once the
    measured overhead is added, whichever of the ratio and the bytes
    `limit_for` took: the budget less the headroom, back from the limit."""
    return max(limit * memory_scale, limit + memory_extra)


def _planning(policy, cost, mechanism):
    """`planner.make_plan`'s arguments besides the graph and the limit, as
    `mechanism` runs plans: `"auto"` chooses among the actions it
    recommends, a policy named explicitly may use any it can carry out.

    Raises:
        NotImplementedError: `policy` needs an action `mechanism` cannot do.
    """
    allowed = mechanism.auto_actions() if policy == "auto" else mechanism.actions()
    lacking = [a for a in planner.REQUIRES.get(policy, ()) if a not in allowed]
    if lacking:
        raise NotImplementedError(
            f"Policy {policy!r} needs the {lacking[0]!r} action, which AutoVM "
            f"cannot carry out on the {keras.backend.backend()} backend (it can "
            f"{', '.join(allowed)}). Use policy='auto' to plan with those.")
    cost = planning_cost(cost, mechanism)
    return dict(policy=policy, cost=cost, allowed=allowed,
                bounds=mechanism.in_flight_bounds(cost))


def least_plan(graph, limit, policy, cost, mechanism):
    """The plan of least predicted peak that `policy` makes as `mechanism`
    runs plans (`_planning`), or `None` where that peak is over `limit` or
    planning at it finds no plan."""
    args = _planning(policy, cost, mechanism)
    try:  # The PlanError states the least limit any plan reaches.
        return planner.make_plan(graph, 1, **args)
    except planner.PlanError as error:
        need = error.min_budget
    if need > limit:
        return None
    try:  # A search's path depends on its limit: this one may find none.
        return planner.make_plan(graph, need, **args)
    except planner.PlanError:
        return None


def plan_within(graph, budget_bytes, headroom, policy, cost, mechanism,
                memory_scale=1.0, memory_extra=0):
    """Plans a graph to fit the limit, with the actions `mechanism` can do.

    `"auto"` chooses among the actions the mechanism recommends; a policy
    named explicitly may use any action the mechanism can carry out.
    `memory_scale` is how much more memory than predicted a plan was
    measured to use, and `memory_extra` how many bytes more: plans must
    then fit the limit of `limit_for`.

    Raises:
        keras_autovm.PlanError: no plan fits; its `min_budget` is the least
            budget (not limit) that would do.
    """
    args = _planning(policy, cost, mechanism)
    limit = limit_for(budget_bytes, headroom, memory_scale, memory_extra)
    try:
        # A measured overhead may leave nothing (`max`): the PlanError then
        # states what the least plan needs.
        plan = planner.make_plan(graph, max(limit, 1), **args)
    except planner.PlanError as error:
        if not headroom and memory_scale == 1.0 and not memory_extra:
            raise
        # State the minimum in the user's terms: the budget they would pass.
        need = room_for(error.min_budget, memory_scale, memory_extra)
        least = math.ceil(need / (1 - headroom)) + 1
        overhead = planner.overhead_text(memory_scale, memory_extra)
        raise planner.PlanError(
            f"No plan fits budget={planner.format_bytes(budget_bytes)}: with "
            f"{headroom * 100:g}% headroom"
            + (f" and a measured memory overhead of {overhead}" if overhead else "")
            + f" the limit is {planner.format_bytes(max(limit, 0))}, and the least any "
            f"{policy!r} plan needs is {planner.format_bytes(error.min_budget)}.",
            least) from None
    return dataclasses.replace(plan, device_budget=budget_bytes, headroom=headroom,
                               memory_scale=memory_scale, memory_extra=memory_extra)


@dataclasses.dataclass
class PlanBook:
    """The plans for one model under one budget, one per batch size.

    Args:
        model: a built Sequential or functional Keras model.
        budget_bytes: the budget in bytes.
        headroom: share of the budget kept free.
        policy: a name in `keras_autovm.planner.POLICIES`.
        cost: the `keras_autovm.planner.CostModel` to plan with; the
            callback replaces it when it recalibrates.
        mechanism: the backend's mechanism (which actions it can do).
        announce: called with each new plan (to print it), or `None`.
        profile: a `keras_autovm.profiling.Profile` whose layer times the
            graphs carry, or `None` (roofline estimates). Defaults to `None`.
        memory_scale: measured peak over predicted peak, learnt between
            epochs (see `plan_within`). Defaults to 1.0.
        memory_extra: measured peak less predicted peak, in bytes, where
            the mechanism learns it (TensorFlow's measured first step; see
            `plan_within`). Defaults to 0.
        remember: called with the overhead learnt (`memory_scale`,
            `memory_extra`) by `keep_learnt`, when the fit stops for want
            of memory: the callback keeps it for the next fit
            (`keras_autovm.learnt`). Or `None`.
    """

    model: object
    budget_bytes: int
    headroom: float
    policy: str
    cost: planner.CostModel
    mechanism: object
    announce: object = None
    profile: object = None
    memory_scale: float = 1.0
    memory_extra: int = 0
    remember: object = None
    _graphs: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.needs_input_shapes = needs_input_shapes(self.model)
        self._last_shapes = {}

    @property
    def headroom_limit(self):
        """The budget less the headroom: what a step may measure, before
        any learnt overhead (`memory_scale`, `memory_extra`) lowers it
        for plans."""
        return self.budget_bytes * (1 - self.headroom)

    def learn(self, scale=1.0, extra=0):
        """Raises the learnt overhead to what a measured step showed: a
        peak `scale` times, or `extra` bytes over, its plan's prediction.
        Plans made from then on fit whichever leaves less (`limit_for`)."""
        self.memory_scale = max(self.memory_scale, scale)
        self.memory_extra = max(self.memory_extra, int(extra))

    def keep_learnt(self):
        """Gives `remember` the overhead learnt: the fit stops for want of
        memory, and the next one starts from it."""
        if self.remember is not None:
            self.remember(self.memory_scale, self.memory_extra)

    def shapes_at(self, batch_size):
        """The input shapes last planned at `batch_size` (`None` for models
        whose inputs have concrete shapes)."""
        return self._last_shapes.get(batch_size)

    def forget(self, batch_size):
        """Builds the graphs of `batch_size` again at its next plan (the
        mechanism has measured more of how it runs them)."""
        self._graphs = {k: g for k, g in self._graphs.items() if k[0] != batch_size}

    def plan(self, batch_size, input_shapes=None):
        """A new plan for `batch_size` with the current cost model.

        `input_shapes` (one tuple per model input, without the batch) are
        read only for models whose inputs have unknown dimensions; `None`
        then means the shapes last planned at this batch size.
        """
        if not self.needs_input_shapes:
            input_shapes = None
        elif input_shapes is None:
            input_shapes = self._last_shapes[batch_size]
        key = (batch_size, input_shapes)
        if key not in self._graphs:
            self._graphs[key] = graph_for(self.model, batch_size, self.mechanism,
                                          self.profile, input_shapes)
        self._last_shapes[batch_size] = input_shapes
        plan = self._own_step(self._graphs[key], input_shapes)
        if plan is None:
            try:
                plan = plan_within(self._graphs[key], self.budget_bytes,
                                   self.headroom, self.policy, self.cost,
                                   self.mechanism, self.memory_scale, self.memory_extra)
            except planner.PlanError as error:
                if not self.mechanism.checks_own_step(self.policy):
                    raise
                plan = self._refused(self._graphs[key], error)
        if self.announce is not None:
            self.announce(plan)
        return plan

    def least(self, batch_size):
        """The plan of least predicted peak at `batch_size` (the shapes last
        planned there), made without the learnt overhead, or `None` where
        even it is over the budget less the headroom.

        An overhead is learnt from one plan's measured step, and another
        plan may not show it: on an H200 under a 6.47 GiB cap, VGG-19's
        `auto` plan at batch 64 peaked 0.71 GiB over its prediction, and
        the overhead left no plan, while `offload_all`'s plan, predicted at
        5.24 GiB, trained at 4.97 GiB (results/tensorflow/oversub/). So a
        mechanism that measures a plan's step before keeping it may run
        this one and judge it by its own step (`first_step`)."""
        graph = self._graphs[(batch_size, self.shapes_at(batch_size))]
        least = least_plan(graph, self.headroom_limit, self.policy, self.cost,
                           self.mechanism)
        if least is None:
            return None
        plan = dataclasses.replace(least, device_budget=self.budget_bytes,
                                   headroom=self.headroom, memory_scale=self.memory_scale,
                                   memory_extra=self.memory_extra)
        plan.notes.append("The plan of least predicted peak, made without the measured "
                          "memory overhead, which left no plan: it is judged by its own "
                          "measured step.")
        if self.announce is not None:
            self.announce(plan)
        return plan

    def _keep_all(self, graph, **changes):
        """Keep-all under this book's limit, whether or not it fits."""
        plan = planner.make_plan(graph, None, policy="keep_all",
                                 cost=planning_cost(self.cost, self.mechanism))
        limit = limit_for(self.budget_bytes, self.headroom, self.memory_scale,
                          self.memory_extra)
        return dataclasses.replace(plan, budget=limit, device_budget=self.budget_bytes,
                                   headroom=self.headroom, memory_scale=self.memory_scale,
                                   memory_extra=self.memory_extra, **changes)

    def _own_step(self, graph, input_shapes):
        """The framework's own step, unchanged, where its own figure for it
        (`Mechanism.own_step_peak`) fits the budget less the headroom:
        no plan that changes the step runs faster."""
        if not self.mechanism.checks_own_step(self.policy):
            return None
        peak = self.mechanism.own_step_peak(graph.batch_size, input_shapes)
        if peak is None or peak > self.headroom_limit:
            return None
        plan = self._keep_all(graph, unchanged=True)
        plan.result = dataclasses.replace(plan.result, peak_bytes=peak)
        plan.notes.append(f"The step runs unchanged: the framework's own step needs "
                          f"{planner.format_bytes(peak)} by its own figure, within the limit.")
        return plan

    def _refused(self, graph, error):
        """Keep-all carrying `error`, for a mechanism that checks the
        framework's own step before it runs (`Mechanism.checks_own_step`):
        the planner's model of memory is not the framework's (on JAX, XLA
        fuses and rematerializes: on an H200 under an 8 GiB cap, Keras's
        own step trained ResNet-152 at batch 62, where no plan fitted the
        planner's model at 60)."""
        plan = self._keep_all(graph, refused=error)
        plan.notes.append(
            "No plan fits by AutoVM's model of memory; the framework's own step "
            "is checked before it runs, and runs unchanged if it fits. "
            f"Otherwise: {error}")
        return plan
