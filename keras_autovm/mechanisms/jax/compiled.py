"""JAX: what XLA's compiled step needs, by its memory analysis, read while
the real step is traced (`Checks`, which `JaxMechanism` asks on a GPU).

The planner's model of memory is not XLA's (fusion, layouts, what XLA keeps
and rematerializes), so on a GPU each plan's step is compiled once more for
XLA's figure before it runs: a plan over the budget less the headroom is
made again with that gap learnt, and Keras's own step runs unchanged
wherever XLA's figure for it fits.
"""

import dataclasses
import math
import time
import warnings

import jax
import keras

from keras_autovm.budget import room_for
from keras_autovm.planner import PlanError
from keras_autovm.planner import format_bytes

# Plans made again, at most, when XLA's compiled step exceeds the budget.
MAX_CHECKS = 3


class Checks:
    """XLA's figures for one mechanism's jitted steps, each compiled once:
    Keras's own step per input shapes, a plan's step per batch size and
    actions. `stats` (the mechanism's) gets the seconds compiling took and
    the checks' outcomes. Each `loss` argument is the loss function the
    step would run: Keras's own, or under a plan."""

    def __init__(self, stats):
        self.stats = stats
        self.own = {}  # (batch, input shapes) -> XLA's peak for Keras's own step.
        self.peaks = {}  # (batch size, actions) -> XLA's peak for a plan's step.
        self.unchanged = {}  # AppliedPlan -> whether it runs unchanged.

    def own_peak(self, loss, args):
        """XLA's peak for Keras's own step (`loss`) on arrays shaped as `args`."""
        return self._once(self.own, shapes(args[3]), loss, args, "unchanged_check_s")

    def own_step_peak(self, batch_size, input_shapes=None):
        """XLA's peak for Keras's own step at `batch_size` (and the inputs'
        `input_shapes` without the batch, where the model's are unknown),
        once a trace has read it; else `None`."""
        for (batch, known), figure in self.own.items():
            if batch == batch_size and (input_shapes is None
                                        or tuple(map(tuple, input_shapes)) == known):
                return figure
        return None

    def plan_peak(self, loss, applied, args):
        """XLA's peak for the step under `applied` (`loss`), compiled once per
        batch size and actions (a replan may make the same plan again)."""
        key = (applied.plan.graph.batch_size, frozenset(applied.actions.items()))
        return self._once(self.peaks, key, loss, args, "compiled_check_s")

    def _once(self, cache, key, loss, args, stat):
        """`cache[key]`, XLA's peak for `loss`, compiled the first time
        only; the seconds that took are added to `stats[stat]`."""
        if key not in cache:
            start = time.perf_counter()
            cache[key] = peak(loss, args)
            self.stats[stat] += time.perf_counter() - start
        return cache[key]

    def own_step_if_fits(self, runtime, applied, args, loss):
        """Keras's own step (`loss`) where XLA's analysis of it fits the
        budget less the headroom, in place of a plan that changes the step:
        on an H200 under an 8 GiB cap, ResNet-152 at batch 62 was planned
        with 367 of 516 outputs recomputed, at 0.73x Keras's speed, where
        Keras's own step fitted. The plans for this batch size are then
        Keras's step (`PlanBook.plan` reads `own_step_peak`)."""
        figure = self.own_peak(loss, args)
        if figure is None or not fits(figure, applied.plan):
            return applied
        runtime.replace(runtime.plans.plan(applied.plan.graph.batch_size))
        return runtime.plan_for_inputs(args[3])

    def checked(self, runtime, applied, args, loss_for):
        """The plan to trace the step under: `applied`, or, where XLA's step
        under it (`loss_for(applied)`) needs more than the budget less the
        headroom, a plan made again with that gap learnt (as an epoch whose
        measured peak was over the prediction teaches): on an H100, VGG-19
        at batch 80 under a 7.92 GiB cap was planned as fitting and ran out
        of memory. A plan the planner then refuses is returned for the
        caller to raise (`refused`); one XLA's figure refuses after
        `MAX_CHECKS` tries raises `PlanError` here, in the first step's
        trace."""
        tried = []
        while True:
            plan = applied.plan
            figure = self.plan_peak(loss_for(applied), applied, args)
            if figure is None or fits(figure, plan):
                self.stats["compiled_peak_bytes"] = figure
                return applied
            tried.append(plan.actions)
            if len(tried) > MAX_CHECKS:
                raise no_plan_fits(plan, figure, len(tried))
            ratio = figure / max(plan.result.peak_bytes, 1)
            runtime.warn(
                f"AutoVM planned again: XLA's compiled step needs {format_bytes(figure)} "
                f"by its memory analysis, {ratio:.2f}x the plan's "
                f"{format_bytes(plan.result.peak_bytes)}, over the budget less headroom.")
            self.stats["compiled_replans"] += 1
            runtime.plans.learn(ratio)
            runtime.replace(runtime.plans.plan(plan.graph.batch_size))
            applied = runtime.plan_for_inputs(args[3])
            if applied.plan.refused is not None:  # The caller raises it.
                return applied

    def runs_unchanged(self, applied, args, loss):
        """Whether a keep-all plan runs as Keras runs it (`loss`): where
        XLA's own compiled step fits the limit (the planner's keep-all
        figure is not XLA's: VGG-19 at batch 64, 6.15 GiB predicted, 10.63
        GiB in-core on an H100). Otherwise each stateless layer runs under
        its own checkpoint, which cost VGG-19 7% of its step. Decided once
        per plan, while the step is traced; the plan then carries XLA's
        peak."""
        plan = applied.plan
        if plan.unchanged:  # Decided under the plan it replaced (`keep_traced`).
            self.unchanged[applied] = True
        if applied not in self.unchanged:
            figure = self.own_peak(loss, args)
            fit = figure is not None and fits(figure, plan)
            self.unchanged[applied] = fit
            if fit:
                run_unchanged(plan, figure)
        return self.unchanged[applied]


