"""Builds the planner's `Graph` from a built Keras 3 model.

One op per layer call, in the order Keras executes them, and one tagged
tensor per layer output, with its size at a given batch size, the ops that
read it in the forward pass and the ops whose backward pass reads it.

Execution order is the order of `Function._run_through_graph`
(`keras/src/ops/function.py`, Keras 3.15): depths from deepest (inputs) to 0
(outputs), within a depth the order of `_nodes_by_depth[depth]`, skipping
input nodes and nodes whose inputs are not yet computed. A built `Sequential`
runs through the `Functional` it keeps in `_functional`, so it is the same
walk.

Names: an op is named after its layer; a tensor is named `layer.name` (one
output) or `f"{layer.name}:{i}"` (the i-th of several). A shared layer's
later calls get `f"{layer.name}@{k}"` as op name and name prefix. Use
`tag_name` / `tag_names` so that the wrappers and the plan agree.

What the planner cannot manage is kept (`can_swap=False`,
`can_recompute=False`) and the note says why: outputs of shared layers, of
layers with several outputs, and of raw `keras.ops` calls (not layers, so
they cannot be wrapped). Outputs of random layers (a `SeedGenerator`
anywhere inside, e.g. `Dropout`) may be swapped but not recomputed: a rerun
would draw a new mask. A nested model is one op; its outputs may be swapped
(they are plain tensors) but not recomputed (that would rerun the whole
sub-model, whose backward-time memory the planner does not model). Its own
activations are added as one keep-only tensor `f"{name}:internal"`, live
from its forward to its backward, so the memory is counted.
"""

import math
import re

import keras
from keras.src.layers.convolutional.base_conv import BaseConv
from keras.src.layers.convolutional.base_conv_transpose import BaseConvTranspose
from keras.src.layers.convolutional.base_depthwise_conv import BaseDepthwiseConv
from keras.src.layers.convolutional.base_separable_conv import BaseSeparableConv
from keras.src.layers.pooling.base_adaptive_pooling import BaseAdaptivePooling
from keras.src.layers.pooling.base_global_pooling import BaseGlobalPooling
from keras.src.layers.pooling.base_pooling import BasePooling
from keras.src.models.functional import Functional

from keras_autovm.wrapper import AutoVMWrapper
from keras_autovm.planner.graph import Graph
from keras_autovm.planner.graph import OpSpec
from keras_autovm.planner.graph import TensorSpec

L = keras.layers

# What each layer's backward pass reads: (its inputs, its outputs).
# - Weight layers multiply the input, so dW needs the input; a fused
#   nonlinear `activation` also needs a tensor the size of the output (TF and
#   torch keep the output; JAX keeps the pre-activation, which is not tagged:
#   the output stands for it). Embedding reads only its integer indices.
# - Normalizations need their input (statistics are small and internal).
# - Pure data movement, sums, averages and masks drawn inside the layer
#   (Dropout's mask is not a tagged output) read nothing.
# - Multiply, Dot, Maximum, Minimum need their inputs (each input's
#   gradient involves the others).
# - Max pooling routes the gradient to the argmax: input and output.
# - Activations: see `_ACTIVATION_READS`.
# Only the classes themselves and subclasses that keep the class's `call`
# are matched; anything else (custom layers, RNNs, attention, raw ops)
# conservatively reads its inputs and outputs.
_INPUTS, _OUTPUTS, _BOTH, _NONE = (True, False), (False, True), (True, True), (False, False)
_WEIGHT_LAYERS = (
    BaseConv, BaseConvTranspose, BaseDepthwiseConv, BaseSeparableConv,
    L.Dense, L.EinsumDense,
)
_BACKWARD_READS = {
    L.Embedding: _INPUTS,
    L.BatchNormalization: _INPUTS,
    L.LayerNormalization: _INPUTS,
    L.GroupNormalization: _INPUTS,
    L.RMSNormalization: _INPUTS,
    L.UnitNormalization: _BOTH,
    L.PReLU: _INPUTS,
    L.LeakyReLU: _INPUTS,
    L.ELU: _INPUTS,
    L.Softmax: _OUTPUTS,
    L.Multiply: _INPUTS,
    L.Dot: _INPUTS,
    L.Maximum: _INPUTS,
    L.Minimum: _INPUTS,
    L.Add: _NONE,
    L.Subtract: _NONE,
    L.Average: _NONE,
    L.Concatenate: _NONE,
    L.Flatten: _NONE,
    L.Reshape: _NONE,
    L.Permute: _NONE,
    L.RepeatVector: _NONE,
    L.UpSampling1D: _NONE,
    L.UpSampling2D: _NONE,
    L.UpSampling3D: _NONE,
    L.ZeroPadding1D: _NONE,
    L.ZeroPadding2D: _NONE,
    L.ZeroPadding3D: _NONE,
    L.Cropping1D: _NONE,
    L.Cropping2D: _NONE,
    L.Cropping3D: _NONE,
    L.Dropout: _NONE,
    L.SpatialDropout1D: _NONE,
    L.SpatialDropout2D: _NONE,
    L.SpatialDropout3D: _NONE,
    L.GaussianDropout: _NONE,
    L.GaussianNoise: _NONE,
    L.AlphaDropout: _NONE,
    L.Identity: _NONE,
    L.Rescaling: _NONE,
}
_ELEMENTWISE_PASSTHROUGH = tuple(k for k, v in _BACKWARD_READS.items() if v == _NONE)

