"""Policies: pure functions `(graph, cost, budget) -> Plan`.

Each policy decides an action per tagged tensor and, for swapped tensors,
where in backward to start copying them back; the simulator scores the
result. `POLICIES` collects them by name; `make_plan` is the entry point.
"""

import math

from .cost import CostModel
from .graph import ACTIONS
from .graph import Graph
from .plan import Plan
from .plan import PlanError
from .plan import format_bytes
from .simulate import first_backward_use
from .simulate import simulate

# Prefetch distances greedy_offload tries, in ops ahead of the first use.
MAX_PREFETCH_AHEAD = 4


def keep_all(graph, cost, budget):
    """Keeps every tensor on the device (the in-core baseline)."""
    return _finish(graph, cost, budget, "keep_all", {})


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
    needed = first_backward_use(graph, actions)
    for t in graph.tensors:
        kept = t.name not in actions and t.name in needed
        if kept and t.can_swap and t.nbytes:
            actions[t.name] = "swap"
    return _finish(graph, cost, budget, "sqrt_offload", actions,
                   prefetch_ahead(graph, actions, 1), segments=segments,
                   uses=("swap", "recompute"))


def auto(graph, cost, budget, allowed=ACTIONS):
    """The fastest plan within the budget among the allowed policies.

    Args:
        graph: a `Graph`.
        cost: a `CostModel`.
        budget: device memory budget in bytes, or `None` (keep all).
        allowed: actions the backend can carry out. Defaults to all.

    Returns:
        The fitting `Plan` with the lowest predicted step time.

    Raises:
        PlanError: if no candidate fits; `min_budget` is the lowest peak
            any candidate reaches.
    """
    if budget is None:
        return keep_all(graph, cost, budget)
    names = [n for n in CANDIDATES if set(REQUIRES[n]) <= set(allowed)]
    plans = [POLICIES[n](graph, cost, budget) for n in names]
    fitting = [p for p in plans if p.fits]
    if not fitting:
        lowest = min(plans, key=lambda p: p.result.peak_bytes)
        raise PlanError(
            f"No plan fits the budget of {format_bytes(budget)} with actions "
            f"{tuple(allowed)}: the lowest predicted peak is "
            f"{format_bytes(lowest.result.peak_bytes)} ({lowest.policy}).",
            lowest.result.peak_bytes,
        )
    best = min(fitting, key=lambda p: (p.result.step_time, _changed(p)))
    best.notes.append(
        f"auto chose {best.policy}: the fastest of "
        f"{', '.join(p.policy for p in fitting)} within the budget."
    )
    return best


POLICIES = {
    "auto": auto,
    "keep_all": keep_all,
    "offload_all": offload_all,
    "greedy_offload": greedy_offload,
    "sqrt_recompute": sqrt_recompute,
    "sqrt_offload": sqrt_offload,
}

# The actions besides "keep" that each policy needs.
REQUIRES = {
    "auto": (),
    "keep_all": (),
    "offload_all": ("swap",),
    "greedy_offload": ("swap",),
    "sqrt_recompute": ("recompute",),
    "sqrt_offload": ("swap", "recompute"),
}

# What `auto` compares, cheapest-looking first (the order breaks ties).
CANDIDATES = ("keep_all", "greedy_offload", "sqrt_recompute", "offload_all",
              "sqrt_offload")


def make_plan(graph, budget, policy="auto", cost=None, allowed=ACTIONS):
    """Plans one training step of `graph` within a device memory budget.

    Args:
        graph: a `Graph`.
        budget: device memory budget in bytes, or `None` for no limit.
        policy: a name in `POLICIES`. Defaults to `"auto"`.
        cost: a `CostModel`. Defaults to `None` (`CostModel()`).
        allowed: actions the backend can carry out; it must include
            `"keep"`. Defaults to all of `("keep", "swap", "recompute")`.

    Returns:
        A `Plan` whose predicted peak fits the budget.

    Raises:
        ValueError: on a bad argument.
        NotImplementedError: if `policy` needs an action not in `allowed`.
        PlanError: if the plan cannot fit the budget.
    """
    cost = CostModel() if cost is None else cost
    allowed = _check_args(graph, budget, policy, cost, allowed)
    missing = [a for a in REQUIRES[policy] if a not in allowed]
    if missing:
        raise NotImplementedError(
            f"Policy {policy!r} needs the {missing[0]!r} action, which this "
            f"backend does not support (it allows {allowed}). Use "
            f"policy='auto' to plan with the allowed actions."
        )
    if policy == "auto":
        return auto(graph, cost, budget, allowed)
    plan = POLICIES[policy](graph, cost, budget)
    if not plan.fits:
        raise PlanError(
            f"Policy {policy!r} cannot fit the budget of "
            f"{format_bytes(budget)}: its predicted peak is "
            f"{format_bytes(plan.result.peak_bytes)}.",
            plan.result.peak_bytes,
        )
    return plan


