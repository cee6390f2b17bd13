"""JAX: keep and recompute by name; swap by host copies in an eager step.

Tags become `checkpoint_name`s, and a plan that keeps and recomputes runs
under one `jax.checkpoint` around the loss (keep = save, recompute = not
saved), inside the jitted training step. Under a policy that may swap, the
training step runs without jit and swaps by explicit host copies
(`swap.py`), recomputing the plan's segments under the same `custom_vjp`.
`JaxMechanism.swap_mode = "xla_offload"` selects the earlier swap, XLA's host
offload through the checkpoint policy (measured: no device memory saved).
"""

import functools
import gc

import jax
import keras
from jax.ad_checkpoint import checkpoint_name

from keras_autovm import internals
from keras_autovm.mechanisms.base import Mechanism
from keras_autovm.mechanisms.jax import ahead
from keras_autovm.mechanisms.jax import calls
from keras_autovm.mechanisms.jax import compiled
from keras_autovm.mechanisms.jax import swap
from keras_autovm.mechanisms.jax import timing

# How far (in link time) the forward may run ahead of its copies to host.
IN_FLIGHT_SECONDS = 0.05
# Compiled calls an eager step may enqueue ahead of the device (`SwapStep.enqueued`).
RUN_AHEAD = 2


class JaxMechanism(Mechanism):
    """Keep, swap (host copies, or XLA host offload) and recompute."""

    backend = "jax"
    in_flight_seconds = IN_FLIGHT_SECONDS

    #: `"copies"`: swap by explicit host copies, without jit (`swap.py`);
    #: `"xla_offload"`: by XLA's host offload inside the jitted step.
    swap_mode = "copies"
    #: Compiled calls an eager step may enqueue ahead of the device.
    run_ahead = RUN_AHEAD
    #: Whether an eager step's programs are compiled before it runs, away
    #: from its activations (`ahead.py`), or as each call first runs.
    compile_ahead = True
    #: Keras's JAX step is a function of its state: a failed one changed nothing.
    stateless_steps = True

    def __init__(self):
        super().__init__()
        self.stats = {"checkpointed_traces": 0, "unchanged_traces": 0,
                      "unchanged_check_s": 0.0, "compiled_check_s": 0.0,
                      "compiled_replans": 0, "compiled_peak_bytes": None}
        self.stats.update(dict.fromkeys(
            ("eager_steps", "bytes_to_host", "bytes_to_device", "bytes_freed",
             "copy_backs_prefetched", "copy_backs_at_use", "in_flight_waits",
             "max_in_flight_bytes", "recomputed_calls", "swaps_kept_on_device",
             "compiled_calls", "run_ahead_waits", "programs_compiled_ahead",
             "programs_compiled_in_steps", "max_program_temp_bytes", "scratch_replans"), 0))
        self.stats["compile_ahead_s"] = 0.0
        self.events = []  # The last eager step's backward events (`swap.SwapStep`).
        self._eager = False  # Set by `install` when the policy may swap.
        self._step = None  # The `swap.SwapStep` of the step running.
        self._checks = compiled.Checks(self.stats)  # XLA's figures, each compiled once.
        self._compiled = {}  # Eager steps' compiled calls (`calls.call_key`).
        self._ahead = ahead.AheadOfSteps(self._compiled, self.stats)

    def actions(self):
        return ("keep", "swap", "recompute")

    def auto_actions(self):
        """No swaps. XLA's offload kept the device footprint far above the
        plan (VGG-19, results/gpu_vgg19_memory.json: offload_all 17.57 GiB
        on device for a planned 8.3 GiB). The host copies (`swap.py`) free
        memory, but only in a step run without jit, as a compiled program
        per layer: on an H200 (results/jax/compiled_calls/) VGG-19 kept
        within 1.15x of the planned bytes in use after its first step, but
        that step's autotuning needed 2.6x, and keeping everything that way
        ran at 0.40x Keras's jitted step. To let `auto` swap by copies,
        return `self.actions()` here when `self.swap_mode == "copies"`."""
        return ("keep", "recompute")

    def moved_bytes(self):
        """Bytes the host copies moved in this fit (`swap.py` counts them)."""
        return {"to_host": self.stats["bytes_to_host"],
                "to_device": self.stats["bytes_to_device"]}

    @property
    def reruns_steps(self):
        """An eager swap step runs again after running out of memory (its
        state is its arguments, donated to nothing); a jitted step is
        compiled whole, and gives its state's buffers to the program."""
        return self._eager

    def out_of_memory(self, error):
        return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)

    def release_memory(self):
        gc.collect()  # The failed step's arrays, if a cycle holds them.

    def wait(self, result):
        jax.block_until_ready(result)

    @property
    def replays_segments(self):
        # Jitted, XLA recomputes whatever the checkpoint policy does not
        # save; eager, the runtime runs the plan's segments (`run_segment`).
        return self._eager

    @property
    def waits_for_copies(self):
        """The swap by host copies bounds what is in flight (`swap.SwapStep`);
        XLA's host offload does not."""
        return self.swap_mode == "copies"

    def gpu_available(self):
        return any(d.platform == "gpu" for d in jax.devices())

    def device_memory(self):
        """The bytes XLA's allocator may use (respects XLA_PYTHON_CLIENT_MEM_FRACTION)."""
        return self._memory_stat("bytes_limit")

    def peak_memory(self):
        # XLA's client offers no reset: this is the process's running peak.
        return self._memory_stat("peak_bytes_in_use")

    def device_name(self):
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        return gpus[0].device_kind if gpus else super().device_name()

    def time_call(self, operation, args, kwargs, repeats):
        return timing.time_call(operation, args, kwargs, repeats)

    def measure_link(self):
        """JAX's own copies to the host memory and back, as its swap makes
        them (`timing.measure_link`)."""
        return timing.measure_link()

    def call_timer(self, repeats, progress=None):
        # Calls are timed from their shapes, compiled together after the
        # pass: one at a time on a GPU, where XLA times kernels as it compiles.
        threads = 1 if self.gpu_available() else timing.THREADS
        return timing.CompiledTimer(repeats, progress, threads)

    def measuring_pass(self, run, inputs):
        return timing.abstract_pass(run, inputs)

    def _memory_stat(self, key):
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        return (gpus[0].memory_stats() or {}).get(key) if gpus else None

    def tag(self, x, name):
        return checkpoint_name(x, name)

    def call_layer(self, layer, inputs, args, kwargs, applied):
        """Runs each stateless layer under its own `jax.checkpoint`.

        The plan decides about layer outputs only. What a layer keeps inside
        for its backward (the pre-activation of a fused ReLU, say) is then
        recomputed from its input right before its own backward, as the
        planner assumes: measured on VGG-19 (results/gpu_vgg19_memory.json),
        XLA's own choice keeps about twice the planned bytes. Layers with
        state (batch norm) are left alone: their updates may not leave a
        `jax.checkpoint`. A plan recomputing runs of regions
        (`Plan.region_runs`) runs its layers without their own checkpoints:
        measured on ResNet-152 at batch 96 (results/jax/largest_resnet152/),
        XLA's analysis of such a plan was 1.51x its prediction with them and
        1.07x without. In an eager swap step every layer runs under the
        swap's `custom_vjp` instead (`swap.SwapStep.call`), which recomputes
        layers with state too, as compiled programs.
        """
        step = self._step if applied is not None else None
        if step is not None:
            structure = (inputs, args)
            leaves = keras.tree.flatten(structure)
            found = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
            arrays = [leaves[i] for i in found]
            if any(isinstance(x, jax.Array) for x in keras.tree.flatten(kwargs)):
                step.pin(arrays)  # An array keyword (a mask): run as is.
            elif arrays and step.traceable(arrays):
                run, variables, key = calls.layer_site(layer, structure, leaves, found, kwargs)
                return step.call(run, arrays, variables, layer.name, key)
        if applied is None or layer.non_trainable_variables or applied.plan.region_runs:
            return layer(inputs, *args, **kwargs)
        return self.recompute(lambda x, *a: layer(x, *a, **kwargs))(inputs, *args)

    def run_segment(self, segment, inputs):
        """In an eager step, the segment under the swap's `custom_vjp`
        (its inputs kept on the device, or as host copies where swapped)."""
        if self._step is None:
            return super().run_segment(segment, inputs)
        flat = keras.tree.flatten(inputs)
        run, variables, key = calls.segment_site(segment.layers, segment.kwargs, inputs)
        return self._step.call(run, flat, variables, segment.layers[0].name, key)

    def after_layer(self, name, outputs, applied):
        if self._step is None or applied is None:
            return outputs
        return self._step.after_layer(name, outputs)

    def checkpoint_policy(self, applied):
        """The `jax.checkpoint` policy carrying out a plan's actions."""
        keep, offload = applied.names("keep"), applied.names("swap")
        if offload and not _has_pinned_host():
            keep, offload = keep + offload, []
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=keep, names_which_can_be_offloaded=offload,
            offload_src="device", offload_dst="pinned_host")

    def install(self, model, runtime, patches):
        """Runs the model's loss computation under the plan.

        Jitted, under `jax.checkpoint(policy)`: the checkpoint must enclose
        both the producer and the backward reader of each tagged tensor;
        Keras's stateless loss function is the smallest that does
        (`internals.JAX_LOSS_FUNCTION`). When the policy may swap by copies,
        `jit_compile` is turned off (said when `verbose`): the copies,
        waits and frees happen between layers, which a compiled step hides.
        """
        name = internals.JAX_LOSS_FUNCTION
        original = getattr(type(model), name).__get__(model)
        patches.set(model, name, functools.wraps(original)(
            functools.partial(self._checkpointed_loss, original, runtime)))
        self._eager = self.swap_mode == "copies" and self.may_swap(runtime)
        if self._eager and model.jit_compile:
            patches.set(model, "jit_compile", False)
            return ("AutoVM set jit_compile=False: its JAX swap copies, frees "
                    "and prefetches between layers, outside a compiled step.")
        return None

    def _checkpointed_loss(self, original, runtime, tv, ntv, mv, x, y, sw,
                           training=False, optimizer_variables=None):
        applied = runtime.plan_for_inputs(x) if training else None
        args = (tv, ntv, mv, x, y, sw, optimizer_variables)
        if applied is None:
            return original(tv, ntv, mv, x, y, sw, training=training,
                            optimizer_variables=optimizer_variables)
        if self._eager and applied.plan.refused is not None:
            raise compiled.refused(applied.plan, None)  # Not jitted: not checked.
        if self._eager:  # A plan keeping all runs the compiled calls too.
            if self.compile_ahead:
                applied = self._ahead.prepare(runtime, applied, args,
                                              functools.partial(self._trace, original))
            return self._eager_loss(original, applied, tv, ntv, mv, x, y, sw,
                                    optimizer_variables)
        # XLA's analysis is of a compiled step: a step run without jit (its
        # batch is concrete, not traced) holds far more (results.md).
        jitted = isinstance(keras.tree.flatten(x)[0], jax.core.Tracer)
        if jitted and applied.changes_anything and self.checks_own_step(runtime.plans.policy):
            applied = self._checks.own_step_if_fits(runtime, applied, args,
                                                    self._own_loss(original, runtime))
        if jitted and not self._runs_unchanged(original, runtime, applied, args):
            applied = self._checked(original, runtime, applied, args)
        if applied.plan.refused is not None:  # Not jitted, or its own step did not fit.
            own = self._checks.own.get(compiled.shapes(x)) if jitted else None
            raise compiled.refused(applied.plan, own)
        if jitted and self._runs_unchanged(original, runtime, applied, args):
            self.stats["unchanged_traces"] += 1
            with runtime.stepping_aside():
                return original(tv, ntv, mv, x, y, sw, training=True,
                                optimizer_variables=optimizer_variables)
        self.stats["checkpointed_traces"] += applied.changes_anything
        return self._planned_loss(original, applied)(*args)

    def _planned_loss(self, original, applied):
        """The loss function a jitted step runs under `applied` (without
        the unchanged case): under the plan's checkpoint policy, or, for
        a plan that keeps everything, as it is (the layers' own
        checkpoints, `call_layer`, apply in both)."""
        def loss(tv, ntv, mv, x, y, sw, ov):
            return original(tv, ntv, mv, x, y, sw, training=True,
                            optimizer_variables=ov)

        if not applied.changes_anything:
            return loss
        return jax.checkpoint(loss, policy=self.checkpoint_policy(applied))

    def _checked(self, original, runtime, applied, args):
        """The plan to trace the step under (`compiled.Checks.checked`), on
        a GPU; unchecked without one, in an eager step, or refused."""
        if self._eager or not self.checks_compiled_peak() or applied.plan.refused:
            return applied
        return self._checks.checked(runtime, applied, args,
                                    functools.partial(self._planned_loss, original))

    def checks_own_step(self, policy):
        """On a GPU, under `auto` and `keep_all`, Keras's own step is checked
        against the budget by XLA's memory analysis before a plan runs: it
        runs unchanged where that fits (`Checks.own_step_if_fits`), also
        where the planner's model refuses the budget (`Plan.refused`)."""
        return policy in ("auto", "keep_all") and self.checks_compiled_peak()

    def own_step_peak(self, batch_size, input_shapes=None):
        return self._checks.own_step_peak(batch_size, input_shapes)

    def _own_loss(self, original, runtime):
        """Keras's own loss function, run outside the plan."""
        def unchanged(tv, ntv, mv, x, y, sw, ov):
            with runtime.stepping_aside():
                return original(tv, ntv, mv, x, y, sw, training=True,
                                optimizer_variables=ov)
        return unchanged

    def checks_compiled_peak(self):
        """Whether plans are checked against XLA's memory analysis of the
        compiled step (`compiled.Checks`): on a GPU, where XLA's memory is
        the device's. The analysis compiles the step once more."""
        return self.gpu_available()

    def _runs_unchanged(self, original, runtime, applied, args):
        """Whether a keep-all plan runs as Keras runs it
        (`compiled.Checks.runs_unchanged`); a plan that changes the step,
        or an eager step, does not."""
        if applied.changes_anything or self._eager:
            return False
        return self._checks.runs_unchanged(applied, args, self._own_loss(original, runtime))

    def keep_traced(self, old, new):
        compiled.keep_traced(old, new)

    def adjust_graph(self, graph, model, input_shapes=None):
        """`graph` with the scratch memory each op's compiled programs need
        in the eager swap step (`ahead.AheadOfSteps.adjust`)."""
        return self._ahead.adjust(graph)

    def _trace(self, original, step, args):
        """Traces the loss of a step on `args` abstractly, with `step` (an
        `ahead.Ahead`) standing in for the step's `swap.SwapStep`."""
        self._step = step
        try:
            jax.eval_shape(lambda *a: original(*a[:6], training=True, optimizer_variables=a[6]),
                           *args)
        finally:
            self._step = None

    def _eager_loss(self, original, applied, tv, ntv, mv, x, y, sw, ov):
        """The forward of one eager swap step; its backward follows, in
        `jax.value_and_grad`, through the `custom_vjp`s it made."""
        if any(internals.jax_concrete(v) is None for v in keras.tree.flatten(tv)):
            raise RuntimeError(
                "AutoVM's JAX swap needs the training step to run without "
                "jit, but it is being traced (jit_compile was turned back "
                "on?). Compile the model with jit_compile=False.")
        self.stats["eager_steps"] += 1
        self.events.clear()
        self._step = swap.SwapStep(applied, self.stats, self.events, self._compiled,
                                   self.run_ahead)
        try:
            return original(tv, ntv, mv, x, y, sw, training=True,
                            optimizer_variables=ov)
        finally:
            self.stats["swaps_kept_on_device"] += self._step.kept_on_device()
            self.stats["compiled_calls"] = len(self._compiled)
            self._step = None


def _has_pinned_host():
    """Whether the default device has a pinned host memory space to offload to."""
    return "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}

