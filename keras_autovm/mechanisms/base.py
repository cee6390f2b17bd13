"""`Mechanism`: what every backend provides, with safe defaults.

A mechanism carries out a plan's actions on one Keras backend. The planner
and the runtime ask it what it can do (`actions`, `auto_actions`,
`replays_segments`, `copy_link`), what the device has (`gpu_available`,
`device_memory`, `peak_memory`), and, while a traced training step runs,
to apply the plan to each layer call (`call_layer`, `after_layer`, `tag`,
`recompute`). Everything it changes on a model for one `fit` goes through
`install`, recorded by the `Patches` it is given, so that one `close()`
undoes it.

The defaults describe a backend that keeps and recomputes by replaying plan
segments under `keras.remat`, on a machine without a GPU. A backend module
overrides what differs; see docs/architecture.md.
"""

import contextlib
import dataclasses
import platform

import keras

from keras_autovm.mechanisms.timing import CallTimer
from keras_autovm.planner import choose

# A measured peak this few bytes short of the allocator's limit, or closer,
# is taken to have filled it (`Mechanism.fills_allocator`): on an H200 under
# an 8 GiB cap, TensorFlow's peaks that did came 1.8 KB to 25 KB short, and
# steps that fitted 60 MB or more.
FILLED_WITHIN = 1 << 20


