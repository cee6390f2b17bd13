"""Walks a built Keras 3 model into the planner's `Graph`.

One op per layer call, in the order Keras runs them
(`internals.execution_nodes`), and one tagged tensor per layer output, with
its size at a given batch size, the ops that read it in the forward pass and
the ops whose backward pass reads it (`layer_facts.backward_reads`).

Names: an op is named after its layer; a tensor is named `layer.name` (one
output) or `f"{layer.name}:{i}"` (the i-th of several). A shared layer's
later calls get `f"{layer.name}@{k}"` as op name and name prefix. Use
`tag_names` so that the wrappers and the plan agree.

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

import keras

from keras_autovm import internals
from keras_autovm.model_graph import layer_facts as facts
from keras_autovm.model_graph import shapes
from keras_autovm.planner.graph import Graph
from keras_autovm.planner.graph import OpSpec
from keras_autovm.planner.graph import TensorSpec
from keras_autovm.planner.plan import format_bytes
from keras_autovm.wrapper import AutoVMWrapper


def tag_names(layer, call=0):
    """The tags of all outputs of one call of a layer, in output order.

    Args:
        layer: a Keras layer (or operation) that has been called.
        call: which call of the layer in the model graph, counted in
            execution order (only shared layers have more than one).
            Defaults to `0`.

    Returns:
        A list of strings: `layer.name` for a single-output layer,
        `f"{layer.name}:{i}"` for a layer with several outputs; later calls
        of a shared layer are prefixed `f"{layer.name}@{call}"` instead.
    """
    n = internals.num_outputs(layer)
    if n is None:
        raise ValueError(
            f"Layer '{layer.name}' has never been called, so its outputs are unknown.")
    return [_tag(op_name(layer, call), i, n) for i in range(n)]


def op_name(layer, call=0):
    """The op name of one call of a layer: `layer.name`, or
    `f"{layer.name}@{call}"` for later calls of a shared layer."""
    return layer.name if call == 0 else f"{layer.name}@{call}"


def call_names(model):
    """(op name, output tags) of each layer call of a built model, in run
    order: the names the planner's graph and the wrappers use."""
    seen, names = {}, []
    for layer, node in layer_calls(model):
        call = seen.get(id(layer), 0)
        seen[id(layer)] = call + 1
        name = op_name(layer, call)
        n = len(node.outputs)
        names.append((name, [_tag(name, i, n) for i in range(n)]))
    return names


def layer_calls(model):
    """The layer calls of a built model, in the order Keras runs them.

    Input layers are left out; raw `keras.ops` calls in a functional graph
    are included (they are `Operation`s, not layers).

    Args:
        model: a built `keras.Sequential` or functional `keras.Model`.

    Returns:
        A list of `(layer, node)` pairs, `node` being the Keras `Node` of
        that call (`node.input_tensors`, `node.outputs`).
    """
    return [(node.operation, node)
            for node in internals.execution_nodes(functional_of(model))]


def build_graph(model, batch_size, optimizer=None, backend=None, input_shapes=None):
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
        input_shapes: the shapes of the model's inputs without the batch
            dimension, needed where they have unknown dimensions (a text
            model's sequence length): one tuple for a single input, else a
            list (in `model.inputs` order) or a dict by input name. `None`
            takes them from the model. Defaults to `None`.

    Returns:
        A `keras_autovm.planner.Graph`.

    Example:

    ```python
    from keras_autovm.model_graph import build_graph

    model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3))
    graph = build_graph(model, batch_size=32, optimizer="adam")
    sum(t.nbytes for t in graph.tensors)  # activation bytes per step
    ```
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"`batch_size` must be a positive integer. Received: batch_size={batch_size}")
    backend = backend or keras.backend.backend()
    fn = functional_of(model)
    specs = shapes.specs(fn, batch_size, input_shapes)
    ops, tensors, outputs = _walk(fn, batch_size, backend, specs)
    return Graph(ops=tuple(ops), tensors=tuple(tensors),
                 persistent_bytes=_persistent_bytes(model, fn, batch_size, optimizer,
                                                    specs),
                 batch_size=batch_size, outputs=outputs)


