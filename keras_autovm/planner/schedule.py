"""The compute stream of one training step under a plan, in order.

Forward runs every op in order; backward runs them in reverse, each op's
backward preceded by the recomputations it needs (recursively, for
recomputed inputs of recomputed tensors). `schedule` records, for every
kept or swapped tensor, the positions that read it in backward, and for
every recomputed tensor when it is made again and when it dies.

Pure standard-library Python, no framework imports.
"""

import collections

from .graph import ACTIONS


def first_backward_use(graph, actions, replay=False):
    """Where each tensor is first needed in backward under `actions`.

    Policies use it to place prefetches: the answer accounts for
    recomputations, which may read a swapped tensor before any backward
    reader does.

    Args:
        graph: a `Graph`.
        actions: dict tensor name -> action, as for `simulate`.
        replay: whether recompute replays whole chains
            (`CostModel.replay_segments`).

    Returns:
        Dict tensor name -> forward index of the op whose backward (or the
        recomputations just before it) first reads the tensor. Tensors not
        read in backward are left out.
    """
    ix = index(graph)
    check_actions(ix, dict(actions))
    sched = schedule(ix, dict(actions), replay)
    return {t: sched.group[pos[0]] for t, pos in sched.uses.items() if pos}


# Static facts about a graph, computed once per Graph object.
_CACHE = {}


def index(graph):
    hit = _CACHE.get(id(graph))
    # Holding the graph keeps its id from being reused while cached.
    if hit is not None and hit[0] is graph:
        return hit[1]
    if len(_CACHE) >= 32:
        _CACHE.clear()
    ix = Index(graph)
    _CACHE[id(graph)] = (graph, ix)
    return ix


class Index:
    """Per-graph lookups by op position (forward index)."""

    def __init__(self, graph):
        pos = graph.op_index
        n = len(graph.ops)
        self.n = n
        self.op_names = [op.name for op in graph.ops]
        self.nbytes = {t.name: t.nbytes for t in graph.tensors}
        self.spec = graph.tensor_map
        self.producer = {t.name: pos[t.producer] for t in graph.tensors}
        self.fwd = {t.name: sorted({pos[r] for r in t.fwd_readers})
                    for t in graph.tensors}
        self.bwd = {t.name: sorted({pos[r] for r in t.bwd_readers})
                    for t in graph.tensors}
        self.last_fwd = {t: (f[-1] if f else self.producer[t])
                         for t, f in self.fwd.items()}
        self.outputs = [[] for _ in range(n)]
        self.inputs = [[] for _ in range(n)]
        self.bwd_inputs = [[] for _ in range(n)]
        for t in graph.tensors:
            self.outputs[self.producer[t.name]].append(t.name)
            for i in self.fwd[t.name]:
                self.inputs[i].append(t.name)
            for i in self.bwd[t.name]:
                self.bwd_inputs[i].append(t.name)
        self._add_declared_inputs(graph)
        self.schedules = {}  # See `schedule`.
        self.times = {}  # See `times`.

    def _add_declared_inputs(self, graph):
        # OpSpec.inputs should agree with fwd_readers; take the union so a
        # recomputation never misses an input either side declares.
        for i, op in enumerate(graph.ops):
            for name in op.inputs:
                known = name in self.producer and self.producer[name] < i
                if known and name not in self.inputs[i]:
                    self.inputs[i].append(name)


def check_actions(ix, actions):
    for name, action in actions.items():
        if name not in ix.spec:
            raise ValueError(f"Unknown tensor in `actions`: {name!r}")
        if action not in ACTIONS:
            raise ValueError(
                f"Action for {name!r} must be one of {ACTIONS}, "
                f"received: {action!r}"
            )
        t = ix.spec[name]
        if action == "swap" and not t.can_swap:
            raise ValueError(f"Tensor {name!r} cannot be swapped. {t.note}")
        if action == "recompute" and not t.can_recompute:
            raise ValueError(f"Tensor {name!r} cannot be recomputed. {t.note}")


Schedule = collections.namedtuple(
    "Schedule", ["items", "group", "group_start", "bwd_pos", "uses", "redo"]
)


def schedule(ix, actions, replay=False):
    """`_schedule`, remembered for the last few action sets of a graph.

    Policies ask for the same actions twice in a row (where to prefetch,
    then the simulation); the result is never changed by its users.
    """
    key = (frozenset((t, a) for t, a in actions.items() if a != "keep"), replay)
    hit = ix.schedules.get(key)
    if hit is None:
        if len(ix.schedules) >= 4:
            ix.schedules.pop(next(iter(ix.schedules)))
        hit = ix.schedules[key] = _schedule(ix, actions, replay)
    return hit


