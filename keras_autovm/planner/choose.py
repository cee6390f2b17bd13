"""Choosing a plan: `make_plan`, the `auto` policy that compares the
others, and the registry of policies by name.

Pure standard-library Python, no framework imports.
"""

import dataclasses

from .cost import CostModel
from .graph import ACTIONS
from .graph import Graph
from .plan import PlanError
from .plan import format_bytes
from .hybrid import hybrid
from .policies import greedy_offload
from .policies import keep_all
from .policies import offload_all
from .policies import sqrt_offload
from .policies import sqrt_recompute
from .simulate import simulate


def auto(graph, cost, budget, allowed=ACTIONS, bounds=()):
    """The fastest plan within the budget among the allowed policies.

    Where none fits and plans may swap, the policies run again under each
    of `bounds` in turn, a bound on the bytes of copies to host in flight
    (`CostModel.max_in_flight_bytes`): a forward that waits for its copies
    frees swapped outputs sooner, at the price of the wait. The plan's
    `cost` carries the bound it was made with, which the mechanisms
    enforce.

    Args:
        graph: a `Graph`.
        cost: a `CostModel`.
        budget: device memory budget in bytes, or `None` (keep all).
        allowed: actions the backend can carry out. Defaults to all.
        bounds: the bounds to try after the cost's own, tightest last
            (`in_flight_bounds` makes them). Defaults to none.

    Returns:
        The fitting `Plan` with the lowest predicted step time; where none
        fits, but a search under a larger limit (`_least`) reached a peak
        within the budget, that plan, with a note.

    Raises:
        PlanError: if no candidate fits, under this budget or, searching
            lower (`_least`), under a larger one; `min_budget` is the least
            limit the candidates are seen to plan for: the lowest peak any
            reaches, or above it (see `_checked`).
    """
    if budget is None:
        return keep_all(graph, cost, budget)
    names = [n for n in CANDIDATES if set(REQUIRES[n]) <= set(allowed)]
    tries = bounded_costs(cost, allowed, bounds)
    for tried in tries:
        plans = [_run(n, graph, tried, budget, allowed) for n in names]
        fitting = [p for p in plans if p.fits]
        if fitting:
            break
    if not fitting:
        least, lowest = _least(graph, tried, budget, allowed, names,
                               min(plans, key=lambda p: p.result.peak_bytes))
        if lowest.result.peak_bytes > budget:
            raise PlanError(
                f"No plan fits the limit of {format_bytes(budget)} with actions "
                f"{tuple(allowed)}{_bounded(tried.max_in_flight_bytes, len(tries) > 1)}: "
                f"the lowest predicted peak is {format_bytes(lowest.result.peak_bytes)} "
                f"({lowest.policy}).",
                least,
            )
        # A greedy path depends on its limit: planning for a larger one, a
        # candidate reached a peak within this one (on an H200, a refusal
        # had stated a least limit of 4.66 GiB for a limit of 4.75 GiB).
        fitting = [dataclasses.replace(lowest, budget=budget, notes=lowest.notes + [
            "auto found this plan searching under a larger limit: under the "
            "limit itself no search reached it."])]
    best = min(fitting, key=lambda p: (p.result.step_time, _changed(p)))
    if tried.max_in_flight_bytes != cost.max_in_flight_bytes:
        best.notes.append(
            f"auto bounded the copies to host in flight to "
            f"{format_bytes(tried.max_in_flight_bytes)} "
            f"(from {_bound_text(cost.max_in_flight_bytes)}): no plan fit with "
            f"the forward running further ahead of its copies.")
    if len(fitting) == 1:
        best.notes.append(f"auto chose {best.policy}, the only candidate "
                          f"within the limit.")
    else:
        best.notes.append(
            f"auto chose {best.policy}, the fastest of "
            f"{', '.join(p.policy for p in fitting)} within the limit.")
    return best


POLICIES = {
    "auto": auto,
    "keep_all": keep_all,
    "offload_all": offload_all,
    "greedy_offload": greedy_offload,
    "sqrt_recompute": sqrt_recompute,
    "sqrt_offload": sqrt_offload,
    "hybrid": hybrid,
}

# Policies that adapt to the actions the backend allows (`allowed`).
ADAPTIVE = ("hybrid",)

# The actions besides "keep" that each policy needs.
REQUIRES = {
    "auto": (),
    "keep_all": (),
    "offload_all": ("swap",),
    "greedy_offload": ("swap",),
    "sqrt_recompute": ("recompute",),
    "sqrt_offload": ("swap", "recompute"),
    "hybrid": (),
}

# What `auto` compares, cheapest-looking first (the order breaks ties).
CANDIDATES = ("keep_all", "hybrid", "greedy_offload", "sqrt_recompute",
              "offload_all", "sqrt_offload")


# How far ahead of its copies to host, in seconds of the link, the forward
# may run under the bounds `in_flight_bounds` offers; 0: it waits for each.
TIGHTER_IN_FLIGHT_SECONDS = (0.05, 0.0125, 0.0)