def functional_of(model):
    """The functional graph that runs a model, or a ValueError saying why not."""
    if not isinstance(model, keras.Model):
        raise ValueError(
            "keras_autovm expects a keras.Model (Sequential or functional). "
            f"Received: {model!r} of type {type(model).__name__}")
    fn = internals.functional_of(model)
    if fn is not None:
        return fn
    if isinstance(model, keras.Sequential):
        raise ValueError(
            f"Sequential model '{model.name}' is not built with a known "
            "input shape, so its layer graph is unknown. Start it with "
            "`keras.Input(shape=...)`, call `model.build(input_shape)`, "
            "or call it on a batch of data first.")
    raise ValueError(
        f"Model '{model.name}' of class {type(model).__name__} is a subclassed "
        "model: its graph is Python code in `call()`, which keras_autovm cannot "
        "read, so it is not supported. Build it with the functional API "
        "(`keras.Model(inputs, outputs)`) or as a `keras.Sequential`.")


def _walk(fn, batch_size, backend, specs=None):
    """Ops and tensors of one functional graph (recursing into nested ones).

    `specs` maps `id()` of the graph's symbolic tensors to concrete ones, or
    is `None` when the graph's own shapes are concrete."""
    specs = specs or {}
    nodes = internals.execution_nodes(fn)
    calls = {}
    for node in nodes:
        calls[id(node.operation)] = calls.get(id(node.operation), 0) + 1
    # Tensor id -> (tag, or None for model inputs, nbytes).
    known = {id(x): (None, _input_bytes(specs.get(id(x), x), batch_size))
             for x in fn.inputs}
    ops, tensors, seen = [], {}, {}
    for node in nodes:
        layer = node.operation
        call = seen.get(id(layer), 0)
        seen[id(layer)] = call + 1
        ops.append(_add_call(node, op_name(layer, call), calls[id(layer)],
                             known, tensors, batch_size, backend, specs))
    outputs = tuple(known[id(x)][0] for x in fn.outputs if known[id(x)][0])
    for tag in outputs:
        # The loss reads a model output right after the forward pass.
        if tensors[tag]["can_swap"]:
            tensors[tag]["can_swap"] = False
            tensors[tag]["note"] = "; ".join(
                n for n in (tensors[tag]["note"], "model output: kept for the loss") if n)
    return ops, [TensorSpec(**_freeze(t)) for t in tensors.values()], outputs


def _add_call(node, name, num_calls, known, tensors, batch_size, backend, specs):
    """Records one layer call's tensors in `known`/`tensors`; returns its op."""
    layer = node.operation
    # A model built with AutoVMWrapper: classify by the layer inside.
    inner = layer.layer if isinstance(layer, AutoVMWrapper) else layer
    outputs = node.outputs
    out_names = [_tag(name, i, len(outputs)) for i in range(len(outputs))]
    concrete = _Call(node, specs)
    rules = _rules(layer, inner, num_calls, len(outputs), batch_size, backend,
                   concrete.input_tensors if specs else None)
    input_names = []
    for x in node.input_tensors:
        tag = known[id(x)][0]
        if tag is not None and tag not in input_names:
            input_names.append(tag)
            tensors[tag]["fwd_readers"].append(name)
    for x, tag in zip(outputs, out_names):
        known[id(x)] = (tag, facts.nbytes(specs.get(id(x), x), batch_size, layer.name))
        tensors[tag] = dict(name=tag, nbytes=known[id(x)][1], producer=name,
                            fwd_readers=[], bwd_readers=[], note=rules["note"],
                            can_swap=rules["swap"], can_recompute=rules["recompute"])
    reads_inputs, reads_outputs = facts.backward_reads(inner, backend)
    for tag in (input_names if reads_inputs else []) + (out_names if reads_outputs else []):
        tensors[tag]["bwd_readers"].append(name)
    if rules["nested"] is not None:
        flops, mem_bytes, _, internal_bytes = rules["nested"]
        internal = f"{name}:internal"
        tensors[internal] = dict(
            name=internal, nbytes=internal_bytes, producer=name, fwd_readers=[],
            bwd_readers=[name], can_swap=False, can_recompute=False, internal=True,
            note="nested model's own activations: kept")
    else:
        flops = facts.flops(inner, concrete, batch_size)
        mem_bytes = (sum(known[id(x)][1] for x in node.input_tensors + outputs)
                     + facts.weight_bytes(inner))
    args = node.arguments.args
    unary = (len(node.input_tensors) == 1 and len(args) == 1
             and args[0] is node.input_tensors[0])
    return OpSpec(name=name, inputs=tuple(input_names), outputs=tuple(out_names),
                  flops=float(flops), mem_bytes=float(mem_bytes),
                  kind=type(inner).__name__, note="; ".join(rules["op_notes"]),
                  unary=unary)