# Which side of an activation its gradient reads. sigmoid, tanh, softmax and
# exp are differentiated from their output on all three backends; relu from
# its input on JAX (`jax.nn.relu`'s jvp) but from its output on TF
# (`ReluGrad(op.outputs[0])`) and torch (`threshold_backward(result)`); the
# other named ones from their input. Unknown callables read both.
_ACTIVATION_READS = {
    "linear": _NONE,
    "sigmoid": _OUTPUTS,
    "tanh": _OUTPUTS,
    "softmax": _OUTPUTS,
    "log_softmax": _OUTPUTS,
    "exponential": _OUTPUTS,
}
_INPUT_ACTIVATIONS = {
    "leaky_relu", "relu6", "elu", "selu", "softplus", "softsign", "silu",
    "swish", "gelu", "celu", "mish", "hard_sigmoid", "hard_silu",
    "hard_swish", "hard_tanh", "log_sigmoid", "squareplus", "sparse_plus",
    "tanh_shrink", "soft_shrink", "hard_shrink",
}

# Optimizer slots per trainable weight when the optimizer is not built yet
# (an estimate: a built optimizer's variables are counted exactly).
_SLOTS = {
    "Adam": 2, "AdamW": 2, "Nadam": 2, "Adamax": 2, "Lamb": 2, "Ftrl": 2,
    "Adadelta": 2, "ScheduleFreeAdamW": 2, "Lion": 1, "Adagrad": 1,
    # Adafactor keeps factored row/column statistics: 1 is an upper bound.
    "Adafactor": 1,
}
_UNKNOWN_SLOTS = 2


def tag_name(layer, index=0, call=0):
    """The tag of one output of one call of a layer.

    Args:
        layer: a Keras layer (or operation) that has been called.
        index: which output, for layers with several. Defaults to `0`.
        call: which call of the layer in the model graph, counted in
            execution order (only shared layers have more than one).
            Defaults to `0`.

    Returns:
        `layer.name` for a single-output layer, `f"{layer.name}:{index}"`
        for a layer with several outputs; later calls of a shared layer are
        prefixed `f"{layer.name}@{call}"` instead of `layer.name`.
    """
    return _tag(op_name(layer, call), index, _num_outputs(layer))


def tag_names(layer, call=0):
    """The tags of all outputs of one call of a layer, in output order.

    Args:
        layer: a Keras layer (or operation) that has been called.
        call: which call of the layer in the model graph. Defaults to `0`.

    Returns:
        A list of strings, see `tag_name`.
    """
    n = _num_outputs(layer)
    return [_tag(op_name(layer, call), i, n) for i in range(n)]


def op_name(layer, call=0):
    """The op name of one call of a layer: `layer.name`, or
    `f"{layer.name}@{call}"` for later calls of a shared layer."""
    return layer.name if call == 0 else f"{layer.name}@{call}"


