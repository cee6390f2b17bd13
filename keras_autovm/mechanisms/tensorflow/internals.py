"""Every private TensorFlow name the TensorFlow mechanism relies on.

The TensorFlow half of `keras_autovm/internals.py` (which holds the
versions they were read against, `CHECKED_VERSIONS`): nothing else reaches
behind TensorFlow's public API. Each function says why no public API
serves; `tests/test_internals.py` exercises each reach.
"""

import contextlib


def tf_merge_pending_config(config):
    """Merges a `ConfigProto` into TensorFlow's context before it starts.

    The unified-memory allocator (`gpu_options.experimental
    .use_unified_memory`) has no TF2 setter, and TensorFlow reads GPU
    options once, when its eager context is initialised. The context keeps
    the pending config in `_config` and is initialised once
    `_context_handle` is set. TensorFlow 2.21.0.

    Returns:
        `False` (and changes nothing) when the context is initialised.
    """
    import tensorflow as tf
    from tensorflow.python.eager import context

    ctx = context.context()
    if ctx._context_handle is not None:
        return False
    merged = tf.compat.v1.ConfigProto()
    if ctx._config is not None:
        merged.CopyFrom(ctx._config)
    merged.MergeFrom(config)
    ctx._config = merged
    return True


def tf_logits(x):
    """The logits Keras's TensorFlow backend attached to `x`, or `None`.

    On TensorFlow, `keras.activations.softmax` and `sigmoid` (and so
    `Activation("softmax")`, `Dense(activation="softmax")`, ...) set their
    input as `output._keras_logits`, and the cross-entropy losses compute
    from those logits instead of from the probabilities
    (`keras.src.backend.tensorflow.nn._get_logits`). Keras 3.15.1.
    """
    return getattr(x, "_keras_logits", None)


def tf_op_logits(x):
    """`(op_type, logits)` where Keras's TensorFlow losses recognise `x` by
    the op that made it, else `(None, None)`.

    Where `x` carries no `_keras_logits` (`tf_logits`), the cross-entropy
    losses take a graph tensor made by a `Softmax` op (the categorical
    ones) or a `Sigmoid` op (binary cross-entropy), such as a raw
    `tf.nn.softmax` in a `Lambda`, as probabilities of that op's one input,
    and compute from the input (`keras.src.backend.tensorflow.nn
    ._get_logits`; not eager tensors). Keras 3.15.1.
    """
    import tensorflow as tf

    if tf_logits(x) is not None or not tf.is_symbolic_tensor(x):
        return None, None
    if x.op.type not in ("Softmax", "Sigmoid") or len(x.op.inputs) != 1:
        return None, None
    return x.op.type, x.op.inputs[0]


def tf_set_logits(x, logits):
    """Attaches `logits` to `x` as Keras's softmax and sigmoid do; like them,
    does nothing on a tensor that takes no attributes. Keras 3.15.1."""
    try:
        x._keras_logits = logits
    except AttributeError:
        pass


def tf_stop_recording():
    """A context in which no gradient tape records (`record.stop_recording`).

    The explicit swap makes its host copies and prefetch markers without the
    tape seeing them. `tf.GradientTape.stop_recording` is public but needs
    the tape, which Keras's train step owns. TensorFlow 2.21.0.
    """
    from tensorflow.python.eager import record

    return record.stop_recording()


def tf_record_operation(op_type, outputs, inputs, backward):
    """Records an operation on every active gradient tape.

    `backward(*output_gradients)` returns one gradient (or `None`) per input.
    This is `tf.custom_gradient`'s own recording step
    (`record.record_operation`), without the `IdentityN` that
    `tf.custom_gradient` adds to the forward's data path (an op there changes
    which rewrites Grappler applies across it). The explicit swap marks
    tensors with it to learn when the backward pass reaches them.
    TensorFlow 2.21.0.
    """
    from tensorflow.python.eager import record

    record.record_operation(op_type, list(outputs), list(inputs), backward)


def tf_variable_watcher():
    """A context recording the variables read inside it, recording or not.

    `record.VariableWatcher`, which `tf.custom_gradient` and
    `tf.recompute_grad` use to find the variables a function reads (and so
    must return gradients for); `watched_variables()` lists them.
    TensorFlow 2.21.0.
    """
    from tensorflow.python.eager import record

    return record.VariableWatcher()


def tf_replace_input(op, index, tensor):
    """Makes graph op `op` read `tensor` as its input `index`.

    The explicit swap builds the training step as TensorFlow would, then
    points the backward ops that read a swapped layer output at the copy
    brought back from the host (`Operation._update_input`, which
    TensorFlow's own control-flow code uses for the same purpose). Building
    the backward from copies instead (`tf.custom_gradient` recomputing each
    reader) changes the forward's numbers: Grappler reassociates forward
    arithmetic whose intermediates no backward op reads any more.
    TensorFlow 2.21.0.
    """
    op._update_input(index, tensor)


@contextlib.contextmanager
def tf_grappler_swapping_off():
    """A context in which the functions called (and traced) are optimized
    without Grappler's swapping heuristic, its scheduling kept
    (`RewriterConfig.memory_optimization = SCHEDULING_HEURISTICS`; the
    default also swaps). Under a device memory cap Grappler inserts swaps of
    its own (`swap_out_*`/`swap_in_*`) wherever its estimate of the step's
    memory exceeds the device's: under an 8 GiB cap on an H100 it swapped
    again what AutoVM's plan had copied back for VGG-19's first block, and
    its copies back ran out of memory in the steps of two of three batch
    sizes (results/tensorflow/in_flight/). TensorFlow 2 exposes the option
    only through the thread's function call options, which set the
    `config_proto` of each function call (`context.function_call_options`);
    the rest of the configuration, `tf.config.optimizer`'s options
    included, is the thread's as it was. TensorFlow 2.21.0.
    """
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.core.protobuf import rewriter_config_pb2
    from tensorflow.python.eager import context

    ctx = context.context()
    old = ctx.function_call_options
    config = config_pb2.ConfigProto()
    config.ParseFromString(old.config_proto_serialized)
    config.graph_options.rewrite_options.memory_optimization = (
        rewriter_config_pb2.RewriterConfig.SCHEDULING_HEURISTICS)
    ctx.function_call_options = context.FunctionCallOptions(
        executor_type=old.executor_type, config_proto=config)
    try:
        yield
    finally:
        ctx.function_call_options = old


def tf_function_graphs(fn, *args):
    """Runs `fn(*args)` and returns the graphs of the functions it ran.

    One `RunMetadata.FunctionGraphs` per function TensorFlow instantiated
    during the call (a function already run before is not listed, nor one
    instantiated before the call), with
    `pre_optimization_graph`, `post_optimization_graph` (after Grappler)
    and `partition_graphs` (one per device, with the Send/Recv pairs
    between them). Tests and the GPU recipe use it to show that the swap's
    copies survive Grappler and cross devices when planned. The eager
    context's run metadata (`enable_run_metadata`, `export_run_metadata`)
    has no public reader in TF2 (`tf.summary.trace_export` writes it to
    event files). TensorFlow 2.21.0.
    """
    from tensorflow.python.eager import context

    ctx = context.context()
    ctx.enable_run_metadata()
    try:
        # The context collects the graphs of every function instantiated
        # since the last export, listing on or not: drop them first.
        ctx.export_run_metadata()
        fn(*args)
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    return list(metadata.function_graphs)