def _rules(layer, inner, num_calls, num_outputs, batch_size, backend, inputs=None):
    """Which actions a call's outputs allow, and the notes saying why not."""
    rules = {"swap": True, "recompute": True, "nested": None}
    notes, op_notes = [], []
    if not isinstance(layer, keras.layers.Layer):
        rules["swap"] = rules["recompute"] = False
        notes.append("keras op, not a layer: cannot be wrapped, kept")
        op_notes.append("keras op, not a layer")
    if num_calls > 1:
        rules["swap"] = rules["recompute"] = False
        notes.append(f"shared layer called {num_calls} times: kept")
        op_notes.append(f"shared layer called {num_calls} times, its outputs kept")
    if num_outputs > 1:
        rules["swap"] = rules["recompute"] = False
        notes.append(f"{num_outputs} outputs: kept")
        op_notes.append(f"{num_outputs} outputs, kept")
    if isinstance(inner, keras.Model):
        rules["recompute"] = False
        notes.append("nested model: managed as one op, not recomputed")
        rules["nested"] = _nested(inner, batch_size, backend, inputs)
        op_notes.append(rules["nested"][2])
    elif facts.is_random(inner):
        rules["recompute"] = False
        notes.append("random layer: recompute would draw a new mask")
    rules["note"], rules["op_notes"] = "; ".join(notes), op_notes
    return rules


def _nested(model, batch_size, backend, inputs=None):
    """(flops, mem_bytes, note, internal activation bytes) of a nested model;
    `inputs`: the concrete specs of its inputs, or `None` (its own serve)."""
    fn = functional_of(model)
    specs = internals.output_specs(fn, inputs) if inputs else None
    inner_ops, inner_tensors, _ = _walk(fn, batch_size, backend, specs)
    inner_outputs = {id(x) for x in fn.outputs}
    output_tags = set()
    for layer, node in layer_calls(model):
        for i, x in enumerate(node.outputs):
            if id(x) in inner_outputs:
                output_tags.add(_tag(layer.name, i, len(node.outputs)))
    # What the sub-model's own backward will read stays from its forward to
    # its backward; its outputs are the outer op's tagged outputs.
    internal = sum(t.nbytes for t in inner_tensors
                   if t.bwd_readers and t.name not in output_tags)
    note = (f"nested model of {len(inner_ops)} ops managed as one, not "
            f"recomputed; its {format_bytes(internal)} of activations are kept")
    return (sum(op.flops for op in inner_ops), sum(op.mem_bytes for op in inner_ops),
            note, internal)


def _freeze(t):
    return dict(t, fwd_readers=tuple(dict.fromkeys(t["fwd_readers"])),
                bwd_readers=tuple(dict.fromkeys(t["bwd_readers"])))


def _tag(prefix, index, num_outputs):
    return prefix if num_outputs == 1 else f"{prefix}:{index}"


class _Call:
    """A layer call's input and output tensors, concrete where `specs` has
    them (for FLOP counts)."""

    def __init__(self, node, specs):
        self.operation = node.operation
        self.input_tensors = [specs.get(id(x), x) for x in node.input_tensors]
        self.outputs = [specs.get(id(x), x) for x in node.outputs]


def _input_bytes(x, batch_size):
    source = internals.producer(x)
    return facts.nbytes(x, batch_size, source.name if source else x.name)


def _persistent_bytes(model, fn, batch_size, optimizer, specs=None):
    """Weights, their gradients, optimizer state, inputs and targets."""
    trainable = facts.unique(model.trainable_weights)
    total = sum(facts.variable_bytes(v) for v in facts.unique(model.weights))
    total += sum(facts.variable_bytes(v) for v in trainable)
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
    total += facts.optimizer_state_bytes(optimizer, trainable)
    specs = specs or {}
    total += sum(_input_bytes(specs.get(id(x), x), batch_size) for x in fn.inputs)
    # Targets are not known before fit: count them as the size of the
    # predictions (an over-estimate for sparse integer labels).
    total += sum(_input_bytes(specs.get(id(x), x), batch_size) for x in fn.outputs)
    return int(total)
