"""TensorFlow: recompute through `keras.remat` (`tf.recompute_grad`) over plan
segments. Swap in one of two modes:

- **explicit** (the default): a host copy of each swapped layer output, and
  the backward pass reading a copy brought back when the plan's prefetch
  trigger is reached (`swap.py`);
- **managed**, after `keras_autovm.enable_managed_memory()`: the page-moving
  ops of ops/, an evict after a swapped output's last forward reader and a
  prefetch issued from the backward pass of the op the plan picks
  (`ops.py`).
"""

import functools
import warnings

import tensorflow as tf

from keras_autovm.mechanisms.base import Mechanism
from keras_autovm.mechanisms.tensorflow import cuda
from keras_autovm.mechanisms.tensorflow import first_step
from keras_autovm.mechanisms.tensorflow import internals as tf_internals
from keras_autovm.mechanisms.tensorflow import logits
from keras_autovm.mechanisms.tensorflow import managed
from keras_autovm.mechanisms.tensorflow import swap
from keras_autovm.mechanisms.tensorflow import timing

# How far (in link time) the forward may run ahead of its explicit copies to host.
IN_FLIGHT_SECONDS = 0.05

class TensorFlowMechanism(Mechanism):
    """Keep, recompute, and swap by explicit copies or managed memory."""

    backend = "tensorflow"

    def __init__(self):
        super().__init__()
        self.managed = managed.managed_memory_enabled()
        if self.managed:
            self.stats = {"evicts_inserted": 0, "prefetches_inserted": 0}
        else:
            self.stats = dict.fromkeys(
                ("host_copies", "marks", "copy_backs", "copy_backs_at_use",
                 "copy_backs_ungated", "reads_rewired", "in_flight_waits"), 0)
        # Swapped tensor -> [tensor, page moves still to insert for it].
        self._swapped = {}
        self._moves = {}  # AppliedPlan -> its `managed.PageMoves`.
        self._explicit = None  # The `swap.ExplicitSwap` of the step being traced.
        # Set as each training function is made (`_xla_checked`): whether
        # its step runs under XLA, and who hears that a swap was left out.
        self._own_recompute = False
        self._under_xla = False
        self._warn = None

    def actions(self):
        """Keep, recompute and swap.

        Explicit swap needs nothing else. In managed mode swapping needs the
        op library and, on a GPU, TensorFlow allocating managed memory
        (`keras_autovm.enable_managed_memory`); without a GPU the ops are
        identities, so a swap plan runs (for tests and demonstrations) and
        moves nothing.
        """
        if self.managed and _ops() is None:
            return ("keep", "recompute")
        return ("keep", "swap", "recompute")

    def auto_actions(self):
        """Every action. Explicit swap ran at 1.09x to 1.24x its planned peak
        on VGG-19 (kernels' temporaries the plan does not hold: a 1.53 GiB
        cuDNN workspace at the first block's backward;
        results/tensorflow/trace/), which a tight plan's first step,
        measured (`first_step.py`), now catches and replans."""
        return self.actions()

    @property
    def copy_link(self):
        return "managed_prefetch" if self.managed else "pinned"

    def gpu_available(self):
        return bool(tf.config.list_physical_devices("GPU"))

    def device_name(self):
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            return super().device_name()
        details = tf.config.experimental.get_device_details(gpus[0])
        return details.get("device_name", gpus[0].name)

    def time_call(self, operation, args, kwargs, repeats):
        return timing.time_call(operation, args, kwargs, repeats)

    def measure_link(self):
        """TensorFlow's own copies, timed as its explicit swap makes them
        (`timing.measure_link`); page moves are the native probe's."""
        return None if self.managed else timing.measure_link()

    def device_memory(self):
        """The GPU's memory limit: the logical device's cap if one is set."""
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            return None
        configs = tf.config.get_logical_device_configuration(gpus[0]) or []
        if configs and configs[0].memory_limit:
            return int(configs[0].memory_limit) * 2**20
        return cuda.total_memory(0)

    def peak_memory(self):
        if not self.gpu_available():
            return None
        return tf.config.experimental.get_memory_info("GPU:0")["peak"]

    def reset_peak(self):
        if not self.gpu_available():
            return False
        tf.config.experimental.reset_memory_stats("GPU:0")
        return True

    def moved_bytes(self):
        """Bytes the page-moving ops evicted and prefetched (process totals);
        `None` for explicit copies, which TensorFlow does not count."""
        if not self.managed or "swap" not in self.actions():
            return None
        counters = _ops().stats()
        return {"evicted": counters["bytes_evicted"],
                "prefetched": counters["bytes_prefetched"],
                "skipped_tensors": counters["tensors_skipped"]}

    def install(self, model, runtime, patches):
        """When the policy may swap explicitly, the traced `train_step` ends
        by pointing its backward at the copies back
        (`swap.ExplicitSwap.rewire`), and a step without XLA recomputes
        with `swap.recompute`.

        `jit_compile` is turned off where XLA cannot compile what the plan
        does: page moves (managed mode, any policy that may swap), and the
        control dependencies that time explicit copies back (a named policy
        that may swap; under `auto`, a plan that swaps, now or after a
        replan, `_xla_checked`, or no plan yet, `_without_xla`); with it,
        the evaluation and prediction functions Keras builds during the
        `fit` are dropped after it (`_xla_off`). It is also turned off for a plan predicted
        not to fit under XLA (`first_step.turns_xla_off`): under XLA
        VGG-19's step needed 1.5x to 1.7x its plan, where TensorFlow's own
        executor needed 1.1x to 1.35x, and a step that ran out of memory
        under XLA cannot be undone (TensorFlow aborted when a variable was
        assigned after it; results/tensorflow/first_step/). Without XLA,
        VGG-19 trained at 0.68x the images/s of Keras's step under XLA
        (batch 37, 8 GiB cap)."""
        may_swap = self.may_swap(runtime)
        self._own_recompute = self._under_xla = False
        if may_swap and not self.managed:
            patches.set(model, "train_step", self._rewire_after(model.train_step))
            patches.set(model, "make_train_function",
                        self._xla_checked(model, runtime, patches,
                                          model.make_train_function))
        said = self._without_xla(runtime, may_swap) if model.jit_compile else None
        if said is None:
            return None
        _xla_off(model, patches)
        return f"AutoVM set jit_compile=False: {said}"

    def _without_xla(self, runtime, may_swap):
        """Why the step must run without XLA, or `None`. Under `auto` with a
        budget and no plan yet (a model whose inputs have unknown
        dimensions: the plan is made as the step is traced), the plan may
        swap."""
        named = runtime is None or runtime.plans.policy != "auto"
        unknown = (runtime is not None and runtime.current is None
                   and runtime.plans.budget_bytes is not None)
        if may_swap and (self.managed or named or unknown or _swaps(runtime)):
            return ("XLA cannot compile its TensorFlow page-moving ops." if self.managed
                    else f"{_XLA_CANNOT}.")
        if first_step.turns_xla_off(runtime):
            return (f"under XLA its plan would need about {first_step.XLA_OVERHEAD}x "
                    "the memory it predicts, over its limit, and a step under XLA "
                    "that runs out of memory cannot be undone.")
        return None

    def _xla_checked(self, model, runtime, patches, make):
        """Keras's `make_train_function`, first turning XLA off where the plan
        in force swaps (a replan can bring swaps to an `auto` step that ran
        under XLA), and picking the recompute that matches the step."""
        @functools.wraps(make)
        def make_train_function(force=False):
            if model.jit_compile and _swaps(runtime):
                _xla_off(model, patches)
                runtime.warn(f"AutoVM set jit_compile=False: its new plan swaps, "
                             f"and {_XLA_CANNOT}.")
            self._under_xla = bool(model.jit_compile)
            self._own_recompute = not self._under_xla
            self._warn = runtime.warn
            return make(force=force)

        return make_train_function

    def training_function(self, model, runtime, function):
        """On a GPU, each tight plan's first step is measured, and run
        again under a new plan if it ran out of memory
        (`first_step.FirstSteps`). Under a policy that may swap explicitly
        (`auto` included), steps are optimized without Grappler's own
        swapping, which moves tensors the plan does not know of
        (`tf_internals.tf_grappler_swapping_off`). The choice is made per
        policy, not per plan: the first plan is made while the step is
        traced, under options already chosen."""
        steps = first_step.FirstSteps(model, runtime, function)
        if self.managed or not self.may_swap(runtime):
            return steps
        return _without_grappler_swaps(steps)

    # --------------------------------------------------------- explicit swap

    def recompute(self, fn):
        """`keras.remat(fn)`; in a step without XLA under a policy that may
        swap explicitly (`auto` included), `swap.recompute(fn)`, which leaves
        the step's numbers unchanged. The last output keeps the logits a
        loss reads (`logits.recompute`)."""
        run = swap.recompute if self._own_recompute else super().recompute
        return logits.recompute(fn, run)

    def _explicit_for(self, applied):
        """The `ExplicitSwap` of the step being traced, or `None`. A step
        under XLA keeps what its plan swaps, and says so: the plan in force
        did not swap when XLA was left on, but the plan of another batch
        size (a last partial batch) can."""
        if self.managed or applied is None or not applied.names("swap") \
                or tf.executing_eagerly():
            return None
        if self._under_xla:
            if self._warn is not None:
                self._warn(
                    f"AutoVM kept the outputs its plan for batch size "
                    f"{applied.plan.graph.batch_size} swaps: the step is compiled "
                    f"with XLA, and {_XLA_CANNOT}.")
                self._warn = None  # Once a training function.
            return None
        current = self._explicit
        if current is None or current.applied is not applied \
                or current.graph is not swap.current_graph():
            self._explicit = swap.ExplicitSwap(applied, self.stats)
        return self._explicit

    @property
    def in_flight_seconds(self):
        """Explicit copies to host: bounded to `IN_FLIGHT_SECONDS` of the
        link, as on torch and JAX. Started unbounded, VGG-19's plans at batch
        100 and 104 under an 8 GiB cap ran out of memory in their first step
        on an H200 (predicted 7.02 and 7.21 GiB, limit 7.60;
        results/tensorflow/rerun/); started at this bound they trained once
        (7.28 and 7.49 GiB predicted, 7.94 and 8.00 measured;
        results/tensorflow/in_flight/) and failed once (rerun/). Page moves:
        `None`."""
        return None if self.managed else IN_FLIGHT_SECONDS

    @property
    def waits_for_copies(self):
        """The forward waits on its explicit copies to host where the plan's
        bound says (`swap.ExplicitSwap.before_layer`). Page moves cannot be
        waited for."""
        return not self.managed

    def before_layer(self, name, inputs, applied):
        """Explicit swap: the layer waits for the copies to host its plan's
        bound on copies in flight says must be done before it."""
        explicit = None if self.managed else self._explicit_for(applied)
        return inputs if explicit is None else explicit.before_layer(name, inputs)

    def _rewire_after(self, train_step):
        """`train_step`, then the traced step's backward reads copies back."""
        @functools.wraps(train_step)
        def step(*args):
            result = train_step(*args)
            explicit = self._explicit
            if explicit is not None and explicit.graph is swap.current_graph():
                explicit.rewire()
            return result

        return step

    def after_layer(self, name, outputs, applied):
        """Explicit swap: copies swapped outputs to the host and marks where
        the backward pass starts their copies back (`ExplicitSwap`).

        Managed memory: evicts swapped inputs after their last forward
        reader and arms the backward prefetches this layer triggers. Both
        ops pass `outputs` through, so everything downstream depends on
        them: an evict runs after the read it follows, and a prefetch fires
        when the backward pass reaches this layer's output gradient.
        """
        if not self.managed:
            explicit = self._explicit_for(applied)
            return outputs if explicit is None else explicit.after_layer(name, outputs)
        if applied is None or not applied.names("swap"):
            return outputs
        if applied not in self._moves:
            self._moves[applied] = managed.PageMoves(applied)
        moves = self._moves[applied]
        if moves.uses.get(name):
            self._swapped[name] = [outputs, moves.uses[name]]
        evict = [self._use(t) for t in moves.evict_after.get(name, ())]
        if evict:
            # Stateful: it runs even where the loss reads the logits past it.
            outputs = logits.through(outputs, lambda x: _ops().evict(x, evict),
                                     on_logits=False)
            self.stats["evicts_inserted"] += len(evict)
        # A skip connection can put the trigger before the last forward
        # reader, so references are dropped after their last use, not first.
        fetch = [self._use(t) for t in moves.prefetch_at.get(name, ())]
        if fetch:
            outputs = logits.through(
                outputs, lambda x: _ops().prefetch_on_backward(x, fetch))
            self.stats["prefetches_inserted"] += len(fetch)
        return outputs

    def _use(self, tag):
        entry = self._swapped[tag]
        entry[1] -= 1
        if not entry[1]:
            del self._swapped[tag]
        return entry[0]


# Why an explicit swap needs its step without XLA.
_XLA_CANNOT = ("XLA cannot compile the control dependencies that time its "
               "host-to-device copies")


def _without_grappler_swaps(function):
    """`function`, run (and traced) without Grappler's swapping heuristic."""
    @functools.wraps(function)
    def train_function(*args):
        with tf_internals.tf_grappler_swapping_off():
            return function(*args)

    return train_function


def _xla_off(model, patches):
    """Turns XLA off for the `fit`; the evaluation and prediction functions
    that Keras builds meanwhile (validation) are dropped with it, so that
    after the `fit` they are built under XLA again."""
    patches.set(model, "jit_compile", False)
    for name in ("test_function", "predict_function"):
        patches.set(model, name, getattr(model, name, None))


def _swaps(runtime):
    """Whether the plan in force swaps."""
    current = runtime.current if runtime is not None else None
    return current is not None and bool(current.names("swap"))


def _ops():
    """The op module, or `None` (with a warning) when it cannot load."""
    from keras_autovm.mechanisms.tensorflow import ops
    try:
        ops.load_library()
    except ImportError as error:
        warnings.warn(f"AutoVM cannot swap on TensorFlow: {error}", stacklevel=3)
        return None
    return ops
