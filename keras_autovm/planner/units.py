"""What the hybrid policy can act on: swap units and recompute units.

A swap unit is one tensor. A recompute unit is a piece of a dataflow chain:
ops linked output to input with nothing else reading the links in forward,
whatever other ops the forward order puts between them (branched models
interleave their branches, so the chains of `policies.chain_segments`,
which need consecutive ops, are short there). The runtime replays such a
piece from its first op's inputs, as it does any recompute segment: the
piece's inner outputs, and what its members save inside themselves, are
recomputed; its last output is not.

Where the backend recomputes by name (JAX under jit: whatever the plan
does not keep, XLA makes again) a recompute unit may also be a run of
regions (`region_units`): the ops between two cuts of the forward pass,
points where one tensor is all that later ops read of what came before
(a residual block's output). A chain ends at every branch, so in a ResNet
the chains keep each block's output and its last batch norm's; a run of
regions keeps only the output it ends with.

Pure standard-library Python, no framework imports.
"""

import dataclasses
import math


@dataclasses.dataclass
class Unit:
    """Tensors the hybrid policy turns from keep to one action together.

    Attributes:
        kind: `"swap"` or `"recompute"`.
        tensors: tuple of tensor names.
        nbytes: their total size.
        segment: for recompute, the op names replayed (forward order).
        estimate: seconds the action is expected to add to the step.
        cuts: for a run of regions, the positions in `segment` of the
            ops each region ends with (where `halves` cuts it); empty for
            a chain's piece.
    """

    kind: str
    tensors: tuple
    nbytes: int
    segment: tuple = ()
    estimate: float = 0.0
    cuts: tuple = ()


def dataflow_chains(graph):
    """Maximal chains of ops linked by single-reader tensors.

    Op b follows op a when a has exactly one output (besides internal
    tensors), that output may be recomputed, b is its only forward reader,
    and b reads nothing else that is tagged, and takes that one tensor alone
    (`OpSpec.unary`: the replay calls it with the previous op's output).

    Args:
        graph: a `Graph`.

    Returns:
        List of chains (lists of op names in forward order), single ops
        included.
    """
    tensors = graph.tensor_map
    outputs = {op.name: [] for op in graph.ops}
    inputs = {op.name: set(op.inputs) for op in graph.ops}
    unary = {op.name: op.unary for op in graph.ops}
    for t in graph.tensors:
        if not t.internal:
            outputs[t.producer].append(t.name)
        for reader in t.fwd_readers:
            inputs[reader].add(t.name)
    follows = {}
    for op in graph.ops:
        out = outputs[op.name]
        if len(out) != 1 or not tensors[out[0]].can_recompute:
            continue
        readers = set(tensors[out[0]].fwd_readers)
        if len(readers) == 1:
            reader = readers.pop()
            if inputs[reader] == {out[0]} and unary[reader]:
                follows[op.name] = reader
    has_prev = set(follows.values())
    chains = []
    for op in graph.ops:
        if op.name in has_prev:
            continue
        chain = [op.name]
        while chain[-1] in follows:
            chain.append(follows[chain[-1]])
        chains.append(chain)
    return chains


