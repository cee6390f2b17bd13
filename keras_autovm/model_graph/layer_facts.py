"""Per-layer facts the planner needs: what a layer's backward pass reads,
its forward FLOPs, and byte sizes of tensors, weights and optimizer state.

Facts about one layer (or one call of it) only; walking the model and
naming its tensors is `walk.py`'s job.
"""

import math
import re

import keras

from keras_autovm import internals

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
_CONVS = (L.Conv1D, L.Conv2D, L.Conv3D)
_CONV_TRANSPOSES = (L.Conv1DTranspose, L.Conv2DTranspose, L.Conv3DTranspose)
_DEPTHWISE_CONVS = (L.DepthwiseConv1D, L.DepthwiseConv2D)
_SEPARABLE_CONVS = (L.SeparableConv1D, L.SeparableConv2D)
_WEIGHT_LAYERS = (_CONVS + _CONV_TRANSPOSES + _DEPTHWISE_CONVS + _SEPARABLE_CONVS
                  + (L.Dense, L.EinsumDense))
_MAX_POOLS = (L.MaxPooling1D, L.MaxPooling2D, L.MaxPooling3D,
              L.GlobalMaxPooling1D, L.GlobalMaxPooling2D, L.GlobalMaxPooling3D,
              L.AdaptiveMaxPooling1D, L.AdaptiveMaxPooling2D, L.AdaptiveMaxPooling3D)
_MEAN_POOLS = (L.AveragePooling1D, L.AveragePooling2D, L.AveragePooling3D,
               L.GlobalAveragePooling1D, L.GlobalAveragePooling2D,
               L.GlobalAveragePooling3D, L.AdaptiveAveragePooling1D,
               L.AdaptiveAveragePooling2D, L.AdaptiveAveragePooling3D)
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

# Optimizer slots per trainable weight. Counted the same way whether or not
# the optimizer is built: a budget stated before training (before `fit`
# builds the optimizer) must still be met during it. Exact for the per-weight
# slots of Keras's optimizers; their few scalars (iterations, learning rate)
# are left out.
_SLOTS = {
    "Adam": 2, "AdamW": 2, "Nadam": 2, "Adamax": 2, "Lamb": 2, "Ftrl": 2,
    "Adadelta": 2, "ScheduleFreeAdamW": 2, "Lion": 1, "Adagrad": 1,
    # Adafactor keeps factored row/column statistics: 1 is an upper bound.
    "Adafactor": 1,
}
_UNKNOWN_SLOTS = 2


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
    if isinstance(layer, _MAX_POOLS):
        return _BOTH
    if isinstance(layer, _MEAN_POOLS):
        return _NONE
    for cls in keras_cls.__mro__:
        if cls in _BACKWARD_READS:
            return _BACKWARD_READS[cls]
    return _BOTH


def optimizer_state_bytes(optimizer, trainable_variables):
    """Bytes of optimizer state, estimated by the optimizer's type.

    The same figure before and after the optimizer is built, so that a plan
    made before training holds during it.

    Args:
        optimizer: a Keras optimizer instance, a name, or `None` (counted as
            Adam: two slots per trainable weight).
        trainable_variables: the variables it updates.

    Returns:
        An int.
    """
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    weights = sum(variable_bytes(v) for v in trainable_variables)
    return int(_slots(optimizer) * weights)


def is_random(layer):
    """Whether a layer draws random numbers (a rerun would draw anew)."""
    return internals.draws_random_numbers(layer)


def nbytes(x, batch_size, who):
    """Bytes of a symbolic tensor at `batch_size`; `who` names it in errors."""
    return math.prod(_shape(x, batch_size, who)) * _dtype_bytes(x.dtype, who)


def variable_bytes(v):
    """Bytes of one variable."""
    return math.prod(v.shape) * _dtype_bytes(v.dtype, getattr(v, "path", v.name))


def unique(variables):
    """Variables without repeats (shared weights are listed once)."""
    return list({id(v): v for v in variables}.values())


def weight_bytes(layer):
    """Bytes of a layer's weights."""
    return sum(variable_bytes(v) for v in unique(getattr(layer, "weights", [])))


def flops(layer, node, batch_size):
    """Forward flops of one call; 0 for ops that only move memory."""
    x = node.input_tensors[0] if node.input_tensors else None
    out = node.outputs[0]
    out_elems = _numel(out, batch_size, layer.name)
    if isinstance(layer, _SEPARABLE_CONVS):
        cin = _channels(x, layer.data_format)
        mult = layer.depth_multiplier
        window = math.prod(layer.kernel_size)
        mid_elems = out_elems // layer.filters * cin * mult
        return 2 * mid_elems * window + 2 * out_elems * cin * mult
    if isinstance(layer, _DEPTHWISE_CONVS):
        return 2 * out_elems * math.prod(layer.kernel_size)
    if isinstance(layer, _CONV_TRANSPOSES):
        in_elems = _numel(x, batch_size, layer.name)
        return 2 * in_elems * math.prod(layer.kernel_size) * layer.filters
    if isinstance(layer, _CONVS):
        cin = _channels(x, layer.data_format)
        return 2 * out_elems * math.prod(layer.kernel_size) * cin // layer.groups
    if isinstance(layer, L.Dense):
        return 2 * out_elems * x.shape[-1]
    if isinstance(layer, L.EinsumDense):
        count = _einsum_dense_flops(layer, out_elems)
        if count is not None:
            return count
    if isinstance(layer, L.Embedding) or isinstance(layer, _ELEMENTWISE_PASSTHROUGH):
        return 0
    if isinstance(layer, _MAX_POOLS + _MEAN_POOLS + (L.Activation, L.ReLU)):
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
            f"Layer '{who}' has output shape {shape}: a dimension besides "
            "the batch is unknown, so its activations cannot be sized. If "
            "it follows from the input shape, pass that to "
            "`keras_autovm.plan(..., input_shape=...)` (`AutoVM` reads it "
            "from the batches `fit` gives); if the layer decides it, give "
            "the layer a `compute_output_shape`."
        )
    return (batch_size,) + shape[1:] if shape else ()


def _numel(x, batch_size, who):
    return math.prod(_shape(x, batch_size, who))


def _channels(x, data_format):
    return x.shape[1] if data_format == "channels_first" else x.shape[-1]


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

