"""What autograd saves for each layer call on torch, measured.

Keras's torch layers do not save for the backward pass exactly the layer's
inputs and outputs that the planner's table assumes: a channels-last
convolution or max pooling saves a copy of its input instead of the input
(unless it runs on a view, `keras_autovm/internals.py`'s
`torch_inputs_on_views`, as the mechanism has it measured), batch
normalization saves intermediates of its own. `measure(model)` runs the
forward pass twice at small batch sizes (under `keras.StatelessScope`, so
no layer state changes) with saved-tensor hooks, and records for each layer
call which of its input and output tensors autograd saved and how many
bytes of other tensors it saved. On a GPU the runs also go backward, and
each call's transient memory is measured: the most allocated, within its
forward or its backward, above what was allocated before and after it (the
temporaries Keras's torch layers make: layout copies, normalization
intermediates, the convolution workspace). `adjust(graph, profile)` then
makes a planner graph say what was measured: backward readers from what was
saved, one tensor `f"{op}:saved"` per call for the rest, and the transient
memory as the op's workspace, each sized `fixed + per_sample * batch_size`
from the two runs.
"""

import dataclasses

import keras
import torch

from keras_autovm import internals
from keras_autovm.model_graph import call_names
from keras_autovm.planner import Graph
from keras_autovm.planner import TensorSpec
from keras_autovm.mechanisms.torch.swap import weight_key

# The batch sizes of the two measuring runs.
SIZES = (2, 4)


@dataclasses.dataclass(frozen=True)
class Saved:
    """What one layer call saves for its backward pass."""

    tags: frozenset  # Its input and output tags autograd saved.
    internal: tuple  # Bytes of other saved tensors: (fixed, per sample).
    workspace: tuple = (0.0, 0.0)  # Transient bytes: (fixed, per sample).

    def internal_bytes(self, batch_size):
        return _at(self.internal, batch_size)

    def workspace_bytes(self, batch_size):
        return _at(self.workspace, batch_size)


def _at(line, batch_size):
    return max(0, int(round(line[0] + line[1] * batch_size)))


def _line(b0, y0, b1, y1):
    slope = (y1 - y0) / (b1 - b0)
    return (y0 - slope * b0, slope)


def measure(model, input_shapes=None):
    """Maps op name to `Saved` for every layer call of `model`, run on
    inputs of `input_shapes` (one tuple per input, without the batch) or
    of the model's own shapes."""
    # Layers that draw from torch's global generator (unseeded dropout) must
    # draw in training what they would have drawn without the profile.
    devices = list(range(torch.cuda.device_count()))
    with torch.random.fork_rng(devices=devices):
        (b0, first), (b1, second) = zip(SIZES, [_run(model, size, input_shapes)
                                                  for size in SIZES])
    profile = {}
    for name, (tags, nbytes, transient) in first.items():
        tags2, nbytes2, transient2 = second[name]
        profile[name] = Saved(frozenset(tags | tags2), _line(b0, nbytes, b1, nbytes2),
                              _line(b0, transient, b1, transient2))
    return profile


def adjust(graph, profile):
    """`graph` with backward readers and internal tensors as measured."""
    tensors = {t.name: t for t in graph.tensors}
    readers = {name: list(t.bwd_readers) for name, t in tensors.items()}
    extra = []
    ops = tuple(dataclasses.replace(op, workspace_bytes=profile[op.name].workspace_bytes(
        graph.batch_size)) if op.name in profile else op for op in graph.ops)
    for op in graph.ops:
        saved = profile.get(op.name)
        if saved is None:
            continue
        for tag in op.inputs + op.outputs:
            if tag in saved.tags and op.name not in readers[tag]:
                readers[tag].append(op.name)
            elif tag not in saved.tags and op.name in readers[tag]:
                readers[tag].remove(op.name)
        nbytes = saved.internal_bytes(graph.batch_size)
        if nbytes:
            extra.append(TensorSpec(
                f"{op.name}:saved", nbytes, op.name, (), (op.name,),
                can_swap=True, internal=True,
                can_recompute=all(tensors[t].can_recompute for t in op.outputs),
                note="saved inside the layer for its backward (measured)"))
    return Graph(ops=ops, persistent_bytes=graph.persistent_bytes,
                 batch_size=graph.batch_size, outputs=graph.outputs,
                 tensors=tuple(dataclasses.replace(t, bwd_readers=tuple(readers[t.name]))
                               for t in graph.tensors) + tuple(extra))