def layer_outputs_order(model):
    """The layer calls of a built model, in the order Keras runs them.

    Matches `Function._run_through_graph` in Keras 3.15. Input layers are
    left out; raw `keras.ops` calls in a functional graph are included (they
    are `Operation`s, not layers).

    Args:
        model: a built `keras.Sequential` or functional `keras.Model`.

    Returns:
        A list of `(layer, node)` pairs, `node` being the Keras `Node` of
        that call (`node.input_tensors`, `node.outputs`).
    """
    return [(node.operation, node) for node in _execution_nodes(_functional_of(model))]


def build_graph(model, batch_size, optimizer=None, backend=None):
    """Builds the planner's `Graph` for one training step of a model.

    Args:
        model: a built `keras.Sequential` or functional `keras.Model`.
            Subclassed models are not supported (their graph is Python code).
        batch_size: the batch size to size the tensors for.
        optimizer: the optimizer (instance or name) whose state to count.
            Defaults to `model.optimizer`, then to an Adam-sized estimate.
        backend: the Keras backend whose gradients to model (only changes
            whether relu reads its input or its output). Defaults to the
            current `keras.backend.backend()`.

    Returns:
        A `keras_autovm.planner.graph.Graph`.

    Example:

    ```python
    model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3))
    graph = build_graph(model, batch_size=32, optimizer="adam")
    sum(t.nbytes for t in graph.tensors)  # activation bytes per step
    ```
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"`batch_size` must be a positive integer. Received: batch_size={batch_size}"
        )
    backend = backend or keras.backend.backend()
    fn = _functional_of(model)
    ops, tensors = _build(fn, batch_size, backend)
    return Graph(
        ops=tuple(ops),
        tensors=tuple(tensors),
        persistent_bytes=_persistent_bytes(model, fn, batch_size, optimizer),
        batch_size=batch_size,
    )


def backward_reads(layer, backend=None):
    """Whether a layer's backward pass reads its inputs and its outputs.

    Args:
        layer: a Keras layer or operation.
        backend: the Keras backend. Defaults to the current one.

    Returns:
        A pair of booleans `(reads_inputs, reads_outputs)`.
    """
    backend = backend or keras.backend.backend()
    if isinstance(layer, keras.Model):
        return _BOTH
    # Match on the most derived Keras class; a user subclass that rewrites
    # `call` may read anything.
    keras_cls = next(
        (c for c in type(layer).__mro__ if c.__module__.startswith("keras.")), None
    )
    if keras_cls is None or type(layer).call is not getattr(keras_cls, "call", None):
        return _BOTH
    if isinstance(layer, _WEIGHT_LAYERS):
        if _activation_name(getattr(layer, "activation", None)) == "linear":
            return _INPUTS
        return _BOTH
    if isinstance(layer, L.Activation):
        return _activation_reads(layer.activation, backend)
    if isinstance(layer, L.ReLU):
        if layer.negative_slope == 0 and layer.max_value is None and layer.threshold == 0:
            return _activation_reads(keras.activations.relu, backend)
        return _INPUTS
    if isinstance(layer, BasePooling):
        return _BOTH if layer.pool_mode == "max" else _NONE
    if isinstance(layer, (BaseGlobalPooling, BaseAdaptivePooling)):
        return _BOTH if "Max" in keras_cls.__name__ else _NONE
    for cls in keras_cls.__mro__:
        if cls in _BACKWARD_READS:
            return _BACKWARD_READS[cls]
    return _BOTH


def optimizer_state_bytes(optimizer, trainable_variables):
    """Bytes of optimizer state: exact if built, else estimated by type.

    Args:
        optimizer: a Keras optimizer instance, a name, or `None` (counted as
            Adam: two slots per trainable weight).
        trainable_variables: the variables it updates.

    Returns:
        An int.
    """
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if optimizer is not None and getattr(optimizer, "built", False):
        return sum(_variable_bytes(v) for v in _unique(optimizer.variables))
    weight_bytes = sum(_variable_bytes(v) for v in trainable_variables)
    return int(_slots(optimizer) * weight_bytes)


# ---------------------------------------------------------------- internals


def check_model(model):
    """Raises a ValueError saying why `model`'s graph cannot be read, if so."""
    _functional_of(model)


