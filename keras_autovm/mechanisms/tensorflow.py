"""TensorFlow: recompute through `tf.recompute_grad` over plan segments.

Swapping needs the managed-memory ops of ops/ (see docs/mechanisms.md); until
the callback drives them, a plan with swaps is refused here."""

import tensorflow as tf

# Recompute replays whole plan segments under `recompute`.
REPLAYS_SEGMENTS = True
ACTIONS = ("keep", "recompute")


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
