"""torch: recompute through `keras.remat` (non-reentrant
`torch.utils.checkpoint`) over plan segments; swap through saved-tensor
hooks, a pinned host pool and a copy stream (`swap.py`), which also frees
every layer output the backward pass does not need once its last forward
reader has run."""

import contextlib
import functools
import gc
import os
import traceback
import warnings
import weakref

import keras
import torch

from keras_autovm import internals as keras_internals
from keras_autovm.mechanisms.base import Mechanism
from keras_autovm.mechanisms.torch import internals
from keras_autovm.mechanisms.torch import profile
from keras_autovm.mechanisms.torch import streams
from keras_autovm.mechanisms.torch import swap
from keras_autovm.mechanisms.torch import timing

# How far (in link time) the forward may run ahead of its copies to host.
IN_FLIGHT_SECONDS = 0.05


class TorchMechanism(Mechanism):
    """Keep, swap (pinned host copies) and recompute."""

    backend = "torch"
    in_flight_seconds = IN_FLIGHT_SECONDS
    waits_for_copies = True
    # torch's allocated peak is what the plan models: measured 0.5% and 3.3%
    # above the plan on VGG-19, 1.5% to 6% below it on ResNet-152
    # (docs/results.md). 15% made VGG-19 recompute what fit. A step that runs
    # out of memory anyway is run again under a plan with the measured gap.
    default_headroom = 0.05
    reruns_steps = True  # Eager: a step that ran out of memory can run again.
    calls_layers_each_step = True
    holds_outputs = True

    def __init__(self):
        super().__init__()
        self.stats = {"unchanged_steps": 0, "bytes_to_host": 0, "bytes_to_device": 0,
                      "bytes_freed_early": 0, "swaps_skipped": 0,
                      "copy_backs_prefetched": 0, "copy_backs_at_use": 0,
                      "forward_wait_s": 0.0}
        self._layouts = {}  # AppliedPlan -> swap.Layout
        self._profiles = {}  # id(model) -> (model, what its layers save)
        self._pool = None
        self._streams = None
        self._step = None
        self._last_step = None  # A weak reference, for `release_memory`.
        self._forward = None  # The last training forward's (start, end) marks.

    def actions(self):
        return ("keep", "swap", "recompute")

    def adjust_graph(self, graph, model, input_shapes=None):
        """Backward readers and layer internals as measured (`profile.py`)."""
        key = (id(model), input_shapes)
        if self._profiles.get(key, (None,))[0] is not model:
            with keras_internals.torch_inputs_on_views():  # As the step runs them.
                self._profiles[key] = (model, profile.measure(model, input_shapes))
        return profile.adjust(graph, self._profiles[key][1])

    def gpu_available(self):
        return torch.cuda.is_available()

    def device_memory(self):
        """The GPU's memory times the per-process fraction, if one is set."""
        if not self.gpu_available():
            return None
        total = torch.cuda.get_device_properties(0).total_memory
        return int(total * torch.cuda.get_per_process_memory_fraction(0))

    def device_name(self):
        if not self.gpu_available():
            return super().device_name()
        return torch.cuda.get_device_name(torch.cuda.current_device())

    def time_call(self, operation, args, kwargs, repeats):
        with keras_internals.torch_inputs_on_views():  # As the step runs them.
            return timing.time_call(operation, args, kwargs, repeats)

    def measure_link(self):
        return timing.measure_link()

    @contextlib.contextmanager
    def measuring(self):
        # The measuring pass makes the inputs layers are timed on: as the
        # step makes them.
        with keras_internals.torch_inputs_on_views(), timing.measuring():
            yield

    def peak_memory(self):
        return torch.cuda.max_memory_allocated() if self.gpu_available() else None

    def reset_peak(self):
        if not self.gpu_available():
            return False
        torch.cuda.reset_peak_memory_stats()
        return True

    def moved_bytes(self):
        return {"to_host": self.stats["bytes_to_host"],
                "to_device": self.stats["bytes_to_device"]}

    def out_of_memory(self, error):
        """A CUDA out-of-memory error from the forward or backward pass:
        torch runs eagerly, so the optimizer had not run and no weight
        changed. One raised in the optimizer is not (weights may be half
        updated)."""
        if not isinstance(error, torch.cuda.OutOfMemoryError):
            return False
        return not any("optimizers" in frame.filename
                       for frame in traceback.extract_tb(error.__traceback__))

    def release_memory(self):
        step = self._last_step() if self._last_step else None
        if step is not None:  # Alive after its step: the step failed.
            step.abandon()
        gc.collect()  # The failed step's graph, if a cycle holds it.
        if self.gpu_available():
            torch.cuda.empty_cache()

    def install(self, model, runtime, patches):
        """Runs each training forward pass under the step's saved-tensor
        hooks, and Keras's convolutions and max pooling on views of their
        inputs for the whole fit, in every model of the process
        (`keras_autovm.internals.torch_inputs_on_views`: Keras's own saves
        a copy of each one's input; the view computes the same numbers)."""
        patches.enter(keras_internals.torch_inputs_on_views())
        if self.gpu_available() and expandable_segments(os.environ):
            try:
                internals.torch_expandable_segments()
            except RuntimeError as error:  # An allocator without them.
                warnings.warn(f"AutoVM could not turn on torch's expandable segments, "
                              f"so the allocator may fragment: {error}", stacklevel=2)
        call = model.call

        @functools.wraps(call)
        def timed_call(inputs, *args, **kwargs):
            if not kwargs.get("training"):
                return call(inputs, *args, **kwargs)
            start = timing.mark()
            outputs = call_with_hooks(inputs, *args, **kwargs)
            self._forward = (start, timing.mark())
            return outputs

        def call_with_hooks(inputs, *args, **kwargs):
            applied = runtime.plan_for_inputs(inputs)
            if applied is None or applied.plan.unchanged:
                # Nothing to free or copy: no hooks, and the wrappers step
                # aside. On an H100, ResNet-152 at batch 64 kept all under
                # the hooks at 0.68x in-core; unchanged, 0.95x and 1.06x in
                # two interleaved runs (rounds from 0.78x to 1.42x: its
                # step is bound by Python; results/torch/overhead/).
                self.stats["unchanged_steps"] += 1
                self._last_step = None  # Nothing of this step to abandon.
                with runtime.stepping_aside():
                    return call(inputs, *args, **kwargs)
            self._step = self._new_step(applied, model, inputs)
            self._last_step = weakref.ref(self._step)
            hooks = torch.autograd.graph.saved_tensors_hooks(self._step.pack,
                                                             self._step.unpack)
            try:
                # A replay stopped early raises an exception whose traceback
                # holds the replay's frames: a cycle that keeps the step's
                # memory until Python's collector runs. The plan replays
                # whole segments anyway (`replays_segments`).
                with hooks, torch.utils.checkpoint.set_checkpoint_early_stop(False):
                    return call(inputs, *args, **kwargs)
            finally:
                self._step.forward_done()
                self._step = None

        patches.set(model, "call", timed_call)
        return None

    def forward_seconds(self):
        """The last training forward, from the model call's start to its
        end on the device (CUDA events: no wait is added to the step)."""
        if self._forward is None:
            return None
        forward, self._forward = self._forward, None
        return timing.seconds_between(*forward)

    def run_segment(self, segment, inputs):
        return super().run_segment(_freeing_cycles(segment), inputs)

    def after_layer(self, name, outputs, applied):
        if self._step is not None:
            self._step.layer_done(name, outputs)
        return outputs

    def _new_step(self, applied, model, inputs):
        if applied not in self._layouts:
            self._layouts[applied] = swap.Layout(applied)
        layout = self._layouts[applied]
        # One pool per fit, sized for the plan with the most to swap.
        need = layout.swap_bytes + len(layout.swap) * 512
        if self._pool is None or self._pool.nbytes < need:
            self._pool = swap.HostPool(need, pinned=self.gpu_available())
        self._pool.used = 0
        if self.gpu_available() and self._streams is None:
            self._streams = streams.Streams.shared()
        # The variables are read each step: a callback may add some mid-fit
        # (LoRA, quantization), and a weight taken for an activation could
        # be freed.
        return swap.Step(layout, self._pool, self._streams, self.stats, model.variables,
                         keras.tree.flatten(inputs))


