"""JAX: what XLA's compiled step needs, by its memory analysis, read while
the real step is traced (`JaxMechanism._runs_unchanged`, `_checked`)."""

import dataclasses
import math
import warnings

import jax

from keras_autovm.planner import PlanError
from keras_autovm.planner import format_bytes


def run_unchanged(plan, peak):
    """Marks `plan` as running Keras's own step, whose peak is XLA's `peak`.
    Only the peak changes: the plan's timeline stays the planner's."""
    plan.unchanged, plan.refused = True, None
    plan.result = dataclasses.replace(plan.result, peak_bytes=peak)
    plan.notes.append(f"The step runs unchanged: XLA's compiled step needs "
                      f"{format_bytes(peak)} by its memory analysis, within the limit.")


def fits(peak, plan):
    """Whether `peak` real bytes fit the budget less the headroom: the plan's
    limit times the memory overhead it was divided by."""
    return plan.budget is None or peak <= plan.budget * plan.memory_scale


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