def bounded_costs(cost, allowed, bounds):
    """`cost`, then a copy of it under each of `bounds` (a bound on copies
    to host in flight) where plans may swap: what `auto` tries in turn."""
    tried = [cost.max_in_flight_bytes] + (list(bounds) if "swap" in allowed else [])
    return [dataclasses.replace(cost, max_in_flight_bytes=b) for b in tried]


def _bound_text(bound):
    return "no bound" if bound is None else format_bytes(bound)


def _bounded(bound, tightened):
    """How a refusal's figures were reached, where `auto` tightened the
    bound on copies in flight to get them."""
    return f" and copies to host in flight bounded to {_bound_text(bound)}" if tightened else ""


def in_flight_bounds(cost):
    """The bounds on copies to host in flight, tighter than `cost`'s own
    (`None`: no bound), that `auto` may plan with where nothing fits, for a
    backend whose forward can wait for its copies."""
    own = cost.max_in_flight_bytes
    bounds = (cost.d2h_bytes_per_s * s for s in TIGHTER_IN_FLIGHT_SECONDS)
    return tuple(b for b in bounds if own is None or b < own)


def repredicted(plan, cost):
    """`plan`, its actions and prefetches kept, simulated again with the
    compute times of `cost` (`time_scale` and `fwd_scale`, which calibration
    learns); its own link figures and bounds stay. A plan left in force
    after calibration is then compared, and calibrated again, against what
    it is now predicted to cost, not what it was."""
    scales = {"time_scale": cost.time_scale, "fwd_scale": cost.fwd_scale}
    own = dataclasses.replace(plan.cost, **scales)
    held = plan.unchanged and own.holds_outputs
    result = simulate(plan.graph, plan.actions, plan.prefetch, own, hold_outputs=held)
    if plan.unchanged:  # Its peak is the framework's own figure (JAX: XLA's).
        result = dataclasses.replace(result, peak_bytes=plan.result.peak_bytes)
    return dataclasses.replace(plan, cost=own, result=result)


def make_plan(graph, budget, policy="auto", cost=None, allowed=ACTIONS, bounds=()):
    """Plans one training step of `graph` within a device memory budget.

    Args:
        graph: a `Graph`.
        budget: device memory budget in bytes, or `None` for no limit.
        policy: a name in `POLICIES`. Defaults to `"auto"`.
        cost: a `CostModel`. Defaults to `None` (`CostModel()`).
        allowed: actions the backend can carry out; it must include
            `"keep"`. Defaults to all of `("keep", "swap", "recompute")`.
        bounds: for `"auto"`, the tighter bounds on copies to host in
            flight to plan with where none fits (`in_flight_bounds`).
            Defaults to none.

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
        return auto(graph, cost, budget, allowed, bounds)
    plan = _run(policy, graph, cost, budget, allowed)
    if not plan.fits:
        raise PlanError(
            f"Policy {policy!r} cannot fit the budget of "
            f"{format_bytes(budget)}: its predicted peak is "
            f"{format_bytes(plan.result.peak_bytes)}.",
            plan.result.peak_bytes,
        )
    return plan


def _least(graph, cost, budget, allowed, names, lowest):
    """`(least limit, lowest-peak plan)` of the candidates `names`, from
    `lowest`, the lowest they reached under `budget`. Searches that stop
    once they fit can reach a lower peak from a budget just under the
    lowest seen than from a far smaller one (a greedy path depends on its
    start), so the budget steps down to just under each new lowest until no
    candidate fits. The least limit is then the lowest peak, checked by
    planning with it as the limit (`_checked`), so that a `PlanError`
    states a budget that plans."""
    found_at = None  # A limit the lowest-peak plan was planned under.
    while lowest.result.peak_bytes - 1 > budget:
        below = lowest.result.peak_bytes - 1
        plans = (_run(n, graph, cost, below, allowed, least=True) for n in names)
        fitting = [p for p in plans if p.fits]
        if not fitting:
            break
        lowest, found_at = min(fitting, key=lambda p: p.result.peak_bytes), below
    return _checked(graph, cost, allowed, names, lowest.result.peak_bytes,
                    found_at), lowest


def _checked(graph, cost, allowed, names, limit, known=None):
    """The least limit from `limit` up that some candidate plans for, or
    `known` (one that did) if that comes first. A plan found under one
    limit may not be found with its own peak as the limit, since the
    greedy's path depends on the limit; each failed try raises the limit to
    the lowest peak it reached, up to keeping everything, which fits."""
    while known is None or limit < known:
        plans = [_run(n, graph, cost, limit, allowed, least=True) for n in names]
        if any(p.fits for p in plans):
            return limit
        limit = min(p.result.peak_bytes for p in plans)
    return known


def _run(name, graph, cost, budget, allowed, least=False):
    """Runs one policy; adaptive ones get the allowed actions (and, with
    `least`, seek the lowest peak rather than the fastest step)."""
    if name in ADAPTIVE:
        return POLICIES[name](graph, cost, budget, allowed, least=least)
    return POLICIES[name](graph, cost, budget)


def _changed(plan):
    """How many tensors a plan does not keep (fewer breaks ties)."""
    return sum(1 for a in plan.actions.values() if a != "keep")


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