def recompute_units(graph, cost):
    """Pieces of the dataflow chains (about sqrt(N) ops at most) to replay.

    Args:
        graph: a `Graph`.
        cost: a `CostModel`, for each unit's recompute time.

    Returns:
        List of `Unit`s of kind `"recompute"` that free some bytes.
    """
    size = max(2, round(math.sqrt(len(graph.ops))))
    # Replaying an op keeps its inputs until the replay: a head reading a
    # tensor that the backward would not need (an add's or a
    # concatenation's operands) would hold more than the piece frees.
    # Such a head starts the piece only if it frees more than it holds.
    held = {op.name: 0 for op in graph.ops}
    made = {op.name: 0 for op in graph.ops}
    for t in graph.tensors:
        made[t.producer] += t.nbytes
        if not t.bwd_readers:
            for reader in set(t.fwd_readers):
                held[reader] += t.nbytes
    units = []
    for chain in dataflow_chains(graph):
        if held[chain[0]] > made[chain[0]]:
            chain = chain[1:]
        if not chain:
            continue
        count = math.ceil(len(chain) / size)
        for j in range(count):
            piece = tuple(chain[j * len(chain) // count:
                                (j + 1) * len(chain) // count])
            unit = _piece_unit(graph, cost, piece)
            if unit is not None:
                units.append(unit)
    return units


def halves(graph, cost, unit):
    """A recompute unit cut in two (the first half's last output is kept):
    a run of regions at the cut nearest its middle, else at its middle op.

    Returns:
        List of the halves that still free bytes.
    """
    piece, mid = unit.segment, len(unit.segment) // 2
    if unit.cuts[:-1]:
        cut = min(unit.cuts[:-1], key=lambda c: abs(c + 1 - mid))
        mid = cut + 1
        cuts = (tuple(c for c in unit.cuts if c < mid),
                tuple(c - mid for c in unit.cuts if c >= mid))
    else:
        cuts = ((), ())
    halves = (_piece_unit(graph, cost, piece[:mid], cuts[0]),
              _piece_unit(graph, cost, piece[mid:], cuts[1]))
    return [h for h in halves if h is not None]


def _piece_unit(graph, cost, piece, cuts=()):
    """The recompute unit replaying `piece`, or `None` if it frees nothing."""
    if len(piece) < 2:
        return None
    members = set(piece)
    inner = [t for t in graph.tensors if t.producer in members and t.nbytes
             and t.can_recompute and (t.producer != piece[-1] or t.internal)]
    if not inner:
        return None
    ops = {op.name: op for op in graph.ops if op.name in members}
    redone = {t.producer for t in inner}
    # Summed in the piece's order: a set's order of names changes from run
    # to run with Python's hash seed, and the sum's last bits with it.
    return Unit("recompute", tuple(t.name for t in inner),
                sum(t.nbytes for t in inner), piece,
                sum(cost.fwd_time(ops[name]) for name in piece if name in redone),
                cuts if len(cuts) > 1 else ())


def cuts(graph):
    """Positions of the ops after which the forward pass reads, of all that
    came before, only that op's one output (which may be recomputed).

    Args:
        graph: a `Graph`.

    Returns:
        Sorted list of op positions in `graph.ops`.
    """
    index = graph.op_index
    made = {op.name: [] for op in graph.ops}
    closing = {i: [] for i in range(len(graph.ops))}
    for t in graph.tensors:
        if not t.internal:
            made[t.producer].append(t)
            last = max([index[r] for r in t.fwd_readers] + [index[t.producer]])
            closing[last].append(t.name)
    read_later, found = set(), []
    for i, op in enumerate(graph.ops):
        read_later.update(t.name for t in made[op.name] if t.name not in closing[i])
        read_later.difference_update(closing[i])
        out = made[op.name]
        if len(out) == 1 and read_later == {out[0].name} and out[0].can_recompute:
            found.append(i)
    return found


def region_units(graph, cost, by_bytes=False):
    """Runs of the graph's R regions (the ops between two `cuts`), for a
    backend that recomputes by name: recomputing a run's tensors, all but
    the one it ends with, needs only the one before it.

    By default, about sqrt(R) runs of equal counts of regions. With
    `by_bytes`, a quarter more runs, of about equal bytes: a ResNet's first
    regions hold 4x the bytes of its last, and the least peak is bounded by
    the largest run made again at once (ResNet-152 at batch 64 on JAX: 3.59
    GiB by counts, 3.16 GiB by bytes; at a looser budget counts can be the
    faster plan, so the hybrid policy tries both).

    Args:
        graph: a `Graph`.
        cost: a `CostModel`, for each unit's recompute time.
        by_bytes: whether runs hold equal bytes. Defaults to `False`.

    Returns:
        List of `Unit`s of kind `"recompute"` that free some bytes.
    """
    bounds = [-1] + cuts(graph)
    if bounds[-1] != len(graph.ops) - 1:  # The ops after the last cut.
        bounds.append(len(graph.ops) - 1)
    regions = [range(a + 1, b + 1) for a, b in zip(bounds, bounds[1:])]
    if not regions:  # A graph without ops.
        return []
    count = len(regions) / max(2, round(math.sqrt(len(regions))))
    if by_bytes:
        runs = _runs_by_bytes(graph, regions, math.ceil(1.25 * count))
    else:
        count = math.ceil(count)
        runs = [regions[j * len(regions) // count:(j + 1) * len(regions) // count]
                for j in range(count)]
    units = []
    for run in runs:
        start = run[0][0]
        piece = tuple(graph.ops[i].name for r in run for i in r)
        unit = _piece_unit(graph, cost, piece, tuple(r[-1] - start for r in run))
        if unit is not None:
            units.append(unit)
    return units


def _runs_by_bytes(graph, regions, count):
    """`regions` in order, cut into about `count` runs of equal bytes: a run
    ends where the next region's middle would pass its share."""
    made = [0] * len(graph.ops)
    index = graph.op_index
    for t in graph.tensors:
        made[index[t.producer]] += t.nbytes
    sizes = [sum(made[i] for i in r) for r in regions]
    share = sum(sizes) / count
    runs, done = [[]], 0
    for region, size in zip(regions, sizes):
        if runs[-1] and done + size / 2 > share * len(runs):
            runs.append([])
        runs[-1].append(region)
        done += size
    return runs


def swap_units(graph, cost, base):
    """One unit per tensor that may be swapped, with its exposed copy time.

    Model outputs and tensors saved inside their producer are not swapped.
    The estimate is the round trip's copy time less the idle window the
    keep-all timeline `base` leaves the tensor (from its last forward use
    to its first backward use).

    Args:
        graph: a `Graph`.
        cost: a `CostModel`.
        base: the `SimResult` of keeping everything.

    Returns:
        List of `Unit`s of kind `"swap"`.
    """
    start = {(e.op, e.phase): e.start for e in base.op_events}
    end = {(e.op, e.phase): e.end for e in base.op_events}
    index = graph.op_index
    outputs = set(graph.outputs)
    units = []
    for t in graph.tensors:
        if not (t.bwd_readers and t.nbytes and t.can_swap) or t.internal \
                or t.name in outputs:
            continue
        last_fwd = max((t.producer,) + t.fwd_readers, key=index.get)
        first_bwd = max(t.bwd_readers, key=index.get)
        idle = max(0.0, start[first_bwd, "bwd"] - end[last_fwd, "fwd"])
        trip = cost.copy_time(t.nbytes, "d2h") + cost.copy_time(t.nbytes, "h2d")
        units.append(Unit("swap", (t.name,), t.nbytes, (),
                          max(0.0, trip - idle)))
    return units
