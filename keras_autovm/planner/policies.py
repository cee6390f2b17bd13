"""Policies: pure functions `(graph, cost, budget) -> Plan`.

Each policy decides an action per tagged tensor and, for swapped tensors,
where in backward to start copying them back; the simulator scores the
result. `choose.py` collects them by name (`POLICIES`) and picks one
(`make_plan`).
"""

import math

from .plan import Plan
from .schedule import first_backward_use
from .simulate import simulate

# Prefetch distances greedy_offload tries, in ops ahead of the first use.
MAX_PREFETCH_AHEAD = 4


def keep_all(graph, cost, budget):
    """Keeps every tensor on the device (the in-core baseline).

    Where the backend holds layer outputs through the forward pass
    (`cost.holds_outputs`) and that fits the budget, the step is left as the
    framework runs it (`Plan.unchanged`): nothing to free, so no hooks and
    none of their per-tensor cost. Otherwise outputs are freed after their
    last forward reader.
    """
    plan = _finish(graph, cost, budget, "keep_all", {})
    if not cost.holds_outputs:
        return plan
    held = simulate(graph, plan.actions, None, cost, hold_outputs=True)
    if budget is not None and held.peak_bytes > budget:
        plan.notes.append("Layer outputs are freed after their last forward reader: "
                          "held to the end of the forward pass, as the framework "
                          "holds them, they would not fit.")
        return plan
    plan.result, plan.unchanged = held, True
    plan.notes.append("The step runs unchanged: it fits holding every layer output "
                      "to the end of the forward pass, as the framework does.")
    return plan


def offload_all(graph, cost, budget):
    """Swaps every swappable tensor read in backward (vDNN's vDNN_all).

    Each copy back starts one op ahead of the tensor's first backward use.
    """
    actions = {t.name: "swap" for t in _managed(graph, "swap")}
    return _finish(graph, cost, budget, "offload_all", actions,
                   prefetch_ahead(graph, actions, 1), uses=("swap",))


def greedy_offload(graph, cost, budget):
    """Swaps the fewest tensors that bring the peak within the budget.

    Candidates are ranked by bytes times idle window (from the end of their
    last forward use to their first backward use, in the keep-all
    timeline): big tensors idle for long free the most memory for the
    longest and leave the most time to hide their copies. A binary search
    over the ranking finds the shortest prefix that fits with prefetch one
    op ahead; then the smallest prefetch distance (up to
    `MAX_PREFETCH_AHEAD`) that removes stalls within the budget is kept.
    With no budget, or if everything fits, nothing is swapped.
    """
    base = simulate(graph, {}, None, cost)
    if budget is None or base.peak_bytes <= budget:
        return _finish(graph, cost, budget, "greedy_offload", {})
    order = _swap_order(graph, base)
    tried = {}

    def attempt(m, k):
        if (m, k) not in tried:
            actions = {name: "swap" for name in order[:m]}
            prefetch = prefetch_ahead(graph, actions, k)
            result = simulate(graph, actions, prefetch, cost)
            tried[m, k] = (actions, prefetch, result)
        return tried[m, k]

    m = _shortest_prefix(
        len(order), lambda m: attempt(m, 1)[2].peak_bytes <= budget
    )
    actions, prefetch, _ = _pick_distance(
        [attempt(m, k) for k in range(1, MAX_PREFETCH_AHEAD + 1)], budget
    )
    return _finish(graph, cost, budget, "greedy_offload", actions, prefetch,
                   uses=("swap",))


def sqrt_recompute(graph, cost, budget):
    """Recomputes inside chains cut into segments of about sqrt(N) ops.

    Chen et al.'s sqrt(N) checkpointing: every tensor inside a segment is
    dropped after the forward and recomputed in backward from the
    segment's input, so only segment boundaries stay live. Tensors that
    cannot be recomputed end a segment.
    """
    segments = chain_segments(graph)
    actions = _segment_actions(graph, segments)
    return _finish(graph, cost, budget, "sqrt_recompute", actions,
                   segments=segments, uses=("recompute",))


def sqrt_offload(graph, cost, budget):
    """`sqrt_recompute`, then swaps every other tensor needed in backward.

    The most memory-frugal policy here: only what the running op and the
    recomputation of one segment need is on the device in backward.
    """
    segments = chain_segments(graph)
    actions = _segment_actions(graph, segments)
    needed = first_backward_use(graph, actions, cost.replay_segments)
    for t in graph.tensors:
        kept = t.name not in actions and t.name in needed
        if kept and t.can_swap and t.nbytes:
            actions[t.name] = "swap"
    return _finish(graph, cost, budget, "sqrt_offload", actions,
                   prefetch_ahead(graph, actions, 1, cost.replay_segments),
                   segments=segments, uses=("swap", "recompute"))


def prefetch_ahead(graph, actions, k, replay=False):
    """Prefetch triggers `k` ops ahead of each swapped tensor's first use.

    Args:
        graph: a `Graph`.
        actions: dict tensor name -> action.
        k: how many ops before the first backward use (in backward order)
            the copy back starts; clamped to the last op.
        replay: whether recompute replays whole chains
            (`CostModel.replay_segments`).

    Returns:
        Dict swapped tensor name -> op name.
    """
    first = first_backward_use(graph, actions, replay)
    last = len(graph.ops) - 1
    return {
        name: graph.ops[min(first[name] + k, last)].name
        for name, action in actions.items()
        if action == "swap" and name in first
    }


