"""TensorFlow: recompute through `tf.recompute_grad` over plan segments;
swap through the managed-memory ops of ops/: an evict after a swapped
output's last forward reader, a prefetch issued from the backward pass of
the op the plan picks (`keras_autovm.tf_ops`)."""

import warnings

import tensorflow as tf

from keras_autovm import managed

# Recompute replays whole plan segments under `recompute`.
REPLAYS_SEGMENTS = True
# Whether each layer runs under `recompute` while a plan is applied.
REMAT_LAYERS = False
SWAPS_BY_OPS = True


def actions():
    """Keep and recompute; swap where pages can move.

    Swapping needs the op library and, on a GPU, TensorFlow allocating
    managed memory (`keras_autovm.enable_managed_memory`). Without a GPU the
    ops are identities, so a swap plan runs (for tests and demonstrations)
    and moves nothing.
    """
    if gpu_available() and not managed.managed_memory_enabled():
        return ("keep", "recompute")
    if _ops() is None:
        return ("keep", "recompute")
    return ("keep", "swap", "recompute")


def _ops():
    from keras_autovm import tf_ops
    try:
        tf_ops.load_library()
    except ImportError as error:
        warnings.warn(f"AutoVM cannot swap on TensorFlow: {error}", stacklevel=3)
        return None
    return tf_ops


def evict(data, targets):
    return _ops().evict(data, targets)


def prefetch_on_backward(data, targets):
    return _ops().prefetch_on_backward(data, targets)


def moved_bytes():
    """Bytes the page-moving ops evicted and prefetched (process totals)."""
    if "swap" not in actions():
        return None
    counters = _ops().stats()
    return {"evicted": counters["bytes_evicted"],
            "prefetched": counters["bytes_prefetched"],
            "skipped_tensors": counters["tensors_skipped"]}


def auto_actions():
    return actions()


def prepare(model):
    """XLA cannot compile the page-moving ops: turn `jit_compile` off."""
    if "swap" in actions() and model.jit_compile:
        model.jit_compile = False
        return ("AutoVM set jit_compile=False: XLA cannot compile its "
                "TensorFlow page-moving ops.")
    return None


def gpu_available():
    return bool(tf.config.list_physical_devices("GPU"))


def device_memory():
    """The GPU's memory limit: the logical device's cap if one is set."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    configs = tf.config.get_logical_device_configuration(gpus[0]) or []
    if configs and configs[0].memory_limit:
        return int(configs[0].memory_limit) * 2**20
    from keras_autovm import cuda
    return cuda.total_memory(0)


def peak_memory():
    if not gpu_available():
        return None
    return tf.config.experimental.get_memory_info("GPU:0")["peak"]


def reset_peak():
    if not gpu_available():
        return False
    tf.config.experimental.reset_memory_stats("GPU:0")
    return True


def tag(x, name):
    return x


def recompute(fn):
    return tf.recompute_grad(fn)


def install(model, runtime):
    pass


def uninstall(model):
    pass
