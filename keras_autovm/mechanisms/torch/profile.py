"""What autograd saves for each layer call on torch, measured.

Keras's torch layers do not save for the backward pass exactly the layer's
inputs and outputs that the planner's table assumes: a channels-last
convolution saves a channels-first copy of its input instead of the input,
batch normalization saves intermediates of its own. `measure(model)` runs
the forward pass twice at small batch sizes (under `keras.StatelessScope`,
so no layer state changes) with saved-tensor hooks, and records for each
layer call which of its input and output tensors autograd saved and how
many bytes of other tensors it saved. `adjust(graph, profile)` then makes a
planner graph say what was measured: backward readers from what was saved,
and one tensor `f"{op}:saved"` per call for the rest, sized
`fixed + per_sample * batch_size` from the two runs.
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
    fixed: float  # Bytes of other saved tensors: fixed part...
    per_sample: float  # ...and the part per sample of the batch.

    def internal_bytes(self, batch_size):
        return max(0, int(round(self.fixed + self.per_sample * batch_size)))


def measure(model):
    """Maps op name to `Saved` for every layer call of `model`."""
    runs = [_run(model, size) for size in SIZES]
    (b0, first), (b1, second) = zip(SIZES, runs)
    profile = {}
    for name, (tags, nbytes) in first.items():
        slope = (second[name][1] - nbytes) / (b1 - b0)
        profile[name] = Saved(frozenset(tags | second[name][0]), nbytes - slope * b0, slope)
    return profile


def adjust(graph, profile):
    """`graph` with backward readers and internal tensors as measured."""
    tensors = {t.name: t for t in graph.tensors}
    readers = {name: list(t.bwd_readers) for name, t in tensors.items()}
    extra = []
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
    return Graph(ops=graph.ops, persistent_bytes=graph.persistent_bytes,
                 batch_size=graph.batch_size, outputs=graph.outputs,
                 tensors=tuple(dataclasses.replace(t, bwd_readers=tuple(readers[t.name]))
                               for t in graph.tensors) + tuple(extra))


def _run(model, batch_size):
    """{op name: (saved input/output tags, bytes of other saved tensors)}."""
    calls = call_names(model)
    fn = internals.functional_of(model)
    inputs = [keras.ops.zeros((batch_size,) + tuple(x.shape[1:]), x.dtype)
              for x in fn.inputs]
    # Storage -> tag; None for model inputs and variables (views of them too).
    owner = {_key(x): None for x in inputs}
    owner.update({weight_key(v): None for v in model.variables})
    packed, found = [], {}

    def pack(tensor):
        packed.append(tensor)  # Held: no storage is reused meanwhile.
        # Not the tensor: a node saving its own output would then hold
        # itself, a cycle no backward pass breaks here (the graph leaked).
        return None

    def around(operation, run, args):
        del packed[:len(packed)]
        outputs = run()
        name, tags = calls.pop(0)
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
    with keras.StatelessScope(state_mapping=state), torch.enable_grad():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            internals.run_calls(model, inputs, around)
    packed.clear()
    return found


def _key(tensor):
    return tensor.untyped_storage().data_ptr()