def chain_segments(graph):
    """Cuts the graph's chains into segments of about sqrt(N) ops.

    A chain is a maximal run of consecutive ops where each op after the
    first reads exactly one tagged tensor, the only output of the op just
    before it, and nothing else reads that tensor in forward. A tensor that
    cannot be recomputed ends its chain, and its producer stays out of every
    chain after its first op: replaying a segment reruns all its ops, and a
    random layer's rerun would draw a new mask.

    Args:
        graph: a `Graph`.

    Returns:
        Tuple of segments (tuples of op names, forward order) of two ops or
        more.
    """
    size = max(2, round(math.sqrt(len(graph.ops))))
    segments = []
    for chain in _chains(graph):
        count = math.ceil(len(chain) / size)
        base, extra = divmod(len(chain), count)
        start = 0
        for j in range(count):
            stop = start + base + (1 if j < extra else 0)
            segments.append(tuple(chain[start:stop]))
            start = stop
    return tuple(s for s in segments if len(s) > 1)


def _chains(graph):
    """Maximal chains as lists of op names."""
    tensors = graph.tensor_map
    outputs = {op.name: [] for op in graph.ops}
    inputs = {op.name: [] for op in graph.ops}
    for t in graph.tensors:
        outputs[t.producer].append(t.name)
        for reader in set(t.fwd_readers):
            inputs[reader].append(t.name)
    chains = [[graph.ops[0].name]] if graph.ops else []
    for prev, op in zip(graph.ops, graph.ops[1:]):
        link = outputs[prev.name]
        linked = (len(link) == 1 and inputs[op.name] == link
                  and tuple(set(tensors[link[0]].fwd_readers)) == (op.name,)
                  and tensors[link[0]].can_recompute and op.unary
                  and all(tensors[t].can_recompute for t in outputs[op.name]))
        if linked:
            chains[-1].append(op.name)
        else:
            chains.append([op.name])
    return chains


def _segment_actions(graph, segments):
    """Marks every output inside a segment (not its last op's) recompute."""
    inner = {name for seg in segments for name in seg[:-1]}
    members = {name for seg in segments for name in seg}
    # What a member saves inside itself is made again with the segment.
    return {t.name: "recompute" for t in graph.tensors if t.can_recompute
            and (t.producer in inner or (t.internal and t.producer in members))}


def _managed(graph, action):
    """Tensors read in backward that `action` may be applied to."""
    flag = "can_swap" if action == "swap" else "can_recompute"
    return [t for t in graph.tensors
            if t.bwd_readers and t.nbytes and getattr(t, flag)]


def _swap_order(graph, base):
    """Swap candidates, most bytes times idle window first."""
    start = {(e.op, e.phase): e.start for e in base.op_events}
    end = {(e.op, e.phase): e.end for e in base.op_events}
    index = graph.op_index

    def score(t):
        last_fwd = max((t.producer,) + t.fwd_readers, key=index.get)
        first_bwd = max(t.bwd_readers, key=index.get)
        idle = start[first_bwd, "bwd"] - end[last_fwd, "fwd"]
        return t.nbytes * max(0.0, idle)

    # sorted() is stable: equal scores keep graph order.
    ranked = sorted(_managed(graph, "swap"), key=score, reverse=True)
    return [t.name for t in ranked]


def _shortest_prefix(n, fits):
    """Smallest m in 1..n with fits(m), assuming fits is monotone; else n."""
    if n == 0 or not fits(n):
        return n
    lo, hi = 1, n
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _pick_distance(attempts, budget):
    """First stall-free attempt that fits; else the fastest that fits."""
    fitting = [a for a in attempts if a[2].peak_bytes <= budget]
    for attempt in fitting:
        if attempt[2].stall_time == 0:
            return attempt
    if fitting:
        return min(fitting, key=lambda a: a[2].step_time)
    return min(attempts, key=lambda a: a[2].peak_bytes)


def _finish(graph, cost, budget, name, actions, prefetch=None, segments=(),
            uses=()):
    """Simulates `actions` (others kept) and wraps them in a `Plan`."""
    actions = {t.name: actions.get(t.name, "keep") for t in graph.tensors}
    prefetch = dict(prefetch or {})
    result = simulate(graph, actions, prefetch, cost)
    return Plan(graph, actions, prefetch, name, budget, cost, result,
                _notes(graph, actions, uses), tuple(segments))


_VERBS = {"swap": "swapped", "recompute": "recomputed"}


def _clause(note):
    """A note from the graph (fragments joined by ": " or "; ") as one
    clause: no closing period, the fragments joined by commas."""
    return note.rstrip(". ").replace(": ", ", ").replace("; ", ", ")


def _notes(graph, actions, uses):
    """Why ops are unmanaged and why tensors the policy acts on are kept,
    each a sentence."""
    notes = [f"{op.name} is left as it is: {_clause(op.note)}."
             for op in graph.ops if op.note]
    noted = {op.name for op in graph.ops if op.note}
    for t in graph.tensors:
        if t.producer in noted:  # One line a layer call: its op's says why.
            continue
        barred = [_VERBS[u] for u in uses
                  if not (t.can_swap if u == "swap" else t.can_recompute)]
        forced = actions[t.name] == "keep" and t.bwd_readers and barred
        forced = forced and len(barred) == len(uses)
        if forced:
            reason = f" ({_clause(t.note)})" if t.note else ""
            verbs = " or ".join(barred)
            notes.append(f"{t.name} is kept: it cannot be {verbs}{reason}.")
        elif t.note:
            notes.append(f"{t.name}: {_clause(t.note)}.")
    return notes
