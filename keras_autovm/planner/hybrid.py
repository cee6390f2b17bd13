"""The hybrid policy: keep, swap and recompute chosen from the timeline.

In the spirit of PoocH (a hybrid of swapping and recomputing): start from
keeping everything and, while the simulated peak is over the budget, act
on what is live at the peak, cheapest per byte first. A swap costs the
part of its round trip that compute cannot hide (its idle window in the
keep-all timeline, and the link time already taken by other swaps); a
recompute unit costs its ops' forward times. Swapped tensors come back as
early as the timeline needs to hide the copy and the copies queued after
it on the link, later where that early copy is what breaks the budget.
Then a local search undoes actions, moves prefetches earlier and trades
swap for recompute wherever the simulated step gets faster within the
budget. This module chooses among searches (`search.py` runs each).

Pure standard-library Python, no framework imports.
"""

from .graph import ACTIONS
from .policies import _finish
from .search import search
from .simulate import simulate


def hybrid(graph, cost, budget, allowed=ACTIONS, least=False):
    """Keeps, swaps and recomputes per tensor for the fastest simulated step.

    Uses only the actions in `allowed`. Model outputs and tensors saved
    inside their producer are never swapped; recomputation replays pieces
    of dataflow chains (`units.dataflow_chains`), which become the plan's
    segments. Where the backend recomputes by name and does not swap
    (`_by_name`), runs of regions between cuts are tried too, of equal
    counts of regions and of equal bytes (`units.region_units`), and the
    best plan is kept; such a plan has no segments. With no budget, or if
    everything fits, nothing changes.

    Args:
        graph: a `Graph`.
        cost: a `CostModel`; `max_in_flight_bytes` bounds the copies to
            host, as the backend does.
        budget: bytes, or `None`.
        allowed: the actions the backend can carry out. Defaults to all.
        least: whether to seek the lowest peak instead: no local search
            for speed, and the plan of the lowest peak seen is returned
            (how `auto` finds the least budget a `PlanError` states).
            Defaults to `False`.

    Returns:
        A `Plan`: the fastest fitting one found, or, if none fits (or with
        `least`), the one with the lowest peak.
    """
    base = simulate(graph, {}, None, cost)
    if budget is None or base.peak_bytes <= budget:
        return _finish(graph, cost, budget, "hybrid", {})
    found = search(graph, cost, budget, allowed, base, least=least)
    if not found.best_fits() and {"swap", "recompute"} <= set(allowed):
        # Swaps whose copies lag free nothing in time; without them the
        # greedy may split recompute units further.
        alone = search(graph, cost, budget, ("keep", "recompute"), base,
                        least=least)
        if alone.best_fits() or \
                alone.best[2].peak_bytes < found.best[2].peak_bytes:
            found = alone
    for regions in ("counts", "bytes") if _by_name(graph, cost, allowed) else ():
        runs = search(graph, cost, budget, allowed, base, regions, least)
        if found.better(runs.best, found.best, budget):
            found = runs
    actions, prefetch, _ = found.best
    segments = [] if found.regions else sorted(
        (u.segment for u in found.units_of(found.best_chosen) if u.kind == "recompute"),
        key=lambda s: found.index[s[0]])
    plan = _finish(graph, cost, budget, "hybrid", actions, prefetch,
                   segments=segments,
                   uses=tuple(a for a in ("swap", "recompute") if a in allowed))
    plan.region_runs = bool(found.regions) and "recompute" in actions.values()
    if plan.region_runs:
        plan.notes.append(f"hybrid recomputes runs of regions cut by {found.regions}.")
    return plan


def _by_name(graph, cost, allowed):
    """Whether recompute units may be runs of regions: the backend makes
    again whatever is not kept (JAX under jit), instead of replaying chains
    of layers, the plan does not swap (on JAX a plan that swaps runs
    without jit, replaying its segments), and the graph branches (on a
    chain, runs of regions are the chains' pieces; its plans keep their
    layers' own checkpoints, `JaxMechanism.call_layer`)."""
    branches = any(len(t.fwd_readers) > 1 for t in graph.tensors)
    return (branches and not cost.replay_segments and "recompute" in allowed
            and "swap" not in allowed)


