"""Turning on TensorFlow's CUDA managed-memory (unified memory) allocator.

With it, every tensor TensorFlow allocates on the GPU is CUDA managed memory:
its pages can move to the host and back while its address stays the same,
which is what AutoVM's TensorFlow swap (evict/prefetch ops) relies on.
`PageMoves` says where a plan's evicts and prefetches go.
"""

import keras

from keras_autovm.mechanisms.tensorflow import internals as tf_internals

_state = {"enabled": False, "memory_fraction": None}


def enable_managed_memory(memory_fraction=0.9):
    """Makes TensorFlow allocate GPU tensors from CUDA managed memory.

    Call it before TensorFlow first uses the GPU (before building or running
    a model); the allocator cannot be changed afterwards. Then, with the
    TensorFlow backend, `AutoVM` can plan swaps and carries them out by
    moving the pages of each swapped layer output to host after its last
    forward reader and back ahead of its backward reader.

    Args:
        memory_fraction: the size of TensorFlow's memory pool as a fraction of
            the GPU's memory. Above 1 it oversubscribes the GPU: the pool is
            larger than the device and the driver pages memory to and from
            the host. Oversubscription can hang a GPU shared with others;
            keep the pool within the GPU's free memory there. Defaults to
            0.9.

    Raises:
        ValueError: `memory_fraction` is not a positive number.
        RuntimeError: TensorFlow has already initialised the GPU.
        NotImplementedError: the Keras backend is not TensorFlow (JAX and
            torch allocate from their own pools, which AutoVM does not
            move pages of).

    Example:

    ```python
    import keras_autovm
    keras_autovm.enable_managed_memory(memory_fraction=0.5)
    # ... then build and fit the model with AutoVM.
    ```
    """
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise NotImplementedError(
            "enable_managed_memory() makes TensorFlow allocate from CUDA "
            "managed memory, and AutoVM moves pages only on the TensorFlow "
            f"backend; the Keras backend is {backend!r}. On it, AutoVM swaps "
            "by copies to host: use AutoVM without this call.")
    if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)) \
            or memory_fraction <= 0:
        raise ValueError("`memory_fraction` must be a positive number. "
                         f"Received: memory_fraction={memory_fraction!r}")
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto()
    config.gpu_options.experimental.use_unified_memory = True
    config.gpu_options.per_process_gpu_memory_fraction = float(memory_fraction)
    if not tf_internals.tf_merge_pending_config(config):
        raise RuntimeError(
            "enable_managed_memory() must be called before TensorFlow "
            "initialises the GPU (before any model is built or run); it has "
            "already been initialised in this process.")
    _state.update(enabled=True, memory_fraction=float(memory_fraction))


def managed_memory_enabled():
    """Whether `enable_managed_memory` was called in this process."""
    return _state["enabled"]


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
