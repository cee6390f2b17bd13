"""TensorFlow ops that move CUDA managed-memory pages, and their gradients.

The ops come from the compiled library `keras_autovm/native/_autovm_ops.so`
(sources in ops/tf/), loaded on first use. Each page-moving op is an identity
on its first input, `data`, that forwards the buffer (no copy); its side
effect, on a GPU whose tensors live in CUDA managed memory (TensorFlow's
unified-memory allocator), is a `cuMemPrefetchAsync` of every tensor in
`targets` on a dedicated stream (one per device and direction), ordered after
the work already on the op's compute stream. On the CPU, and for targets that
are not managed memory, the ops are plain identities. Correctness never depends on them: the
driver faults pages back wherever they are read; only speed does.

`data` is what orders the move in the graph: for an evict, pass the output of
the target's last forward reader, so the pages leave only after that reader
ran. For a prefetch, pass a tensor computed shortly before the target's next
reader needs it.

The ops are stateful, so that graph optimizers neither constant-fold, merge
nor prune them. Inside a `tf.function`, TensorFlow's automatic control
dependencies therefore run them in program order with respect to each other
(and to other stateful ops that take no resource).

Example:

    from keras_autovm.mechanisms.tensorflow import ops as tf_ops

    y = layer2(layer1_out)
    y = tf_ops.evict(y, [layer1_out])          # layer1_out to the host
    ...
    z = tf_ops.prefetch_on_backward(z, [layer1_out])  # back to the GPU when
                                                       # z's gradient is made
"""

import threading
import warnings
from pathlib import Path

from keras_autovm import native

LIBRARY_NAME = native.build.TF_LIBRARY
VERSION_FILE = native.build.TF_VERSION_FILE
BUILD_COMMAND = native.build.BUILD_COMMAND
STATS_KEYS = (
    "ops_issued",
    "bytes_evicted",
    "bytes_prefetched",
    "tensors_skipped",
    "errors",
)

_lock = threading.Lock()
_loaded = {}  # resolved library path -> op module
_gradients_registered = False


def _import_tensorflow():
    try:
        import tensorflow as tf  # noqa: PLC0415 -- optional dependency
    except ImportError as e:
        raise ImportError(
            "keras_autovm.mechanisms.tensorflow.ops needs TensorFlow, which is not installed: "
            "install it (`pip install tensorflow`), then build the op library "
            f"with `{BUILD_COMMAND}`."
        ) from e
    return tf


def library_path(directory=None):
    """Path of the op library: `directory`, or keras_autovm/native/."""
    base = Path(directory) if directory is not None else native.LIBRARY_DIR
    return base / LIBRARY_NAME


def check_version(directory=None, tf_version=None):
    """Warns when the library was built for another TensorFlow version.

    A TensorFlow custom op library is tied to the TensorFlow it was compiled
    against (C++ ABI); a mismatch may fail to load or crash.

    Args:
        directory: Where the library and its version file are. Defaults to
            keras_autovm/native/.
        tf_version: The running TensorFlow version. Defaults to
            `tf.__version__`.

    Returns:
        The recorded version, or `None` when no version file exists.
    """
    path = library_path(directory).with_name(VERSION_FILE)
    try:
        lines = path.read_text().splitlines()
    except OSError:
        lines = []
    built = lines[0].strip() if lines else None
    if tf_version is None:
        tf_version = _import_tensorflow().__version__
    if built is None:
        warnings.warn(
            f"keras-autovm: {path} is missing, so the TensorFlow version "
            f"{LIBRARY_NAME} was built for is unknown; rebuild it with "
            f"`{BUILD_COMMAND} --force` if the ops fail.",
            RuntimeWarning,
            stacklevel=3,
        )
    elif built != tf_version:
        warnings.warn(
            f"keras-autovm: {LIBRARY_NAME} was built for TensorFlow {built} "
            f"but TensorFlow {tf_version} is running; rebuild it with "
            f"`{BUILD_COMMAND} --force`.",
            RuntimeWarning,
            stacklevel=3,
        )
    return built


def load_library(directory=None):
    """Loads the op library (once per path) and registers the gradients.

    Args:
        directory: Where `_autovm_ops.so` is. Defaults to
            keras_autovm/native/. (TensorFlow registers op names process-wide, so a
            second copy of the library at another path adds no ops.)

    Returns:
        The module of generated op functions (`autovm_evict`, ...).

    Raises:
        ImportError: TensorFlow is not installed, or the library is absent
            (the message says how to build it).
    """
    tf = _import_tensorflow()
    path = library_path(directory).resolve()
    with _lock:
        if path in _loaded:
            return _loaded[path]
        if not path.is_file():
            raise ImportError(
                f"keras-autovm's TensorFlow op library {path} was not found. "
                f"Build it with `{BUILD_COMMAND}` (or reinstall the package "
                "from source with `pip install --no-build-isolation .`)."
            )
        check_version(path.parent, tf.__version__)
        module = tf.load_op_library(str(path))
        _register_gradients(tf)
        _loaded[path] = module
        return module