def _run(model, batch_size, input_shapes):
    """{op name: (saved input/output tags, bytes of other saved tensors,
    transient bytes)}."""
    calls = call_names(model)
    fn = internals.functional_of(model)
    shapes = input_shapes or [tuple(x.shape[1:]) for x in fn.inputs]
    inputs = [keras.ops.zeros((batch_size,) + tuple(shape), x.dtype)
              for x, shape in zip(fn.inputs, shapes)]
    # Storage -> tag; None for model inputs and variables (views of them too).
    owner = {_key(x): None for x in inputs}
    owner.update({weight_key(v): None for v in model.variables})
    packed, found = [], {}
    memory = _Transients()

    def pack(tensor):
        packed.append(tensor)  # Held: no storage is reused meanwhile.
        # Without a backward pass, not the tensor: a node saving its own
        # output would then hold itself, a cycle nothing breaks (a leak).
        return tensor if memory.on else None

    def around(operation, run, args, kwargs):
        del packed[:len(packed)]
        memory.begin()
        outputs = run()
        name, tags = calls.pop(0)
        memory.forward_done(name, outputs)
        flat = [x for x in keras.tree.flatten(outputs) if isinstance(x, torch.Tensor)]
        owner.update({_key(x): tag for x, tag in zip(flat, tags)})
        saved, other = set(), {}
        for tensor in packed:
            key = _key(tensor)
            if key in owner:
                saved.add(owner[key])
            else:
                other[key] = tensor.untyped_storage().nbytes()
        found[name] = (saved - {None}, sum(other.values()))
        return outputs

    state = [(v, v.value) for v in model.non_trainable_variables]
    # fork_rng: a layer drawing from torch's global generator (dropout
    # without a seed) must not shift the numbers training draws afterwards.
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices), \
            keras.StatelessScope(state_mapping=state), torch.enable_grad():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            outputs = internals.run_calls(model, inputs, around)
        packed.clear()
        memory.backward(outputs, model)
    return {name: value + (memory.peak.get(name, 0),) for name, value in found.items()}


class _Transients:
    """Per layer call, the most memory allocated above its two ends, in the
    forward pass and in the backward pass (CUDA only: zeros elsewhere)."""

    def __init__(self):
        self.on = torch.cuda.is_available()
        self.peak = {}
        self.current = None

    def begin(self):
        if self.on:
            self.start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def forward_done(self, name, outputs):
        if not self.on:
            return
        self._close(name)
        grad = next((x for x in keras.tree.flatten(outputs)
                     if isinstance(x, torch.Tensor) and x.requires_grad), None)
        if grad is not None:  # Fires when this call's backward starts.
            grad.register_hook(lambda g, name=name: self._switch(name))

    def _close(self, name):
        top = torch.cuda.max_memory_allocated()
        ends = max(self.start, torch.cuda.memory_allocated())
        self.peak[name] = max(self.peak.get(name, 0), top - ends)

    def _switch(self, name):
        if self.current is not None:
            self._close(self.current)
        self.current = name
        self.begin()

    def backward(self, outputs, model):
        if not self.on:
            return
        loss = sum(x.float().sum() for x in keras.tree.flatten(outputs))
        weights = [v.value for v in model.trainable_variables]
        torch.autograd.grad(loss, weights, allow_unused=True)
        if self.current is not None:
            self._close(self.current)


def _key(tensor):
    return tensor.untyped_storage().data_ptr()