def _functional_of(model):
    """The `Functional` that runs a model, or a ValueError saying why not."""
    if not isinstance(model, keras.Model):
        raise ValueError(
            "keras_autovm expects a keras.Model (Sequential or functional). "
            f"Received: {model!r} of type {type(model).__name__}"
        )
    if isinstance(model, keras.Sequential):
        if getattr(model, "_functional", None) is None:
            raise ValueError(
                f"Sequential model '{model.name}' is not built with a known "
                "input shape, so its layer graph is unknown. Start it with "
                "`keras.Input(shape=...)`, call `model.build(input_shape)`, "
                "or call it on a batch of data first."
            )
        return model._functional
    if isinstance(model, Functional):
        return model
    raise ValueError(
        f"Model '{model.name}' of class {type(model).__name__} is a subclassed "
        "model: its graph is Python code in `call()`, which keras_autovm cannot "
        "read, so it is not supported. Build it with the functional API "
        "(`keras.Model(inputs, outputs)`) or as a `keras.Sequential`."
    )


def _execution_nodes(fn):
    """Nodes in the order of `Function._run_through_graph` (Keras 3.15)."""
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


def _build(fn, batch_size, backend):
    """Ops and tensors of one functional graph (recursing into nested ones)."""
    nodes = _execution_nodes(fn)
    num_calls = {}
    for node in nodes:
        num_calls[id(node.operation)] = num_calls.get(id(node.operation), 0) + 1

    # Tensor id -> (tag name or None for untagged model inputs, nbytes).
    known = {}
    for x in fn.inputs:
        producer = x._keras_history[0]
        known[id(x)] = (None, _nbytes(x, batch_size, producer.name if producer else x.name))

    ops, tensors, calls_seen = [], {}, {}
    for node in nodes:
        layer = node.operation
        call = calls_seen.get(id(layer), 0)
        calls_seen[id(layer)] = call + 1
        name = op_name(layer, call)
        outputs = node.outputs
        # A model built with AutoVMWrapper: classify by the layer inside.
        inner = layer.layer if isinstance(layer, AutoVMWrapper) else layer
        out_names = [_tag(name, i, len(outputs)) for i in range(len(outputs))]

        can_swap, can_recompute, notes, op_notes = True, True, [], []
        if not isinstance(layer, L.Layer):
            can_swap = can_recompute = False
            notes.append("keras op, not a layer: cannot be wrapped, kept")
            op_notes.append("keras op, not a layer")
        if num_calls[id(layer)] > 1:
            can_swap = can_recompute = False
            notes.append(f"shared layer called {num_calls[id(layer)]} times: kept")
            op_notes.append("shared layer")
        if len(outputs) > 1:
            can_swap = can_recompute = False
            notes.append(f"{len(outputs)} outputs: kept")
            op_notes.append("multiple outputs")
        nested = None
        if isinstance(inner, keras.Model):
            can_recompute = False
            notes.append("nested model: managed as one op, not recomputed")
            nested = _nested(inner, batch_size, backend)
            op_notes.append(nested[2])
        elif _is_random(inner):
            can_recompute = False
            notes.append("random layer: recompute would draw a new mask")

        input_names = []
        for x in node.input_tensors:
            tag = known[id(x)][0]
            if tag is not None and tag not in input_names:
                input_names.append(tag)
                tensors[tag]["fwd_readers"].append(name)
        for x, tag in zip(outputs, out_names):
            nbytes = _nbytes(x, batch_size, layer.name)
            known[id(x)] = (tag, nbytes)
            tensors[tag] = dict(
                name=tag, nbytes=nbytes, producer=name, fwd_readers=[],
                bwd_readers=[], can_swap=can_swap,
                can_recompute=can_recompute, note="; ".join(notes),
            )

        reads_inputs, reads_outputs = backward_reads(inner, backend)
        if reads_inputs:
            for tag in input_names:
                tensors[tag]["bwd_readers"].append(name)
        if reads_outputs:
            for tag in out_names:
                tensors[tag]["bwd_readers"].append(name)

        in_bytes = sum(known[id(x)][1] for x in node.input_tensors)
        out_bytes = sum(known[id(x)][1] for x in outputs)
        if nested is not None:
            flops, mem_bytes, _, internal_bytes = nested
            internal = f"{name}:internal"
            tensors[internal] = dict(
                name=internal, nbytes=internal_bytes, producer=name,
                fwd_readers=[], bwd_readers=[name], can_swap=False,
                can_recompute=False,
                note="nested model's own activations: kept",
            )
        else:
            flops = _flops(inner, node, batch_size)
            mem_bytes = in_bytes + out_bytes + _layer_weight_bytes(inner)
        ops.append(
            OpSpec(
                name=name, inputs=tuple(input_names), outputs=tuple(out_names),
                flops=float(flops), mem_bytes=float(mem_bytes),
                kind=type(inner).__name__, note="; ".join(op_notes),
            )
        )
    return ops, [TensorSpec(**_freeze(t)) for t in tensors.values()]