def replay_chains(ix, actions):
    """Op index -> the ops (forward order) replayed together with it.

    A backend that checkpoints a chain of layers replays the whole chain
    at its first backward use: the ops linked by recomputed tensors (a
    producer and its forward readers), with everything they save.
    """
    parent = list(range(ix.n))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for name, action in actions.items():
        if action == "recompute":
            for r in ix.fwd[name]:
                parent[root(r)] = root(ix.producer[name])
    groups = collections.defaultdict(list)
    for i in range(ix.n):
        groups[root(i)].append(i)
    return {i: tuple(g) for g in groups.values() if len(g) > 1 for i in g}


def times(ix, graph, cost):
    """Forward and backward time of every op under `cost`, remembered."""
    hit = ix.times.get(cost)
    if hit is None:
        if len(ix.times) >= 4:
            ix.times.clear()
        hit = ix.times[cost] = ([cost.fwd_time(op) for op in graph.ops],
                                [cost.bwd_time(op) for op in graph.ops])
    return hit


def _schedule(ix, actions, replay=False):
    """Orders the compute stream and records backward uses.

    Returns a `Schedule`: `items` is a list of (phase, op index); `group[p]`
    the op whose backward item `p` belongs to (None in forward);
    `group_start[i]` and `bwd_pos[i]` the positions where op i's backward
    group and backward item start; `uses` maps kept/swapped tensors to the
    positions that read them in backward; `redo` lists recomputed tensors
    as `[name, first_pos, last_pos]`. With `replay`, a recomputed tensor
    brings back the whole chain it belongs to (`replay_chains`).
    """
    n = ix.n
    items = [("fwd", i) for i in range(n)]
    group = [None] * n
    group_start, bwd_pos = [0] * n, [0] * n
    uses, redo = {}, []
    live = {}  # Recomputed tensor -> its redo entry, while it is live.
    dies = {}  # Op index -> recomputed tensors its backward is the last for.

    def use(name, pos):
        if name in live:
            live[name][2] = pos
        elif actions.get(name, "keep") != "recompute":
            uses.setdefault(name, []).append(pos)

    def recompute(name, i):
        p = ix.producer[name]
        pos = len(items)
        items.append(("recompute", p))
        group.append(i)
        for s in ix.inputs[p]:
            use(s, pos)
        redo.append([name, pos, pos])
        # Live until its last backward reader still to run; with none, it
        # only feeds other recomputations of this group.
        until = min((r for r in ix.bwd[name] if r <= i), default=i)
        live[name] = redo[-1]
        dies.setdefault(until, []).append(name)

    chains = replay_chains(ix, actions) if replay else {}
    made = collections.defaultdict(list)  # Op index -> its recomputed tensors.
    for t, action in actions.items() if chains else ():
        if action == "recompute":
            made[ix.producer[t]].append(t)

    replayed, tails = set(), {}

    def replay_chain(ops, i):
        replayed.add(ops)
        for p in ops:
            wanted = [t for t in made[p] if t not in live]
            if wanted:
                recompute(wanted[0], i)
            elif p == ops[-1] and p == i:
                replay_tail(p, i)
            for t in wanted[1:]:  # Made by the same replay of op p.
                redo.append([t, redo[-1][1], redo[-1][2]])
                live[t] = redo[-1]
                until = min((r for r in ix.bwd[t] if r <= i), default=i)
                dies.setdefault(until, []).append(t)

    def replay_tail(p, i):
        # The chain's last op runs again too, and what it saves of its own
        # output is made again beside the output it keeps, until its backward.
        pos = len(items)
        items.append(("recompute", p))
        group.append(i)
        for s in ix.inputs[p]:
            use(s, pos)
        for t in ix.outputs[p]:
            if p in ix.bwd[t] and actions.get(t, "keep") != "recompute":
                redo.append([t, pos, pos])
                tails.setdefault(i, []).append(redo[-1])

    def ensure(name, i):
        if name in live or actions.get(name) != "recompute":
            return
        chain = chains.get(ix.producer[name])
        if chain and chain not in replayed:
            # The chain's inputs from outside it are read by the replay.
            replay_chain(chain, i)
            return
        # Depth-first without recursion: recomputed chains can be long.
        stack = [(name, False)]
        while stack:
            t, ready = stack.pop()
            if actions.get(t) != "recompute" or t in live:
                continue
            if ready:
                recompute(t, i)
                continue
            stack.append((t, True))
            inputs = ix.inputs[ix.producer[t]]
            stack.extend((s, False) for s in reversed(inputs))

    for i in reversed(range(n)):
        group_start[i] = len(items)
        for t in ix.bwd_inputs[i]:
            ensure(t, i)
        bwd_pos[i] = len(items)
        for entry in tails.pop(i, ()):
            entry[2] = bwd_pos[i]
        items.append(("bwd", i))
        group.append(i)
        for t in ix.bwd_inputs[i]:
            use(t, bwd_pos[i])
        for t in dies.pop(i, ()):
            del live[t]
    return Schedule(items, group, group_start, bwd_pos, uses, redo)
