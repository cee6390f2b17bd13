"""Every private Keras, JAX or torch name keras-autovm relies on.

Nothing else in the package reaches behind a public API: when a framework
moves, this is the file to read again (every reach into Keras, its torch
backend's included, is here), with its TensorFlow and torch halves,
`mechanisms/tensorflow/internals.py` and `mechanisms/torch/internals.py`
(reaches into TensorFlow or torch only that backend's mechanism uses). Each function says why no public API serves and which versions it
was checked on (`CHECKED_VERSIONS`, for all three files);
`tests/test_internals.py` fails loudly when an installed version differs
from those, and exercises each reach.
"""

import contextlib
import functools
import sys

import keras

# The versions each reach below was read against.
# JAX 0.11.2 (Python 3.12 and newer; the GPU results') keeps the one JAX
# reach (`jax_concrete`) as 0.10.2 has it, read in its source; the CPU tests
# run on 0.10.2 (CI's Python 3.11).
CHECKED_VERSIONS = {"keras": ("3.15.1",), "tensorflow": ("2.21.0",),
                    "torch": ("2.13.0",), "jax": ("0.10.2", "0.11.2")}


# ------------------------------------------------------------ model graph


def functional_of(model):
    """The functional graph that runs `model`, or `None` if it has none.

    A built `Sequential` runs through the `Functional` it keeps in
    `_functional`; `Functional` itself is not exported, but every model made
    by `keras.Model(inputs, outputs)` is one and holds `_nodes_by_depth`.
    Keras 3.15.1.
    """
    if isinstance(model, keras.Sequential):
        return getattr(model, "_functional", None)
    return model if hasattr(model, "_nodes_by_depth") else None


def execution_nodes(fn):
    """The nodes of a functional graph in the order Keras runs them.

    Mirrors `Function._run_through_graph` (keras/src/ops/function.py, Keras
    3.15.1): depths from deepest (inputs) to 0, within a depth the order of
    `_nodes_by_depth[depth]`, skipping input nodes and nodes whose inputs are
    not computed yet. No public API lists a model's calls in run order
    (`model.layers` lists layers, not calls, and not in run order).
    """
    computed = {id(x) for x in fn.inputs}
    order = []
    for depth in sorted(fn._nodes_by_depth.keys(), reverse=True):
        for node in fn._nodes_by_depth[depth]:
            if not node.operation or node.is_input:
                continue
            if any(id(x) not in computed for x in node.input_tensors):
                continue
            order.append(node)
            computed.update(id(x) for x in node.outputs)
    return order


def output_specs(fn, inputs):
    """The output spec of every call in a functional graph, for given inputs.

    `inputs` are `keras.KerasTensor`s (one per `fn.inputs`) of concrete
    shape; returns a dict from `id()` of each symbolic tensor of `fn` (its
    inputs and every node's outputs) to the spec it has for those inputs.
    Each call's arguments are filled in as Keras runs the graph
    (`node.arguments.fill_in`, `Function._run_through_graph`) and its
    `compute_output_spec` is asked: no new node is added to any layer, as a
    symbolic call would. Keras 3.15.1.
    """
    specs = {id(x): spec for x, spec in zip(fn.inputs, inputs)}
    for node in execution_nodes(fn):
        args, kwargs = node.arguments.fill_in(specs)
        outputs = node.operation.compute_output_spec(*args, **kwargs)
        specs.update(zip((id(x) for x in node.outputs), keras.tree.flatten(outputs)))
    return specs


def uncast_value(variable):
    """A variable's own tensor, never the cast copy `variable.value` gives
    inside a mixed-precision layer call (`_maybe_autocast`).

    The torch swap leaves the storages of variables alone and must know
    them from inside a training step, where `value` is a bfloat16 copy.
    `Variable._value` holds the tensor itself. Keras 3.15.1.
    """
    return variable._value


def producer(x):
    """The operation that made a symbolic tensor (`_keras_history[0]`).

    KerasTensors expose no public producer. Keras 3.15.1.
    """
    history = getattr(x, "_keras_history", None)
    return history[0] if history else None


def num_outputs(layer):
    """How many outputs a called layer has, from its first call's node.

    `layer.output` is public but raises for shared layers and lists nested
    structures; the node (`_inbound_nodes`) has the flat outputs. Keras
    3.15.1. Returns `None` for a layer never called.
    """
    nodes = getattr(layer, "_inbound_nodes", None)
    return len(nodes[0].outputs) if nodes else None


def draws_random_numbers(layer):
    """Whether a layer or any layer inside it owns a `SeedGenerator`.

    No public flag says a layer is random; `_seed_generators` is where
    `Layer` tracks them and `_flatten_layers` walks sub-layers. Keras 3.15.1.
    """
    layers = layer._flatten_layers() if hasattr(layer, "_flatten_layers") else [layer]
    return any(getattr(sub, "_seed_generators", None) for sub in layers)