def _nested(model, batch_size, backend):
    """(flops, mem_bytes, note, internal activation bytes) of a nested model."""
    inner_ops, inner_tensors = _build(_functional_of(model), batch_size, backend)
    inner_outputs = {id(x) for x in _functional_of(model).outputs}
    output_tags = set()
    for layer, node in layer_outputs_order(model):
        for i, x in enumerate(node.outputs):
            if id(x) in inner_outputs:
                output_tags.add(_tag(layer.name, i, len(node.outputs)))
    # What the sub-model's own backward will read stays from its forward to
    # its backward; its outputs are the outer op's tagged outputs.
    internal = sum(
        t.nbytes for t in inner_tensors if t.bwd_readers and t.name not in output_tags
    )
    flops = sum(op.flops for op in inner_ops)
    mem_bytes = sum(op.mem_bytes for op in inner_ops)
    note = (
        f"nested model of {len(inner_ops)} ops managed as one; its "
        f"{internal} bytes of activations are kept"
    )
    return flops, mem_bytes, note, internal


def _freeze(t):
    return dict(
        t,
        fwd_readers=tuple(dict.fromkeys(t["fwd_readers"])),
        bwd_readers=tuple(dict.fromkeys(t["bwd_readers"])),
    )


def _tag(prefix, index, num_outputs):
    return prefix if num_outputs == 1 else f"{prefix}:{index}"


def _num_outputs(layer):
    nodes = getattr(layer, "_inbound_nodes", None)
    if not nodes:
        raise ValueError(
            f"Layer '{layer.name}' has never been called, so its outputs are unknown."
        )
    return len(nodes[0].outputs)


def _is_random(layer):
    """Whether a layer draws random numbers (owns a SeedGenerator)."""
    layers = layer._flatten_layers() if hasattr(layer, "_flatten_layers") else [layer]
    return any(getattr(sub, "_seed_generators", None) for sub in layers)


def _activation_name(fn):
    if fn is None:
        return "linear"
    return getattr(fn, "__name__", None) or type(fn).__name__


def _activation_reads(fn, backend):
    name = _activation_name(fn)
    if name == "relu":
        return _INPUTS if backend == "jax" else _OUTPUTS
    if name in _ACTIVATION_READS:
        return _ACTIVATION_READS[name]
    if name in _INPUT_ACTIVATIONS:
        return _INPUTS
    return _BOTH