def keep_traced(old, new):
    """An unchanged step stays so while XLA's peak fits the new plan (the
    callback retraces where `unchanged` differs)."""
    if new.unchanged:  # `PlanBook` already gave Keras's own step.
        return
    figure = old.result.peak_bytes
    if old.unchanged and new.actions == old.actions and fits(figure, new):
        run_unchanged(new, figure)


def shapes(x):
    """(batch size, each input's shape without it) of a batch of inputs."""
    flat = keras.tree.flatten(x)
    return int(flat[0].shape[0]), tuple(tuple(a.shape[1:]) for a in flat)


def run_unchanged(plan, peak):
    """Marks `plan` as running Keras's own step, whose peak is XLA's `peak`.
    Only the peak changes: the plan's timeline stays the planner's."""
    plan.unchanged, plan.refused = True, None
    plan.result = dataclasses.replace(plan.result, peak_bytes=peak)
    plan.notes.append(f"The step runs unchanged: XLA's compiled step needs "
                      f"{format_bytes(peak)} by its memory analysis, within the limit.")


def fits(peak, plan):
    """Whether `peak` real bytes fit the budget less the headroom: the plan's
    limit with the memory overhead it was made under (`budget.room_for`)."""
    return plan.budget is None or peak <= room_for(plan.budget, plan.memory_scale,
                                                   plan.memory_extra)


def peak(fn, args):
    """Device bytes XLA's compiled `jax.value_and_grad(fn, has_aux=True)`
    needs on arrays shaped as `args`, by its memory analysis: arguments,
    outputs not aliased to them, and temporaries; `None` where the
    compiler gives no analysis. May be called while another function is
    traced (the arrays are then tracers)."""
    specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    try:
        analysis = jax.jit(jax.value_and_grad(fn, has_aux=True)).lower(*specs).compile()
        memory = analysis.memory_analysis()
    except Exception as error:  # Whatever it is, the step itself may still run.
        warnings.warn(f"AutoVM could not read XLA's memory analysis of the step, so "
                      f"it plans without it: {type(error).__name__}: {error}", stacklevel=2)
        return None
    if memory is None:
        return None
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes
            - memory.alias_size_in_bytes + memory.temp_size_in_bytes)


def no_plan_fits(plan, peak, tried):
    """The `PlanError` when the last of `tried` plans still needs `peak`
    bytes by XLA's analysis; its least budget is what that plan needs."""
    headroom = plan.headroom or 0
    return PlanError(
        f"No plan AutoVM made fits budget={format_bytes(plan.device_budget)} by "
        f"XLA's memory analysis of the compiled step: the last of {tried} "
        f"({plan.policy!r}) needs {format_bytes(peak)}, with {headroom * 100:g}% "
        "headroom.", math.ceil(peak / (1 - headroom)))


def refused(plan, peak):
    """The `PlanError` of a plan the planner refused (`Plan.refused`) whose
    step Keras's own compiled step cannot replace: it needs `peak` bytes by
    XLA's analysis (`None`: not read, the step not jitted). Its least budget
    is the lesser of the planner's and what Keras's own step needs."""
    error = plan.refused
    if peak is None:
        return PlanError(f"{_stem(error)} Keras's own step was not checked: it "
                         "runs without jit.", error.min_budget)
    own = math.ceil(peak / (1 - (plan.headroom or 0)))
    return PlanError(
        f"{_stem(error)} Keras's own compiled step needs {format_bytes(peak)} by "
        "XLA's memory analysis, over the limit too.", min(error.min_budget, own))


def _stem(error):
    """`error`'s message without the smallest budget it states (a
    `PlanError` appends it)."""
    return str(error).split(" The smallest feasible budget is ")[0]
