"""TensorFlow: recompute through `keras.remat` (`tf.recompute_grad`) over plan
segments; swap through the managed-memory ops of ops/: an evict after a
swapped output's last forward reader, a prefetch issued from the backward
pass of the op the plan picks (`ops.py`)."""

import warnings

import tensorflow as tf

from keras_autovm.mechanisms.base import Mechanism
from keras_autovm.mechanisms.tensorflow import cuda
from keras_autovm.mechanisms.tensorflow import managed


class TensorFlowMechanism(Mechanism):
    """Keep, recompute, and swap by moving managed-memory pages."""

    backend = "tensorflow"

    def __init__(self):
        super().__init__()
        self.stats = {"evicts_inserted": 0, "prefetches_inserted": 0}
        # Swapped tensor -> [tensor, page moves still to insert for it].
        self._swapped = {}
        self._moves = {}  # AppliedPlan -> its `PageMoves`.

    def actions(self):
        """Keep and recompute; swap where pages can move.

        Swapping needs the op library and, on a GPU, TensorFlow allocating
        managed memory (`keras_autovm.enable_managed_memory`). Without a GPU
        the ops are identities, so a swap plan runs (for tests and
        demonstrations) and moves nothing.
        """
        if self.gpu_available() and not managed.managed_memory_enabled():
            return ("keep", "recompute")
        if _ops() is None:
            return ("keep", "recompute")
        return ("keep", "swap", "recompute")

    @property
    def copy_link(self):
        return "managed_prefetch"

    def gpu_available(self):
        return bool(tf.config.list_physical_devices("GPU"))

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
        """Bytes the page-moving ops evicted and prefetched (process totals)."""
        if "swap" not in self.actions():
            return None
        counters = _ops().stats()
        return {"evicted": counters["bytes_evicted"],
                "prefetched": counters["bytes_prefetched"],
                "skipped_tensors": counters["tensors_skipped"]}

    def install(self, model, runtime, patches):
        """XLA cannot compile the page-moving ops: turns `jit_compile` off."""
        if "swap" in self.actions() and model.jit_compile:
            patches.set(model, "jit_compile", False)
            return ("AutoVM set jit_compile=False: XLA cannot compile its "
                    "TensorFlow page-moving ops.")
        return None

    def after_layer(self, name, outputs, applied):
        """Evicts swapped inputs after their last forward reader and arms the
        backward prefetches this layer triggers.

        Both ops pass `outputs` through, so everything downstream depends on
        them: an evict runs after the read it follows, and a prefetch fires
        when the backward pass reaches this layer's output gradient.
        """
        if applied is None or not applied.names("swap"):
            return outputs
        if applied not in self._moves:
            self._moves[applied] = PageMoves(applied)
        moves = self._moves[applied]
        if moves.uses.get(name):
            self._swapped[name] = [outputs, moves.uses[name]]
        evict = [self._use(t) for t in moves.evict_after.get(name, ())]
        if evict:
            outputs = _ops().evict(outputs, evict)
            self.stats["evicts_inserted"] += len(evict)
        # A skip connection can put the trigger before the last forward
        # reader, so references are dropped after their last use, not first.
        fetch = [self._use(t) for t in moves.prefetch_at.get(name, ())]
        if fetch:
            outputs = _ops().prefetch_on_backward(outputs, fetch)
            self.stats["prefetches_inserted"] += len(fetch)
        return outputs

    def _use(self, tag):
        entry = self._swapped[tag]
        entry[1] -= 1
        if not entry[1]:
            del self._swapped[tag]
        return entry[0]


class PageMoves:
    """Where each swapped tensor of a plan is evicted and its prefetch armed.

    Only a recompute segment's last output carries gradient (the others are
    handed to layers that ignore them), so duties of a layer inside a
    segment move to the segment's last layer.
    """

    def __init__(self, applied):
        plan = applied.plan
        owner = {op: seg[-1] for seg in applied.segments for op in seg}
        index = plan.graph.op_index
        tensors = plan.graph.tensor_map
        self.evict_after, self.prefetch_at = {}, {}
        for tag in applied.names("swap"):
            readers = tensors[tag].fwd_readers
            if readers:
                last = max(readers, key=index.__getitem__)
                self.evict_after.setdefault(owner.get(last, last), []).append(tag)
            trigger = plan.prefetch.get(tag)
            if trigger is not None:
                self.prefetch_at.setdefault(owner.get(trigger, trigger), []).append(tag)
        moves = [t for ts in self.evict_after.values() for t in ts]
        moves += [t for ts in self.prefetch_at.values() for t in ts]
        self.uses = {t: moves.count(t) for t in applied.names("swap")}


def _ops():
    """The op module, or `None` (with a warning) when it cannot load."""
    from keras_autovm.mechanisms.tensorflow import ops
    try:
        ops.load_library()
    except ImportError as error:
        warnings.warn(f"AutoVM cannot swap on TensorFlow: {error}", stacklevel=3)
        return None
    return ops