def _ops():
    if _loaded:
        return next(iter(_loaded.values()))
    return load_library()


def _flat(tf, targets):
    if targets is None:
        return []
    return tf.nest.flatten(targets)


def evict(data, targets, name=None):
    """Returns `data`; moves the pages of `targets` to the host.

    Args:
        data: Tensor passed through (same buffer). Pass the output of the
            last forward reader of `targets`.
        targets: Tensor or (nested) list of tensors to evict. May be empty.
        name: Op name. Defaults to `None` (TensorFlow picks one).

    Returns:
        A tensor equal to `data`.
    """
    tf = _import_tensorflow()
    return _ops().autovm_evict(data, _flat(tf, targets), name=name)


def prefetch(data, targets, pre_access=False, name=None):
    """Returns `data`; moves the pages of `targets` to the op's GPU.

    Args:
        data: Tensor passed through (same buffer).
        targets: Tensor or (nested) list of tensors to prefetch.
        pre_access: Make the compute stream wait for the move, so that later
            readers on it do not fault. Defaults to `False`.
        name: Op name. Defaults to `None`.

    Returns:
        A tensor equal to `data`.
    """
    tf = _import_tensorflow()
    return _ops().autovm_prefetch(
        data, _flat(tf, targets), pre_access=bool(pre_access), name=name
    )


def prefetch_on_backward(data, targets, pre_access=False, name=None):
    """Identity on `data` whose gradient prefetches `targets` to the GPU.

    The forward pass moves no page. In the backward pass, when the gradient
    of `data` is computed, the gradient op `AutovmPrefetch(grad, targets)` is
    issued: place this on a tensor whose backward comes shortly before the
    backward readers of `targets`.

    This is a third op, `AutovmBackwardPrefetch`, with a registered gradient
    rather than a `tf.custom_gradient`: the targets are real inputs of a node
    in the graph (TensorFlow keeps them alive and visible to graph tools), the
    gradient is found by op type wherever the graph goes (no per-call Python
    closure in a process-local registry), and no nested function is traced.

    Args:
        data: Tensor passed through (same buffer).
        targets: Tensor or (nested) list of tensors to prefetch in backward.
        pre_access: Passed to the backward `AutovmPrefetch`. Defaults to
            `False`.
        name: Op name. Defaults to `None`.

    Returns:
        A tensor equal to `data`.
    """
    tf = _import_tensorflow()
    return _ops().autovm_backward_prefetch(
        data, _flat(tf, targets), pre_access=bool(pre_access), name=name
    )


def pointer(x, name=None):
    """Address of `x`'s buffer as an int64 scalar in host memory.

    On a GPU this is a device address, usable with
    `keras_autovm.native.native.pointer_info`. For tests and diagnostics.
    """
    return _ops().autovm_pointer(x, name=name)


def stats():
    """Process-wide counters of the GPU page-moving kernels.

    Returns:
        dict with keys `ops_issued` (GPU op runs that enqueued a prefetch),
        `bytes_evicted`, `bytes_prefetched`, `tensors_skipped` (targets that
        were not managed memory) and `errors`: Python ints when executing
        eagerly, scalar tensors inside a `tf.function`.
    """
    tf = _import_tensorflow()
    with tf.device("/CPU:0"):
        values = _ops().autovm_stats()
    if tf.executing_eagerly():
        return dict(zip(STATS_KEYS, (int(v) for v in values.numpy())))
    return {key: values[i] for i, key in enumerate(STATS_KEYS)}


def reset_stats():
    """Sets all `stats()` counters to zero."""
    tf = _import_tensorflow()
    with tf.device("/CPU:0"):
        return _ops().autovm_reset_stats()


# Gradients, registered on first load (they need TensorFlow).


def _passthrough_grad(op, grad):
    """d(data) = incoming gradient; targets get none."""
    return [grad] + [None] * (len(op.inputs) - 1)


def _backward_prefetch_grad(op, grad):
    """d(data) = AutovmPrefetch(grad, targets): the prefetch is the trigger."""
    tf = _import_tensorflow()
    targets = list(op.inputs[1:])
    if grad is None:
        return [None] * len(op.inputs)
    grad = tf.convert_to_tensor(grad)
    moved = _ops().autovm_prefetch(
        grad, targets, pre_access=op.get_attr("pre_access")
    )
    return [moved] + [None] * len(targets)


def _register_gradients(tf):
    global _gradients_registered
    if _gradients_registered:
        return
    tf.RegisterGradient("AutovmEvict")(_passthrough_grad)
    tf.RegisterGradient("AutovmPrefetch")(_passthrough_grad)
    tf.RegisterGradient("AutovmBackwardPrefetch")(_backward_prefetch_grad)
    tf.no_gradient("AutovmPointer")
    _gradients_registered = True
