"""At which batch size AutoVM's profiling pass runs, and times the layers,
under a memory limit (`keras_autovm.profiling`).

The pass runs the model's forward once and holds every layer output to the
end (Keras's graph runner keeps them), so under a limit below the in-core
need it runs at a smaller batch (`timing_batch`). Each call is then timed
alone: where the largest call, its inputs, outputs and their gradients,
fits beside the pass at the training batch (`calls_fit`), the calls are
timed at that batch on inputs made for it (zeros, like the pass's own);
otherwise at the pass's batch, and scaled up. Scaled up, ResNet-152's
layer backwards timed under a 10.5 GiB cap on an H100 summed to 0.32 s,
timed at the training batch 0.15 s (the step's backward: 0.18 s): a small
batch uses the GPU less well per sample, and the plan counted on a
backward twice as long as the real one (docs/results.md).
"""

import keras

from keras_autovm import internals
from keras_autovm.model_graph import build_graph
from keras_autovm.model_graph import layer_facts

# A timed call holds its inputs and outputs, the outputs' gradients and the
# inputs' gradients: about three times what it reads and writes.
_CALL_COPIES = 3


def timing_batch(model, batch_size, limit_bytes, graph=None):
    """The batch size to run the profiling pass at under `limit_bytes`.

    The pass holds every layer output at once, and each timed call its own
    backward on top, so under a budget below the in-core need a pass at the
    full batch runs out of memory. `None`: no limit. `graph`: the model's
    `build_graph(model, 1)`, where the caller has it.
    """
    if limit_bytes is None:
        return batch_size
    graph = graph or build_graph(model, 1)
    per_sample = sum(t.nbytes for t in graph.tensors) or 1
    room = limit_bytes - graph.persistent_bytes
    # Half the room: the timed call's backward needs about as much again.
    return int(max(1, min(batch_size, room // (2 * per_sample))))


def calls_fit(model, batch_size, pass_batch, limit_bytes, graph=None):
    """Whether every layer call, timed alone at `batch_size`, fits beside a
    pass at `pass_batch` under `limit_bytes` (`None`: no limit). A call
    reading only model inputs is counted as reading all of them."""
    if limit_bytes is None:
        return True
    graph = graph or build_graph(model, 1)
    sizes = {t.name: t.nbytes for t in graph.tensors}
    batch_in = sum(layer_facts.nbytes(x, 1, "input")
                   for x in internals.functional_of(model).inputs)
    largest = max((sum(sizes[t] for t in op.inputs) or batch_in)
                  + sum(sizes[t] for t in op.outputs) for op in graph.ops)
    workspace = max(op.workspace_bytes for op in graph.ops)
    room = limit_bytes - graph.persistent_bytes - sum(sizes.values()) * pass_batch
    return _CALL_COPIES * largest * batch_size + workspace <= room


def at_batch(structure, batch_size, pass_batch):
    """`structure` with each tensor of leading size `pass_batch` replaced
    by zeros of leading size `batch_size` (what a call is timed on); as it
    is when the two sizes are the same. A tensor that is not batched but
    whose leading size is the pass batch's is replaced too: the pass runs
    at 2 or more (`timing_batch_for`), where such a collision is rare."""
    if batch_size == pass_batch:
        return structure

    def grow(x):
        shape = getattr(x, "shape", None)
        if not shape or shape[0] != pass_batch or not hasattr(x, "dtype"):
            return x
        return keras.ops.zeros((batch_size,) + tuple(shape[1:]), x.dtype)

    return keras.tree.map_structure(grow, structure)


def timing_batch_for(model, batch_size, limit_bytes):
    """`(pass_batch, time_at)`: the batch the profiling pass runs at, and
    the one each call is timed at: the training batch where the calls fit
    beside a pass of 2 or more, else the pass's own."""
    if limit_bytes is None:
        return batch_size, batch_size
    graph = build_graph(model, 1)  # Once, for both.
    pass_batch = timing_batch(model, batch_size, limit_bytes, graph)
    if 1 < pass_batch < batch_size and calls_fit(model, batch_size, pass_batch,
                                                 limit_bytes, graph):
        return pass_batch, batch_size
    return pass_batch, pass_batch