class Mechanism:
    """The default mechanism: keep, and recompute plan segments."""

    #: The Keras backend this mechanism serves.
    backend = None

    #: How far, in seconds of copy link, the forward may run ahead of its
    #: copies to host (`swap_cost`); `None`: the backend bounds nothing.
    in_flight_seconds = None

    #: Whether a forward op can wait for the copies to host before it, so
    #: that `auto` may plan under a tighter bound on them than
    #: `in_flight_seconds` where nothing fits (`in_flight_bounds`).
    waits_for_copies = False

    #: The share of the budget plans leave free when `headroom=None`: the
    #: memory this backend uses beyond the planner's model (scratch
    #: buffers, fragmentation). XLA's compiled VGG-19 step needed 7% to 18%
    #: more device memory than planned (results/gpu_vgg19_memory.json).
    default_headroom = 0.15

    def __init__(self):
        # Counts of what was carried out, for the report (backend-specific).
        self.stats = {}

    # ------------------------------------------------------ what it can do

    def actions(self):
        """The plan actions this backend can carry out now."""
        return ("keep", "recompute")

    def auto_actions(self):
        """Those `policy="auto"` may choose: the ones shown to save memory
        where the plan says."""
        return self.actions()

    @property
    def replays_segments(self):
        """Whether recompute replays plan segments under `recompute` (the
        runtime runs them) rather than being the backend's own by name."""
        return True

    def adjust_graph(self, graph, model, input_shapes=None):
        """`graph` (a `planner.Graph` of `model`, at `input_shapes` where the
        model's own are not concrete) corrected with what this backend was
        measured to keep for the backward pass. The default changes
        nothing."""
        return graph

    def swap_cost(self, cost):
        """`cost` (a `planner.CostModel`) with how this backend's swaps
        behave: copies to host in flight bounded to `in_flight_seconds` of
        the link, unless the cost bounds them already."""
        if self.in_flight_seconds is None or cost.max_in_flight_bytes is not None:
            return cost
        return dataclasses.replace(
            cost, max_in_flight_bytes=cost.d2h_bytes_per_s * self.in_flight_seconds)

    def in_flight_bounds(self, cost):
        """The tighter bounds on copies to host in flight `auto` may plan
        with, in turn, where nothing fits under `cost`'s own."""
        return choose.in_flight_bounds(cost) if self.waits_for_copies else ()

    def may_swap(self, runtime):
        """Whether the policy of `runtime` (or any, without one) may swap."""
        if "swap" not in self.actions():
            return False
        if runtime is None:
            return True
        policy = runtime.plans.policy
        allowed = self.auto_actions() if policy == "auto" else choose.REQUIRES[policy]
        return "swap" in allowed

    @property
    def copy_link(self):
        """Which link probe figures a swap's copies run at: `"pinned"` (copies
        to pinned host memory) or `"managed_prefetch"` (page moves)."""
        return "pinned"

    # ---------------------------------------------------------- the device

    def gpu_available(self):
        """Whether this backend sees a GPU."""
        return False

    def device_memory(self):
        """Bytes the backend's allocator may use on the GPU, or `None`."""
        return None

    def fills_allocator(self, peak):
        """Whether a measured `peak` (bytes) reached the allocator's limit
        (`device_memory`, within `FILLED_WITHIN`): the step ran, but what
        it needs is unknown, and a later one may not run. Where no cap is
        set, `device_memory` is the GPU's whole memory, above what the
        allocator may take, and no peak fills it."""
        limit = self.device_memory()
        return peak is not None and limit is not None and peak >= limit - FILLED_WITHIN

    def peak_memory(self):
        """Peak bytes in use on the GPU since `reset_peak`, or `None`."""
        return None

    def reset_peak(self):
        """Resets the peak; returns whether the backend can."""
        return False

    def moved_bytes(self):
        """Bytes measured moving between device and host, or `None`."""
        return None

    def forward_seconds(self):
        """How long the last training step's forward pass took, read once
        the step is done, or `None` where the step is one compiled program
        (JAX, TensorFlow) and its forward cannot be seen apart."""
        return None

    #: Whether a training step runs eagerly, so that one that ran out of
    #: memory can be run again (`out_of_memory` says when).
    reruns_steps = False

    #: Whether a training step takes its state as arguments and returns
    #: the new state (JAX), so that one that failed changed nothing in the
    #: model: there is nothing to restore before it runs again.
    stateless_steps = False

    #: Whether each training step runs the layers' Python (torch), not a
    #: program traced once (TensorFlow, JAX): the wrapper then skips the
    #: Python it can (`AutoVMWrapper.__call__`).
    calls_layers_each_step = False

    #: Whether a step left unchanged holds every layer output until its
    #: forward pass ends (Keras's functional model, run eagerly), so that a
    #: plan keeping everything may run it unchanged where that fits
    #: (`planner.CostModel.holds_outputs`, `Plan.unchanged`).
    holds_outputs = False

    def out_of_memory(self, error):
        """Whether `error` is the device running out of memory at a point a
        training step can be run again from: no weight or optimizer state
        changed yet (the caller restores layer state and metrics). The
        default: never (a traced step fails as a whole)."""
        return False

    def release_memory(self):
        """Hands back what a failed step left in the allocator's cache."""

    def wait(self, result):
        """Waits until the device has computed `result` (a step's outputs),
        so that an error it meets (out of memory) is raised here."""

    def device_name(self):
        """The device training runs on, as a cache key: the GPU's name, or
        `"cpu:<processor>"` without one."""
        return f"cpu:{platform.machine()}:{platform.processor() or 'unknown'}"

    # --------------------------------------------------- measured costs

    def time_call(self, operation, args, kwargs, repeats):
        """Times one layer call on this backend: `(forward_s, backward_s)`,
        or a `mechanisms.timing.CallTime` that adds the bytes the call
        allocates for a moment (TensorFlow measures them).

        The forward is `operation`'s call on `args`/`kwargs` through
        `stateless_call` (so no variable changes), the backward its
        vector-Jacobian product for the weights and the float inputs. Each is
        the median of `repeats` runs after a warm-up, the clock stopped only
        once the device is done.
        """
        raise NotImplementedError(
            f"Timing layer calls is not implemented for the {self.backend!r} "
            "backend.")

    def call_timer(self, repeats, progress=None):
        """What times the profiling pass's distinct layer calls: a
        `CallTimer`, which times each call as it is added (`time_call`),
        so that only one call's inputs are held beyond the pass's own.
        `progress(n)` is told how many calls are done."""
        return CallTimer(self.time_call, repeats, progress)

    def measuring(self):
        """A context for the measuring forward pass: it records nothing for
        a backward pass and leaves global random generators as they were."""
        return contextlib.nullcontext()

    def measuring_pass(self, run, inputs):
        """Runs the profiling pass, `run(inputs)`; the default runs it on
        the arrays themselves."""
        return run(inputs)

    def measure_link(self):
        """GB/s of this backend's own pinned copies to host (`pinned_d2h`),
        to the device (`pinned_h2d`) and both at once (`pinned_both_d2h`,
        `pinned_both_h2d`), or `None` (no GPU, or not measured here)."""
        return None

    # ------------------------------------------ inside a traced training step

    def tag(self, x, name):
        """Marks a layer output with its plan name (for by-name backends)."""
        return x

    def recompute(self, fn):
        """`fn`, with its intermediates recomputed in the backward pass."""
        return keras.remat(fn)

    def before_layer(self, name, inputs, applied):
        """Runs before the layer call `name` (a recompute segment's first
        op: before the segment); returns its (possibly gated) inputs. The
        default passes them through."""
        return inputs

    def call_layer(self, layer, inputs, args, kwargs, applied):
        """Calls one layer under the plan `applied` (an `AppliedPlan` or
        `None`); the default is a plain call."""
        return layer(inputs, *args, **kwargs)

    def run_segment(self, segment, inputs):
        """Runs a recompute segment (`segment(inputs)` returns each of its
        layers' outputs) so that the backward pass recomputes it; the
        default runs it under `recompute`."""
        # Tensors as arguments, not a nested structure: torch's checkpoint
        # saves only tensor arguments as such (through saved-tensor hooks).
        flat = keras.tree.flatten(inputs)
        return self.recompute(
            lambda *xs: segment(keras.tree.pack_sequence_as(inputs, list(xs))))(*flat)

    def after_layer(self, name, outputs, applied):
        """Runs after the layer call `name`; returns its (possibly wrapped)
        outputs. The default passes them through."""
        return outputs

    def checks_own_step(self, policy):
        """Whether, under `policy`, the framework's own step is measured by
        its own figure before a plan runs (`own_step_peak`), and runs
        unchanged where that fits the budget less the headroom. A budget no
        plan meets by the planner's model then does not stop `fit` at once:
        it plans keep-all carrying the refusal (`Plan.refused`), which the
        mechanism raises when the step is traced unless that step fits.
        The default: no such check."""
        return False

    def own_step_peak(self, batch_size, input_shapes=None):
        """The framework's own figure for its unchanged step at `batch_size`
        (`input_shapes` as `PlanBook.plan` takes them), once read; `None`
        where it is not known. `fit` runs that step where it fits the
        budget less the headroom (`checks_own_step`)."""
        return None

    def keep_traced(self, old, new):
        """A replan kept `old`'s actions, so a traced step is not traced
        again: what was decided while tracing it under plan `old` holds for
        plan `new`. The default decides nothing while tracing."""

    # ------------------------------------------------- changes for one fit

    def install(self, model, runtime, patches):
        """Changes the model needs on this backend for one `fit`.

        Every change goes through `patches` (a `keras_autovm.patches.Patches`),
        which undoes it on close. Returns a message for the user when the
        change is one they should know about, else `None`.
        """
        return None

    def training_function(self, model, runtime, function):
        """`fit`'s training function as this backend runs it: Keras's
        `function`, traced for the plan in force, unless the mechanism
        watches its steps (TensorFlow measures first steps)."""
        return function
