"""At which batch size AutoVM's profiling pass runs, and times the layers,
under a memory limit (`keras_autovm.profiling`).

The pass runs the model's forward once and holds every layer output to the
end (Keras's graph runner keeps them), so under a limit below the in-core
need it runs at a smaller batch (`timing_batch`). Each call is then timed
alone: where the largest call, its inputs, outputs and their gradients,
fits beside the pass at the training batch (`calls_fit`), the calls are
timed at that batch on inputs made for it (zeros, like the pass's own);
otherwise at the largest batch above the pass's where every call, with
the temporaries a call alone makes, fits beside a pass of 2
(`largest_call_batch`); otherwise at the pass's batch. Times are scaled up
from the batch timed. Scaled up, ResNet-152's layer backwards timed under
a 10.5 GiB cap on an H100 summed to 0.32 s, timed at the training batch
0.15 s (the step's backward: 0.18 s): a small batch uses the GPU less
well per sample, and the plan counted on a backward twice as long as the
real one (docs/results.md). On an H200 under an 8 GiB cap, ResNet-152's
layers timed at batch 11 (the pass's) summed to 3.3 to 4.5 s scaled to
264, timed at 264 without a cap 0.99 s (results/tensorflow/workspace/).
"""

import keras

from keras_autovm import internals
from keras_autovm.model_graph import build_graph
from keras_autovm.model_graph import layer_facts

# A timed call holds its inputs and outputs, the outputs' gradients and the
# inputs' gradients: about three times what it reads and writes.
_CALL_COPIES = 3
# Below the training batch, a call is timed only where it fits with all it
# makes alone: its inputs, outputs and both gradients (twice what it reads
# and writes), and temporaries of up to 8 outputs (on an H200, alone,
# VGG-19's `block1_conv2` backward made 8 outputs' worth, layout
# transposes included; a batch normalization's 4; results/tensorflow/workspace/).
_CALL_COPIES_ALONE = 2
_TEMPORARY_OUTPUTS = 8
# The smallest pass beside calls timed at a batch of their own: at 1, a
# tensor that is not batched but has a leading 1 would be taken for one
# that is (`at_batch`).
LEAST_PASS = 2


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
    largest = max(moved for moved, _ in _call_bytes(model, graph))
    workspace = max(op.workspace_bytes for op in graph.ops)
    return (_CALL_COPIES * largest * batch_size + workspace
            <= _room(graph, limit_bytes, pass_batch))


def largest_call_batch(model, batch_size, limit_bytes, graph=None):
    """The largest batch, up to `batch_size`, at which every layer call,
    timed alone with the temporaries a call alone makes, fits beside a pass
    of `LEAST_PASS` under `limit_bytes` (`None`: no limit, `batch_size`);
    0 where none does."""
    if limit_bytes is None:
        return batch_size
    graph = graph or build_graph(model, 1)
    need = max(_CALL_COPIES_ALONE * moved + _TEMPORARY_OUTPUTS * written
               for moved, written in _call_bytes(model, graph))
    return int(max(0, min(batch_size, _room(graph, limit_bytes, LEAST_PASS) // max(need, 1))))


def _call_bytes(model, graph):
    """Per op, `(read and written, written)`: bytes per sample."""
    sizes = {t.name: t.nbytes for t in graph.tensors}
    batch_in = sum(layer_facts.nbytes(x, 1, "input")
                   for x in internals.functional_of(model).inputs)
    calls = []
    for op in graph.ops:
        written = sum(sizes[t] for t in op.outputs)
        calls.append(((sum(sizes[t] for t in op.inputs) or batch_in) + written, written))
    return calls


def _room(graph, limit_bytes, pass_batch):
    """What is left under `limit_bytes` beside a pass at `pass_batch`."""
    return (limit_bytes - graph.persistent_bytes
            - sum(t.nbytes for t in graph.tensors) * pass_batch)


def at_batch(structure, batch_size, pass_batch):
    """`structure` with each tensor of leading size `pass_batch` replaced
    by zeros of leading size `batch_size` (what a call is timed on); as it
    is when the two sizes are the same. A tensor that is not batched but
    whose leading size is the pass batch's is replaced too: the pass runs
    at 2 or more (`timing_batch_for`), where such a collision is rare, but
    beside calls timed at a batch of their own it runs at 2. A call that
    then fails makes the whole profile fail (roofline estimates, warned)."""
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
    beside a pass of 2 or more; else the largest batch above the pass's
    that fits beside a pass of `LEAST_PASS` (`largest_call_batch`), with
    that pass; else the pass's own."""
    if limit_bytes is None:
        return batch_size, batch_size
    graph = build_graph(model, 1)  # Once, for all.
    pass_batch = timing_batch(model, batch_size, limit_bytes, graph)
    if pass_batch >= batch_size:
        return pass_batch, pass_batch
    if pass_batch > 1 and calls_fit(model, batch_size, pass_batch, limit_bytes, graph):
        return pass_batch, batch_size
    # Even where the largest pass is 1 (no fixed part can be fitted there).
    time_at = (largest_call_batch(model, batch_size, limit_bytes, graph)
               if batch_size > LEAST_PASS else 0)
    if time_at > max(pass_batch, LEAST_PASS):
        return LEAST_PASS, time_at
    return pass_batch, pass_batch