def _dtype_bytes(dtype, who):
    dtype = keras.backend.standardize_dtype(dtype)
    if dtype == "bool":
        return 1
    match = re.search(r"(\d+)", dtype)
    if not match:
        raise ValueError(f"Layer '{who}' has an output of unsupported dtype {dtype}")
    return max(1, int(match.group(1)) // 8)


def _shape(x, batch_size, who):
    """The shape of a symbolic tensor with its batch dimension filled in."""
    shape = tuple(x.shape)
    if any(d is None for d in shape[1:]):
        raise ValueError(
            f"Layer '{who}' has output shape {shape}: only the batch "
            "dimension may be unknown. keras_autovm needs concrete sizes; "
            "build the model with a concrete input shape, e.g. "
            "`keras.Input(shape=(224, 224, 3))`."
        )
    return (batch_size,) + shape[1:] if shape else ()


def _nbytes(x, batch_size, who):
    return math.prod(_shape(x, batch_size, who)) * _dtype_bytes(x.dtype, who)


def _numel(x, batch_size, who):
    return math.prod(_shape(x, batch_size, who))


def _variable_bytes(v):
    return math.prod(v.shape) * _dtype_bytes(v.dtype, getattr(v, "path", v.name))


def _unique(variables):
    return list({id(v): v for v in variables}.values())


def _layer_weight_bytes(layer):
    return sum(_variable_bytes(v) for v in _unique(getattr(layer, "weights", [])))


def _channels(x, data_format):
    return x.shape[1] if data_format == "channels_first" else x.shape[-1]


def _flops(layer, node, batch_size):
    """Forward flops of one call; 0 for ops that only move memory."""
    x = node.input_tensors[0] if node.input_tensors else None
    out = node.outputs[0]
    out_elems = _numel(out, batch_size, layer.name)
    if isinstance(layer, BaseSeparableConv):
        cin = _channels(x, layer.data_format)
        mult = layer.depth_multiplier
        window = math.prod(layer.kernel_size)
        mid_elems = out_elems // layer.filters * cin * mult
        return 2 * mid_elems * window + 2 * out_elems * cin * mult
    if isinstance(layer, BaseDepthwiseConv):
        return 2 * out_elems * math.prod(layer.kernel_size)
    if isinstance(layer, BaseConvTranspose):
        in_elems = _numel(x, batch_size, layer.name)
        return 2 * in_elems * math.prod(layer.kernel_size) * layer.filters
    if isinstance(layer, BaseConv):
        cin = _channels(x, layer.data_format)
        return 2 * out_elems * math.prod(layer.kernel_size) * cin // layer.groups
    if isinstance(layer, L.Dense):
        return 2 * out_elems * x.shape[-1]
    if isinstance(layer, L.EinsumDense):
        flops = _einsum_dense_flops(layer, out_elems)
        if flops is not None:
            return flops
    if isinstance(layer, L.Embedding) or isinstance(layer, _ELEMENTWISE_PASSTHROUGH):
        return 0
    if isinstance(layer, (BasePooling, BaseGlobalPooling, L.Activation, L.ReLU)):
        return 0
    params = sum(math.prod(v.shape) for v in getattr(layer, "trainable_weights", []))
    if not params:
        return 0
    # Unknown layer with weights: count it as a Dense applied at every
    # position of its first output (exact for Dense-like and sequence
    # layers that return sequences; an estimate otherwise).
    positions = out_elems // (out.shape[-1] or 1) if out.shape else batch_size
    return 2 * params * positions


def _einsum_dense_flops(layer, out_elems):
    try:
        inputs, output = layer.equation.split("->")
        _, kernel_spec = inputs.split(",")
        kernel_shape = tuple(layer.kernel.shape)
        contracted = [
            kernel_shape[i] for i, c in enumerate(kernel_spec) if c not in output
        ]
        return 2 * out_elems * math.prod(contracted)
    except Exception:
        return None


def _slots(optimizer):
    if optimizer is None:
        return _SLOTS["Adam"]
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        return _slots(inner)
    name = type(optimizer).__name__
    if name == "SGD":
        slots = 1 if optimizer.momentum else 0
    elif name == "RMSprop":
        slots = 1 + (optimizer.momentum > 0) + bool(optimizer.centered)
    else:
        slots = _SLOTS.get(name, _UNKNOWN_SLOTS)
        if name == "Adam" and getattr(optimizer, "amsgrad", False):
            slots += 1
    slots += bool(getattr(optimizer, "use_ema", False))
    slots += bool(getattr(optimizer, "gradient_accumulation_steps", None))
    return slots


def _persistent_bytes(model, fn, batch_size, optimizer):
    """Weights, their gradients, optimizer state, inputs and targets."""
    weights = _unique(model.weights)
    trainable = _unique(model.trainable_weights)
    total = sum(_variable_bytes(v) for v in weights)
    total += sum(_variable_bytes(v) for v in trainable)
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
    total += optimizer_state_bytes(optimizer, trainable)
    for x in fn.inputs:
        producer = x._keras_history[0]
        total += _nbytes(x, batch_size, producer.name if producer else x.name)
    # Targets are not known before fit: count them as the size of the
    # predictions (an over-estimate for sparse integer labels).
    for x in fn.outputs:
        total += _nbytes(x, batch_size, x._keras_history[0].name)
    return int(total)