def prefetch_ahead(graph, actions, k):
    """Prefetch triggers `k` ops ahead of each swapped tensor's first use.

    Args:
        graph: a `Graph`.
        actions: dict tensor name -> action.
        k: how many ops before the first backward use (in backward order)
            the copy back starts; clamped to the last op.

    Returns:
        Dict swapped tensor name -> op name.
    """
    first = first_backward_use(graph, actions)
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
    cannot be recomputed ends its chain.

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
                  and tensors[link[0]].can_recompute)
        if linked:
            chains[-1].append(op.name)
        else:
            chains.append([op.name])
    return chains


def _segment_actions(graph, segments):
    """Marks every output inside a segment (not its last op's) recompute."""
    inner = {name for seg in segments for name in seg[:-1]}
    return {t.name: "recompute" for t in graph.tensors
            if t.producer in inner and t.can_recompute}


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


def _changed(plan):
    return sum(1 for a in plan.actions.values() if a != "keep")


def _finish(graph, cost, budget, name, actions, prefetch=None, segments=(),
            uses=()):
    """Simulates `actions` (others kept) and wraps them in a `Plan`."""
    actions = {t.name: actions.get(t.name, "keep") for t in graph.tensors}
    prefetch = dict(prefetch or {})
    result = simulate(graph, actions, prefetch, cost)
    return Plan(graph, actions, prefetch, name, budget, cost, result,
                _notes(graph, actions, uses), tuple(segments))


_VERBS = {"swap": "swapped", "recompute": "recomputed"}


def _notes(graph, actions, uses):
    """Why ops are unmanaged and why tensors the policy acts on are kept."""
    notes = [f"{op.name}: {op.note}" for op in graph.ops if op.note]
    for t in graph.tensors:
        barred = [_VERBS[u] for u in uses
                  if not (t.can_swap if u == "swap" else t.can_recompute)]
        forced = actions[t.name] == "keep" and t.bwd_readers and barred
        forced = forced and len(barred) == len(uses)
        if forced:
            reason = f": {t.note}" if t.note else "."
            verbs = " or ".join(barred)
            notes.append(f"{t.name} kept: cannot be {verbs}{reason}")
        elif t.note:
            notes.append(f"{t.name}: {t.note}")
    return notes


def _check_args(graph, budget, policy, cost, allowed):
    """Validates `make_plan`'s arguments; returns `allowed` as a tuple."""
    if not isinstance(graph, Graph):
        raise ValueError(
            f"Argument `graph` must be a Graph, received: graph={graph!r}"
        )
    bad = isinstance(budget, bool) or not (
        budget is None or (isinstance(budget, (int, float)) and budget >= 0))
    if bad:
        raise ValueError(
            "Argument `budget` must be a non-negative number of bytes or "
            f"None, received: budget={budget!r}"
        )
    if policy not in POLICIES:
        raise ValueError(
            f"Argument `policy` must be one of {sorted(POLICIES)}, "
            f"received: policy={policy!r}"
        )
    if not isinstance(cost, CostModel):
        raise ValueError(
            f"Argument `cost` must be a CostModel, received: cost={cost!r}"
        )
    allowed = tuple(allowed)
    if "keep" not in allowed or not set(allowed) <= set(ACTIONS):
        raise ValueError(
            f"Argument `allowed` must include 'keep' and only actions from "
            f"{ACTIONS}, received: allowed={allowed!r}"
        )
    return allowed
