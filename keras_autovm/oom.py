"""A plan's first step that runs out of device memory: learn and retry.

The memory model can under-count what a backend allocates (framework
scratch, kernels' workspaces chosen at run time). Where the mechanism can
tell that an out-of-memory error left no weight or optimizer state changed
(torch: the forward or backward pass failed, eagerly, before the optimizer
ran; JAX's swap step, run without jit: its state is its arguments), the
first step under each plan is guarded: on such an error, the
layer state and metrics it updated are restored, AutoVM learns that the
plan needs at least the device's memory (the step did not fit in it), so
that plans must fit the limit divided by that overhead (`memory_scale`),
replans the batch size, says so in one line, and runs the step again.
After `RETRIES` replans, or when no plan fits (`PlanError`, with the budget
that would do), the error is the user's. Later steps under a plan that
has run are not guarded: they allocate as its first step did.

TensorFlow's traced step is guarded from outside it, where every variable
can be put back: `mechanisms/tensorflow/first_step.py`.
"""

import keras

from keras_autovm.planner import format_bytes

# Replans after running out of memory, before the error is the user's.
RETRIES = 3
# How much smaller than the plan that failed the retried plan must be.
MARGIN = 1.05


def run_step(runtime, model, original, args, x):
    """Runs `original(*args)` (a training step on inputs `x`) under the plan
    for `x`, replanning and running it again if its first step under that
    plan runs out of device memory where the mechanism can retry."""
    applied = runtime.plan_for_inputs(x)
    mechanism = runtime.mechanism
    if not mechanism.reruns_steps:  # A traced step fails as a whole.
        return original(*args)
    for _ in range(RETRIES):
        if applied is None or applied in runtime.proven:
            return original(*args)
        state = [] if mechanism.stateless_steps else _snapshot(model)
        try:
            result = original(*args)
            mechanism.wait(result)  # JAX reports running out of memory late.
        except Exception as error:  # noqa: BLE001 -- re-raised unless recoverable
            if not mechanism.out_of_memory(error):
                raise
            reason = str(error).strip().splitlines()[-1][:480]
        else:
            # The plan that ran: the step may have replanned before it ran
            # (JAX, with its programs' scratch).
            runtime.proven.add(runtime.plan_for_inputs(x))
            return result
        # Out of the except block: the failed step's tensors are unreferenced.
        _restore(state)
        mechanism.release_memory()
        applied = _relax(runtime, runtime.plan_for_inputs(x), reason)
    return original(*args)


def _relax(runtime, applied, reason):
    plan, plans = applied.plan, runtime.plans
    device = runtime.mechanism.device_memory() or plans.budget_bytes
    plans.learn(overhead_after_oom(plan, plans, device))
    batch = plan.graph.batch_size
    new = plans.plan(batch, plans.shapes_at(batch))  # A PlanError is the user's.
    runtime.replace(new)
    runtime.stats["out_of_memory_replans"] = runtime.stats.get(
        "out_of_memory_replans", 0) + 1
    runtime.warn(
        f"AutoVM: the first step under its plan for batch size {batch} ran out "
        f"of GPU memory ({reason}); the plan predicted "
        f"{format_bytes(plan.result.peak_bytes)} and the device has "
        f"{format_bytes(device)} for training, so the memory model "
        f"under-counts this model here. Replanned with a measured memory overhead of "
        f"{plans.memory_scale:.2f}x (predicted peak now "
        f"{format_bytes(new.result.peak_bytes)}) and ran the step again.")
    return runtime.plan_for(batch, plans.shapes_at(batch))


def extra_after_oom(plan, device):
    """The bytes over its prediction that `plan`, which ran out of `device`
    bytes, needed at least (TensorFlow learns them, `first_step._learn`)."""
    return max(device - plan.result.peak_bytes, 0)


def overhead_after_oom(plan, plans, device):
    """The memory overhead to plan with after `plan` ran out of `device`
    bytes: the next plan must need at least the device's memory at its
    prediction, and fit in 1/MARGIN of the failed one (its limit is the
    budget less the headroom, over the scale). Where the budget is the
    device's memory, the headroom alone shrinks it by (1 - headroom); a
    margin stacked on top of both left VGG-19 at 1.5x oversubscription on
    torch 0.2% short of its least plan, where that plan would fit."""
    peak = max(plan.result.peak_bytes, 1)
    need = max(device, peak) / peak
    shrink = MARGIN * plans.headroom_limit / peak
    return max(need, shrink)


def _snapshot(model):
    """Copies of what a failed forward pass may have changed: layer state
    (batch-norm statistics, seed generators) and metrics (the loss mean)."""
    variables = list(model.non_trainable_variables) + list(model.metrics_variables)
    return [(v, keras.ops.copy(v.value)) for v in variables]


def _restore(state):
    for variable, value in state:
        variable.assign(value)
