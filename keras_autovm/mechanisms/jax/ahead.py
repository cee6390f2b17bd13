"""Compiling an eager swap step's programs before it runs, and planning
the scratch memory they need.

Compiling a convolution's program autotunes it, with scratch memory beside
whatever the device holds then: compiled in the first step, next to that
step's live activations, VGG-19's programs took the process to 10.8 GiB on
an H200 where the plan needs 4.2 (docs/results.md). So before the first
step under a plan, the step is traced once abstractly (`jax.eval_shape`),
before any activation exists, with `Ahead` standing in for the step's
`swap.SwapStep`: each call compiles its forward and backward programs at
the shapes it sees (`calls.CompiledCall.compile_ahead`), and the real step
runs those executables. Each program's scratch (XLA's memory analysis)
becomes its op's `OpSpec.scratch_bytes`, and the plan is made again with
it before the step runs (`AheadOfSteps`).
"""

import dataclasses
import time

import jax

from keras_autovm.mechanisms.jax import calls
from keras_autovm.planner import format_bytes

# Plans made again, at most, with newly known scratch before a first step.
MAX_REPLANS = 3


class AheadOfSteps:
    """What was compiled ahead, and the scratch its programs need.

    Args:
        compiled: dict of compiled calls (`calls.call_key` ->
            `calls.CompiledCall`), the one the steps use; added to.
        stats: dict of counters to add to (the mechanism's):
            `compile_ahead_s`, `scratch_replans`.
    """

    def __init__(self, compiled, stats):
        self.compiled, self.stats = compiled, stats
        self.done = set()  # (plan, batch types) compiled ahead
        self.scratch = {}  # batch size -> {op name: (forward, backward) bytes}

    def prepare(self, runtime, applied, args, trace):
        """`applied`, its programs compiled ahead; or, where they need
        scratch memory the plan did not count, a plan made again with it,
        compiled ahead in turn. `trace(step, args)` traces the step's loss
        on `args` abstractly with `step` standing in for its swap step. A
        budget that scratch leaves no plan for raises `PlanError` here, in
        the first step, before it runs."""
        for _ in range(MAX_REPLANS):
            batch_size = applied.plan.graph.batch_size
            if not self._learn(batch_size, self._compile(runtime, applied, args, trace)):
                return applied
            known = self.scratch[batch_size]
            name = max(known, key=lambda k: max(known[k]))
            runtime.warn(
                f"AutoVM planned again with the scratch memory its compiled "
                f"programs need, by XLA's memory analysis (the most: "
                f"{format_bytes(max(known[name]))}, {name!r}).")
            self.stats["scratch_replans"] += 1
            runtime.plans.forget(batch_size)
            runtime.replace(runtime.plans.plan(batch_size))
            applied = runtime.plan_for_inputs(args[3])
        # Still compiled ahead; its scratch counts from the next plan on.
        self._learn(applied.plan.graph.batch_size, self._compile(runtime, applied, args, trace))
        return applied

    def adjust(self, graph):
        """`graph` with each op's scratch as known at its batch size; a
        segment's is its first op's. Unknown before the first step: the
        graph is then unchanged. Kept by batch size only: a model whose
        inputs vary in other dimensions gets the most any shape needed."""
        scratch = self.scratch.get(graph.batch_size) or {}
        return dataclasses.replace(graph, ops=tuple(
            dataclasses.replace(op, scratch_bytes=scratch[op.name])
            if op.name in scratch else op for op in graph.ops))

    def _learn(self, batch_size, scratch):
        """Adds `scratch` (op name -> (forward, backward) bytes) to what is
        known at `batch_size`; whether any of it is new."""
        known = self.scratch.setdefault(batch_size, {})
        new = {name: tuple(map(max, known.get(name, (0, 0)), n)) for name, n in scratch.items()}
        changed = any(known.get(name, (0, 0)) != n for name, n in new.items())
        known.update(new)
        return changed

    def _compile(self, runtime, applied, args, trace):
        """Compiles the programs of a step under `applied` on batches like
        `args`', once per plan and batch types; the scratch they need, by
        op (`Ahead.scratch`)."""
        # The plan itself, not its id: a replaced plan's id may be reused.
        key = (applied, tuple((tuple(a.shape), str(a.dtype))
                              for a in jax.tree_util.tree_leaves(args[3:6])))
        if key in self.done:
            return {}
        self.done.add(key)
        runtime_stats = dict(runtime.stats)
        start = time.perf_counter()
        step = Ahead(self.compiled, self.stats)
        try:
            trace(step, args)
        finally:
            runtime.stats.update(runtime_stats)  # The abstract pass ran no segment.
        self.stats["compile_ahead_s"] += time.perf_counter() - start
        return step.scratch


class Ahead:
    """Stands in for a step's `swap.SwapStep` while the step is traced
    abstractly (`jax.eval_shape`) before it runs: each call compiles its
    programs (`calls.CompiledCall.compile_ahead`) and is traced inline; nothing
    is copied or freed. `scratch` gathers, by op (the op name the runtime
    gives `after_layer`: a segment's first op), the most scratch memory its
    forward and backward programs need at these shapes.

    Args:
        compiled: as `AheadOfSteps`'s.
        stats: dict of counters to add to (the mechanism's).
    """

    def __init__(self, compiled, stats):
        self.compiled, self.stats = compiled, stats
        self.scratch = {}  # op name -> (forward, backward) scratch bytes
        self._last = None  # The scratch of the call that ran last.

    @staticmethod
    def traceable(arrays):
        return True

    def pin(self, inputs):
        pass

    def after_layer(self, name, outputs):
        # The layer's own name may not be its op's (a wrapper the user
        # made, a shared layer's later call): the runtime names the op here.
        if self._last is not None:
            old = self.scratch.get(name, (0, 0))
            self.scratch[name] = tuple(map(max, old, self._last))
            self._last = None
        return outputs

    def call(self, run, inputs, variables, reader, key=None):
        compiled = calls.find(self.compiled, key, run, variables, inputs, self.stats)
        if compiled.runs_as_keras:
            return run(*inputs)
        values = [v.value for v in variables]
        self._last = compiled.compile_ahead(inputs, values)
        outputs, state = compiled.traced_forward(inputs, values)
        for variable, value in zip(compiled.stateful, state):
            variable.assign(value)
        return outputs