def sublayers(layer):
    """The layers a layer holds directly (a custom block's parts).

    No public API lists them on a plain `Layer` (only `Model.layers`);
    `_flatten_layers(include_self=False, recursive=False)` is how `Layer`
    walks its own. Keras 3.15.1.
    """
    if not hasattr(layer, "_flatten_layers"):
        return []
    return list(layer._flatten_layers(include_self=False, recursive=False))


def call_takes_training(layer):
    """Whether `layer.call` accepts `training` (`_call_has_training_arg`).

    Keras computes this once per layer; reading it keeps the replay of a
    segment passing `training` exactly where Keras itself would. Keras
    3.15.1.
    """
    return bool(getattr(layer, "_call_has_training_arg", False))


def run_calls(model, inputs, around):
    """Runs a model's forward pass in training mode, one layer call at a time.

    `around(operation, run, args, kwargs)` is called for each call, in run
    order, and must return `run()`'s result. Keras runs a functional graph through
    `Function._run_through_graph(inputs, operation_fn)` and passes
    `training` to the operations whose `_call_context_args` name it
    (`keras/src/models/functional.py`, `operation_fn`); no public API runs
    one call at a time. Keras 3.15.1.
    """
    fn = functional_of(model)

    def operation_fn(operation):
        def run(*args, **kwargs):
            if "training" in getattr(operation, "_call_context_args", {}):
                kwargs["training"] = True
            return around(operation, lambda: operation(*args, **kwargs), args, kwargs)
        return run

    return fn._run_through_graph(inputs, operation_fn=operation_fn)


@contextlib.contextmanager
def uncompiled(model):
    """Makes `model` look uncompiled while `keras.models.clone_model` runs.

    `clone_model` compiles the clone from the model's compile config, and
    serialising that config imports TensorFlow on every backend (to test
    for `tf.TensorShape`) and builds an optimizer: AutoVM's clone only
    routes calls to the original layers and must do neither. `compiled` is
    a plain attribute of `Trainer`. Keras 3.15.1.
    """
    compiled = model.compiled
    model.compiled = False
    try:
        yield
    finally:
        model.compiled = compiled


def has_keras_mask(args):
    """Whether any tensor in `args` carries a Keras mask.

    Keras 3 keeps a layer output's mask on the tensor itself
    (`backend.get_keras_mask`), and `Layer.__call__` reads it from the
    inputs and sets it on the outputs; no public API reads it. Keras 3.15.1.
    """
    from keras.src.backend.common import masking

    if len(args) == 1 and hasattr(args[0], "shape"):
        # One tensor, the usual layer call: every layer of every eager step
        # asks, and flattening costs more than the look-up.
        return masking.get_keras_mask(args[0]) is not None
    return any(masking.get_keras_mask(x) is not None
               for x in keras.tree.flatten(args) if hasattr(x, "shape"))


# ------------------------------------------------------------------- dtypes


@contextlib.contextmanager
def float64_results():
    """Keeps Keras's dtype promotion from turning float64 into float32.

    Keras's `result_type` maps every 64-bit result to 32 bits on JAX and
    torch (`BIT64_TO_BIT32_DTYPE` in `keras/src/backend/common/dtypes.py`,
    to match JAX's default), even under floatx float64: batch normalization
    computes in `result_type(inputs.dtype, "float32")`, so a float64 model
    normalized in float32 (after two steps, JAX Xception's weights under
    AutoVM ended 4.6e-7 from Keras's own instead of 4.4e-16). No public
    switch changes this: floatx and the dtype policy leave it alone. While
    active, float64 results stay float64 (as TensorFlow's mapping has them
    already); the previous mapping comes back on exit. Only tests use it: AutoVM itself trains in whatever dtype
    Keras computes. Keras 3.15.1.
    """
    from keras.src.backend.common import dtypes

    mapping = dtypes.BIT64_TO_BIT32_DTYPE
    old = mapping["float64"]
    mapping["float64"] = "float64"
    try:
        yield
    finally:
        mapping["float64"] = old


# ------------------------------------------------------------- fit internals

# The JAX trainer's stateless loss function: the smallest function holding
# both the producer and the backward reader of every layer output, with
# state as values in and out. Public name, undocumented. Keras 3.15.1.
JAX_LOSS_FUNCTION = "compute_loss_and_updates"


