"""The planner's input: one training step as ops over tagged tensors.

Pure data, no framework imports. The Keras integration (`keras_autovm.graph`)
builds a `Graph` from a model; tests build small ones by hand.

Conventions:
- `Graph.ops` is the forward execution order; backward runs it in reverse.
- A tensor is a tagged layer output. `fwd_readers` are the ops that read it
  in the forward pass; `bwd_readers` the ops whose *backward* pass reads it
  (a Conv2D's backward reads its input, a ReLU's its output, an Add's nothing).
- Bytes are per training step at the batch size the graph was built for.
"""

import dataclasses
import functools

ACTIONS = ("keep", "swap", "recompute")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tagged tensor (one layer output).

    Args:
        name: unique name, also the tag the mechanisms use.
        nbytes: size in bytes at the graph's batch size.
        producer: name of the op that produces it.
        fwd_readers: names of the ops that read it in the forward pass.
        bwd_readers: names of the ops whose backward pass reads it.
        can_swap: whether it may be moved to host.
        can_recompute: whether it may be dropped and recomputed.
        note: why an action is not allowed, shown in plan summaries.
        internal: saved inside its producer for the producer's own
            backward, not a layer output: no other op reads it, and
            recomputing the producer makes it again. Defaults to `False`.
    """

    name: str
    nbytes: int
    producer: str
    fwd_readers: tuple = ()
    bwd_readers: tuple = ()
    can_swap: bool = True
    can_recompute: bool = True
    note: str = ""
    internal: bool = False


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One layer call in the forward pass.

    Args:
        name: unique name (the layer's name).
        inputs: names of the tagged tensors it reads (untagged inputs, such
            as the model's inputs, are left out).
        outputs: names of the tagged tensors it produces.
        flops: forward floating-point operations at the graph's batch size.
        mem_bytes: forward memory traffic in bytes (reads plus writes).
        fwd_time: measured or supplied forward time in seconds; `None`
            means estimate it from `flops` and `mem_bytes`.
        bwd_time: likewise for the backward pass.
        workspace_bytes: scratch memory held while the op runs, measured
            as what it allocated above the larger of the memory before
            and after it (see `simulate`).
        scratch_bytes: `(forward, backward)` scratch of the op's compiled
            programs (XLA's temporaries), held beside everything live
            while each runs, whole.
        kind: the layer's class name, for summaries.
        note: why this op is not managed, if it is not.
        unary: whether the call takes one tensor and nothing else tensor-
            valued, so that a recompute replay may feed it the previous
            op's output alone (`Multiply()([x, x])` reads one tagged tensor
            but is not unary).
    """

    name: str
    inputs: tuple = ()
    outputs: tuple = ()
    flops: float = 0.0
    mem_bytes: float = 0.0
    fwd_time: float = None
    bwd_time: float = None
    workspace_bytes: int = 0
    scratch_bytes: tuple = (0, 0)
    kind: str = ""
    note: str = ""
    unary: bool = True


@dataclasses.dataclass(frozen=True)
class Graph:
    """One training step: ops in forward order and the tensors they tag.

    Args:
        ops: tuple of `OpSpec` in forward execution order.
        tensors: tuple of `TensorSpec`.
        persistent_bytes: memory held for the whole step: weights, their
            gradients, optimizer state and the input batch.
        batch_size: the batch size the byte counts are for.
        outputs: names of the tensors the model returns (the loss reads
            them right after the forward pass). Defaults to `()`.
    """

    ops: tuple
    tensors: tuple
    persistent_bytes: int = 0
    batch_size: int = 0
    outputs: tuple = ()

    def __post_init__(self):
        _validate(self)

    # Made once per graph (it is frozen): the search asks thousands of times.
    @functools.cached_property
    def op_index(self):
        """Maps op name to its position in forward order."""
        return {op.name: i for i, op in enumerate(self.ops)}

    @functools.cached_property
    def tensor_map(self):
        """Maps tensor name to its `TensorSpec`."""
        return {t.name: t for t in self.tensors}


def _validate(graph):
    op_names = [op.name for op in graph.ops]
    if len(set(op_names)) != len(op_names):
        raise ValueError(f"Graph op names must be unique, got {op_names}")
    names = [t.name for t in graph.tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"Graph tensor names must be unique, got {names}")
    unknown = set(graph.outputs) - set(names)
    if unknown:
        raise ValueError(f"Graph outputs name unknown tensors: {sorted(unknown)}")
    index = {name: i for i, name in enumerate(op_names)}
    for t in graph.tensors:
        if t.nbytes < 0:
            raise ValueError(f"Tensor {t.name!r} has negative nbytes={t.nbytes}")
        if t.producer not in index:
            raise ValueError(f"Tensor {t.name!r} has unknown producer {t.producer!r}")
        for reader in t.fwd_readers + t.bwd_readers:
            if reader not in index:
                raise ValueError(f"Tensor {t.name!r} has unknown reader {reader!r}")
        for reader in t.fwd_readers:
            if index[reader] <= index[t.producer]:
                raise ValueError(
                    f"Tensor {t.name!r} is read by {reader!r} before it is "
                    f"produced by {t.producer!r}: ops are not in forward order"
                )