def _freeing_cycles(segment):
    """`segment`, collecting after each run the young reference cycles its
    layer calls made.

    Keras's torch tree functions (`keras/src/tree/torchtree_impl.py`) leave
    the tensors they walk in reference cycles (a closure of Keras's held by
    torch's recursive pytree helper), so each output a layer call makes
    lives until Python's collector runs. In the backward pass little Python
    runs: on an H100 a replayed VGG-19 `block1_conv1` output (1.20 GiB at
    batch 100) outlived its use into the next step's forward, and the step
    peaked at 8.24 GiB where the plan said 6.98 (docs/results.md). A
    collection of the two young generations costs about 30 us.
    """
    def run(x):
        try:
            return segment(x)
        finally:
            gc.collect(1)

    return run


def expandable_segments(environ):
    """Whether AutoVM turns on the caching allocator's expandable segments:
    unless the user chose (`PYTORCH_CUDA_ALLOC_CONF` names them). Plans
    that free and swap layer outputs leave the fixed-size segments
    fragmented: on an H100 under an 8 GiB cap, ResNet-152's plan at batch
    193 ran out with 2.22 GiB reserved but unallocated, and VGG-19's at 1x
    with 2.07 GiB; with expandable segments neither was fragmented."""
    return "expandable_segments" not in environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