def jax_state_reattached(model, state):
    """Puts back into `model`'s variables the training state a JAX `fit`
    step was given: `(trainable, non-trainable, optimizer, metrics)`
    values.

    Keras's JAX `fit` takes the values out of the model's variables before
    an epoch's first step (to hold one copy of the weights, not two) and
    puts them back only at the epoch's end; a step that raises leaves them
    out, and the model's weights can no longer be read. State a compiled
    step was given (donated) and deleted cannot be put back: nothing is
    done then. Keras 3.15.1
    (`JAXTrainer.fit`, `_jax_state`, `jax_state_sync`).
    """
    import jax

    if any(x.is_deleted() for x in jax.tree_util.tree_leaves(state)
           if isinstance(x, jax.Array)):
        return  # Given to a compiled step that ran (donated): nothing to put back.
    names = ("trainable_variables", "non_trainable_variables",
             "optimizer_variables", "metrics_variables")
    model._jax_state = dict(zip(names, state))
    model._jax_state_synced = False
    model.jax_state_sync()


def running_fit(depth=12):
    """The locals of the `fit` call that is running this callback hook.

    Keras gives callbacks neither the batch size (TensorFlow traces the step
    with an unknown batch dimension) nor a way to learn that `fit` ended in
    an exception (`on_train_end` is not called then). The `fit` frame holds
    both: `epoch_iterator` (its data adapter knows the batch size) and
    `callbacks` (the `CallbackList`, whose hooks every error between two
    steps passes through). Keras 3.15.1, all three trainers.

    Returns:
        A dict with `epoch_iterator` and `callbacks` (either may be
        `None`), empty when no `fit` frame is found.
    """
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        found = frame.f_locals
        if "epoch_iterator" in found and "callbacks" in found:
            return {"epoch_iterator": found["epoch_iterator"],
                    "callbacks": found["callbacks"]}
        frame = frame.f_back
    return {}


def ends_epoch(error):
    """Whether `fit` reads `error` as the end of an epoch's data.

    Keras's epoch iterators (`catch_stop_iteration`) end the epoch on
    `StopIteration` and, on TensorFlow, `tf.errors.OutOfRangeError`, raised
    from the data or from inside the training function that reads it, and
    train on. Matched by name so that no TensorFlow is imported. Keras
    3.15.1.
    """
    return isinstance(error, StopIteration) or type(error).__name__ == "OutOfRangeError"


def batch_size_of(epoch_iterator):
    """The batch size the data adapter of an `EpochIterator` yields.

    `data_adapter` is an attribute of Keras's `EpochIterator`; its
    `batch_size` is `None` for datasets of unknown batch size (a `tf.data`
    dataset whose last batch may be partial, a generator). Then the first
    batch says: a generator's adapter has peeked it (`_first_batches`), a
    `tf.data` dataset's adapter holds the dataset (`_dataset`), whose first
    element is read from a fresh iterator. Keras 3.15.1.
    """
    adapter = getattr(epoch_iterator, "data_adapter", None)
    size = getattr(adapter, "batch_size", None)
    if size is not None:
        return size
    first = getattr(adapter, "_first_batches", None)
    if first:
        return _leading_size(first[0])
    dataset = getattr(adapter, "_dataset", None)
    if dataset is not None and hasattr(dataset, "take"):
        for element in dataset.take(1):
            return _leading_size(element)
    return None


def _leading_size(batch):
    leaves = keras.tree.flatten(batch)
    shape = getattr(leaves[0], "shape", None) if leaves else None
    return int(shape[0]) if shape and shape[0] is not None else None


# --------------------------------------------------------------------- JAX


def jax_concrete(x):
    """The concrete `jax.Array` under `x` in an eager (unjitted) JAX
    differentiation, or `None` where there is none (under `jax.jit`).

    In `jax.value_and_grad` run eagerly, a layer output is a linearize (or
    JVP) tracer whose `primal` attribute is the concrete array the op
    computed; the swap reads that array's identity and deletes its buffer
    after its last forward reader (`mechanisms/jax/swap.py`). No public API
    reaches a tracer's primal value. JAX 0.10.2 and 0.11.2
    (`LinearizeTracer`, `JVPTracer`: a `primal` slot).
    """
    import jax

    while isinstance(x, jax.core.Tracer):
        x = getattr(x, "primal", None)
    return x if isinstance(x, jax.Array) else None


def keras_call_training():
    """`training` of the Keras layer call running now (`None` outside one).

    Keras passes `training` from a model's call down to the layers inside,
    through a call context, and to a layer's own sublayers only that way
    (a custom layer whose `call` takes no `training`). The JAX swap traces
    a layer's backward program after the model's call has ended
    (`mechanisms/jax/calls.py`), so it records the value here and restores
    it with `keras_call_training_set`. No public API reads or sets the
    call context. Keras 3.15 (`current_call_ctx`, `CallContext`).
    """
    from keras.src.backend.common import global_state

    context = global_state.get_global_attribute("current_call_ctx")
    return None if context is None else context.get_value("training")


@contextlib.contextmanager
def keras_call_training_set(training):
    """Layers called inside see `training` as a model's call would pass
    it, where no Keras call is running (see `keras_call_training`)."""
    from keras.src.backend.common import global_state
    from keras.src.layers.layer import CallContext

    previous = global_state.get_global_attribute("current_call_ctx")
    if previous is not None or training is None:
        yield
        return
    # No entry layer: no layer inside resets it on returning.
    context = CallContext(entry_layer=None)
    context.set_value("training", training)
    global_state.set_global_attribute("current_call_ctx", context)
    try:
        yield
    finally:
        global_state.set_global_attribute("current_call_ctx", previous)


# ----------------------------------------------------- Keras's torch backend


@contextlib.contextmanager
def torch_inputs_on_views():
    """Keras's torch convolutions and max pooling read a channels-last
    input through a view, not through a copy of it.

    Keras 3.15.1's torch `conv` and `max_pool` (keras/src/backend/torch/
    nn.py) turn a channels-last input into a contiguous channels-first copy
    (`_transpose_spatial_inputs`), `conv` that into a channels-last-strided
    second copy (`_maybe_convert_to_channels_last`), and autograd saves the
    copy for the backward pass: every convolution and max pooling holds a
    second copy of its input until its backward runs. The channels-first
    view of a contiguous channels-last tensor already has a convolution's
    strides, so it gets the same bytes in the same layout from the input's
    own storage, and its output and the input's gradient come back in
    Keras's layouts: the same numbers. No public API chooses the layout
    `conv` hands torch; it reads the module's `_transpose_spatial_inputs`
    when called, and this swaps that only while `conv` runs (a thread
    calling Keras's `conv`, `conv_transpose` or average pooling meanwhile
    would see it). Max pooling runs Keras's own channels-first `max_pool`
    on the view instead (no swap): it picks the same maxima, but its output
    and its input's gradient come back channels-last where Keras's are
    channels-first, and a reduction reading them (batch normalization, a
    bias's gradient) would sum in another order, so both are copied to
    Keras's layouts (`_grad_layout_function`): a copy of the output (a
    quarter of the input for a 2x2 pool), and of the gradient while it is
    made, instead of one of the input for the whole step. Inputs of other
    layouts (1D, non-contiguous) get Keras's own. Entering it again while
    it is on changes nothing. Keras 3.15.1.
    """
    import torch
    from keras.src.backend.torch import nn

    conv, max_pool = nn.conv, nn.max_pool
    if getattr(conv, "_autovm_views", False):  # Already on (nested).
        yield
        return
    # Keras's own, even if another thread is inside a wrapped call now.
    transpose = getattr(nn._transpose_spatial_inputs, "_autovm_original",
                        nn._transpose_spatial_inputs)
    layouts = {4: torch.channels_last, 5: torch.channels_last_3d}
    # Made here, not inside a call torch.compile may trace.
    grad_layout = _grad_layout_function()

    def view_of(inputs):
        if not isinstance(inputs, torch.Tensor) or inputs.ndim not in layouts:
            return None
        view = inputs.permute(0, inputs.ndim - 1, *range(1, inputs.ndim - 1))
        return view if view.is_contiguous(memory_format=layouts[inputs.ndim]) else None

    def as_view(inputs):
        view = view_of(inputs)
        return transpose(inputs) if view is None else view

    as_view._autovm_original = transpose

    @functools.wraps(conv)
    def conv_on_view(*args, **kwargs):
        nn._transpose_spatial_inputs = as_view
        try:
            return conv(*args, **kwargs)
        finally:
            nn._transpose_spatial_inputs = transpose

    @functools.wraps(max_pool)
    def max_pool_on_view(inputs, pool_size, strides=None, padding="valid",
                         data_format=None):
        channels_last = nn.backend.standardize_data_format(data_format) == "channels_last"
        view = view_of(inputs) if channels_last else None
        if view is None:
            return max_pool(inputs, pool_size, strides, padding, data_format)
        outputs = max_pool(grad_layout.apply(view), pool_size, strides, padding,
                           "channels_first")
        # Keras's own output is a channels-last view of a contiguous tensor.
        return nn._transpose_spatial_outputs(outputs.contiguous())

    conv_on_view._autovm_views = max_pool_on_view._autovm_views = True
    nn.conv, nn.max_pool = conv_on_view, max_pool_on_view
    try:
        yield
    finally:
        nn.conv, nn.max_pool = conv, max_pool


@functools.cache
def _grad_layout_function():
    """An identity whose gradient comes back contiguous channels-first, the
    layout of the gradient of Keras's copy."""
    import torch

    class KerasGradLayout(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor):
            return tensor.view_as(tensor)

        @staticmethod
        def backward(ctx, grad):
            return grad.contiguous()

    return KerasGradLayout
