import dataclasses
import json
import math
import time

import pytest

from keras_autovm.planner import POLICIES
from keras_autovm.planner import CostModel
from keras_autovm.planner import Graph
from keras_autovm.planner import PlanError
from keras_autovm.planner import TensorSpec
from keras_autovm.planner import in_flight_bounds
from keras_autovm.planner import make_plan
from keras_autovm.planner.graph import ACTIONS
from keras_autovm.planner.choose import CANDIDATES
from keras_autovm.planner.policies import chain_segments
from planner_graphs import chain
from planner_graphs import conv_chain

COST = CostModel()


def peak(name, graph, budget=None):
    return POLICIES[name](graph, COST, budget).result.peak_bytes


def test_offload_all_lowers_peak():
    g = conv_chain(16)
    keep = make_plan(g, None, "keep_all")
    off = make_plan(g, None, "offload_all")
    assert off.result.peak_bytes < keep.result.peak_bytes
    # Every tensor read in backward is swapped; the output (no readers) kept.
    assert off.counts() == {"keep": 1, "swap": 15, "recompute": 0}
    assert off.actions["a15"] == "keep"
    # One op ahead of the first backward reader (conv{i+1}): conv{i+2}.
    assert off.prefetch["a0"] == "conv2"
    assert off.prefetch["a14"] == "conv15"  # Clamped to the last op.
    assert keep.counts()["keep"] == 16 and keep.prefetch == {}


def test_greedy_fits_between_with_fewer_swaps():
    g = conv_chain(16)
    keep, off = peak("keep_all", g), peak("offload_all", g)
    budget = (keep + off) // 2
    plan = make_plan(g, budget, "greedy_offload")
    assert plan.fits and plan.result.peak_bytes <= budget
    swaps = plan.counts()["swap"]
    assert 0 < swaps < make_plan(g, None, "offload_all").counts()["swap"]
    # The biggest, longest-idle tensors go first: the earliest ones.
    swapped = {n for n, a in plan.actions.items() if a == "swap"}
    assert swapped == {f"a{i}" for i in range(swaps)}
    assert plan.result.stall_time == 0
    assert set(plan.prefetch) == swapped


def test_greedy_swaps_nothing_when_it_fits():
    g = conv_chain(8)
    plan = make_plan(g, 2**40, "greedy_offload")
    assert plan.counts()["swap"] == 0


def test_sqrt_recompute_segments():
    g = conv_chain(16)
    plan = make_plan(g, None, "sqrt_recompute")
    # sqrt(16) = 4: four segments of four ops.
    assert [len(s) for s in plan.segments] == [4, 4, 4, 4]
    assert plan.segments[1] == ("conv4", "conv5", "conv6", "conv7")
    # All but each segment's last output is recomputed.
    assert plan.counts() == {"keep": 4, "swap": 0, "recompute": 12}
    assert plan.actions["a3"] == "keep" and plan.actions["a2"] == "recompute"
    assert plan.result.peak_bytes < peak("keep_all", g)
    assert plan.result.recompute_time > 0


def test_segments_stop_at_branches_and_unrecomputable_tensors():
    g = chain([1] * 10)
    # A second forward reader (o9) of t4 ends the chain after o4 and makes
    # o9 (two inputs) a chain of its own: o0..o4, o5..o8, o9. Segments of
    # about round(sqrt(10)) = 3 ops; one-op segments are dropped.
    t4 = g.tensors[4]
    branched = TensorSpec("t4", 1, "o4", ("o5", "o9"), ("o5",))
    g2 = Graph(g.ops, g.tensors[:4] + (branched,) + g.tensors[5:])
    assert chain_segments(g2) == (("o0", "o1", "o2"), ("o3", "o4"),
                                  ("o5", "o6"), ("o7", "o8"))
    pinned = TensorSpec(t4.name, 1, "o4", t4.fwd_readers, t4.bwd_readers,
                        can_recompute=False, note="custom op")
    g3 = Graph(g.ops, g.tensors[:4] + (pinned,) + g.tensors[5:])
    plan = make_plan(g3, None, "sqrt_recompute")
    assert plan.actions["t4"] == "keep"
    assert all(not ({"o4", "o5"} <= set(s)) for s in plan.segments)


def test_sqrt_segment_length_scales_with_n():
    segs = chain_segments(chain([1] * 100))
    assert [len(s) for s in segs] == [10] * 10
    segs = chain_segments(chain([1] * 30))
    # round(sqrt(30)) = 5: six segments of five.
    assert [len(s) for s in segs] == [5] * 6


def test_auto_keeps_all_when_budget_is_large():
    g = conv_chain(16)
    assert make_plan(g, 2**40).policy == "keep_all"
    assert make_plan(g, None).policy == "keep_all"
    assert make_plan(g, None).counts()["keep"] == 16


def test_auto_picks_fastest_fitting():
    g = conv_chain(16)
    budget = (peak("keep_all", g) + peak("offload_all", g)) // 2
    plan = make_plan(g, budget)
    assert plan.fits
    others = [POLICIES[n](g, COST, budget) for n in CANDIDATES]
    fastest = min(p.result.step_time for p in others if p.fits)
    assert plan.result.step_time == fastest


def test_plan_error_states_min_budget():
    g = conv_chain(16)
    with pytest.raises(PlanError, match="smallest feasible budget") as info:
        make_plan(g, 1000)
    lowest = min(peak(n, g, 1000) for n in CANDIDATES)
    assert info.value.min_budget == lowest
    assert lowest < peak("keep_all", g)
    assert f"({lowest} bytes)" in str(info.value)
    assert isinstance(info.value, ValueError)
    # The stated minimum is honest: planning with it succeeds.
    plan = make_plan(g, info.value.min_budget)
    assert plan.result.peak_bytes <= info.value.min_budget


@pytest.mark.parametrize("allowed", [("keep", "recompute"), ("keep", "swap"), ACTIONS])
@pytest.mark.parametrize("make", [lambda: conv_chain(16), lambda: conv_chain(24)])
def test_the_stated_min_budget_plans_with_any_actions(make, allowed):
    # A greedy path depends on its budget: the plan of the lowest peak was
    # found under a larger one, and with keep and recompute on this chain,
    # planning with its peak as the budget found none (stated before the
    # check: 27262976 bytes; what plans is 28311552).
    g = make()
    with pytest.raises(PlanError) as info:
        make_plan(g, 1000, allowed=allowed)
    plan = make_plan(g, info.value.min_budget, allowed=allowed)
    assert plan.result.peak_bytes <= info.value.min_budget


# Two big early outputs, copied out at 100 B/s (10 s each) while each
# forward takes 0.1 s: the forward outruns its copies unless it waits.
AHEAD = chain([1000, 1000, 900, 900, 900, 10, 1], fwd_times=[0.1] * 7)


def _slow_link(bound):
    return CostModel(d2h_bytes_per_s=100, h2d_bytes_per_s=100, max_in_flight_bytes=bound)


def test_auto_tightens_the_bound_on_copies_in_flight_to_fit():
    allowed, cost = ("keep", "swap"), _slow_link(None)
    # Unbounded, the swapped outputs are still on the device at the peak.
    with pytest.raises(PlanError) as unbounded:
        make_plan(AHEAD, 4000, cost=cost, allowed=allowed)
    assert unbounded.value.min_budget > 4000
    plan = make_plan(AHEAD, 4000, cost=cost, allowed=allowed, bounds=(2500, 0))
    assert plan.fits and plan.result.d2h_wait_time > 0
    assert plan.cost.max_in_flight_bytes == 2500  # The first that fits.
    assert any("bounded the copies to host in flight" in n for n in plan.notes)
    # A refusal states the least budget of the tightest bound, which plans.
    with pytest.raises(PlanError, match="in flight bounded to 0 B") as error:
        make_plan(AHEAD, 1000, cost=cost, allowed=allowed, bounds=(2500, 0))
    assert error.value.min_budget < unbounded.value.min_budget
    assert make_plan(AHEAD, error.value.min_budget, cost=cost, allowed=allowed,
                     bounds=(2500, 0)).fits


def test_auto_keeps_the_bound_where_a_plan_fits_with_it():
    plan = make_plan(AHEAD, 10_000, cost=_slow_link(None), allowed=("keep", "swap"),
                     bounds=(2500, 0))
    assert plan.cost.max_in_flight_bytes is None
    assert not any("in flight" in n for n in plan.notes)
    # Without swap there is nothing to bound: the same refusal either way.
    refusals = []
    for bounds in ((), (2500, 0)):
        with pytest.raises(PlanError) as error:
            make_plan(AHEAD, 1000, cost=_slow_link(None), allowed=("keep", "recompute"),
                      bounds=bounds)
        refusals.append((str(error.value), error.value.min_budget))
    assert refusals[0] == refusals[1]
    assert "in flight" not in refusals[0][0]


def test_in_flight_bounds_are_tighter_than_the_costs_own():
    link = CostModel(d2h_bytes_per_s=1000)
    assert in_flight_bounds(link) == (50, 12.5, 0)
    assert in_flight_bounds(dataclasses.replace(link, max_in_flight_bytes=50)) == (12.5, 0)
    assert in_flight_bounds(dataclasses.replace(link, max_in_flight_bytes=0)) == ()


def test_explicit_policy_over_budget():
    g = conv_chain(8)
    keep = peak("keep_all", g)
    with pytest.raises(PlanError, match="keep_all") as info:
        make_plan(g, keep - 1, "keep_all")
    assert info.value.min_budget == keep


def test_recompute_only_backend_never_swaps():
    g = conv_chain(16)
    budget = peak("sqrt_recompute", g) + 1
    plan = make_plan(g, budget, allowed=("keep", "recompute"))
    assert plan.fits and plan.counts()["swap"] == 0
    assert plan.counts()["recompute"] > 0
    with pytest.raises(PlanError) as info:
        make_plan(g, 1000, allowed=("keep", "recompute"))
    # The hybrid splits the chain finer than sqrt_recompute's segments. The
    # budget stated is the least that plans, from the lowest peak seen up.
    lowest = POLICIES["hybrid"](g, COST, 1000, ("keep", "recompute")).result.peak_bytes
    assert lowest <= info.value.min_budget < peak("sqrt_recompute", g)
    assert make_plan(g, info.value.min_budget, allowed=("keep", "recompute")).fits
    with pytest.raises(NotImplementedError, match="'swap'"):
        make_plan(g, budget, "offload_all", allowed=("keep", "recompute"))


def test_bad_arguments():
    g = conv_chain(4)
    with pytest.raises(ValueError, match="policy=.*'fastest'") as info:
        make_plan(g, None, "fastest")
    assert "greedy_offload" in str(info.value)
    with pytest.raises(ValueError, match="budget"):
        make_plan(g, -1)
    with pytest.raises(ValueError, match="budget"):
        make_plan(g, "16GiB")
    with pytest.raises(ValueError, match="allowed"):
        make_plan(g, None, allowed=("swap",))
    with pytest.raises(ValueError, match="cost"):
        make_plan(g, None, cost="fast")


def test_actions_respect_flags_and_notes_explain():
    g = conv_chain(8)
    pinned = TensorSpec("a0", g.tensors[0].nbytes, "conv0", ("conv1",),
                        ("conv1",), can_swap=False, note="dynamic shape")
    g2 = Graph(g.ops, (pinned,) + g.tensors[1:], g.persistent_bytes)
    plan = make_plan(g2, None, "offload_all")
    assert plan.actions["a0"] == "keep"
    assert any("a0" in n and "dynamic shape" in n for n in plan.notes)
    greedy = make_plan(g2, 0.9 * peak("keep_all", g2), "greedy_offload")
    assert greedy.actions["a0"] == "keep"


def test_plan_report_api():
    g = conv_chain(8)
    plan = make_plan(g, peak("offload_all", g) + 1, "greedy_offload")
    lines = []
    plan.summary(print_fn=lines.append, line_length=80)
    text = "\n".join(lines)
    assert sum(1 for line in lines if line.startswith("a")) == 8
    assert "swap" in text and "Predicted peak" in text
    assert "greedy_offload" in text and "MiB" in text
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["counts"] == plan.counts()
    assert data["predicted"]["peak_bytes"] == plan.result.peak_bytes
    assert [t["action"] for t in data["tensors"]] == list(plan.actions.values())


def test_auto_on_500_ops_is_fast_enough():
    g = conv_chain(500, base=2**16)
    budget = (peak("keep_all", g) + peak("offload_all", g)) // 2
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        plan = make_plan(g, budget)
        rounds.append(time.perf_counter() - start)
    # About 0.2 s here. Best of three, with a bound loose enough for a 2-core
    # CI machine that other work slows 20x (seen once in the torch suite).
    assert min(rounds) < 6.0
    assert plan.fits
    assert math.isfinite(plan.result.step_time)


@pytest.mark.parametrize("budget, unchanged, peak", [
    (None, True, 121), (121, True, 121), (120, False, 110), (110, False, 110)])
def test_keep_all_leaves_the_step_unchanged_where_holding_outputs_fits(
        budget, unchanged, peak):
    from test_planner_simulate import early_free_graph
    cost = CostModel(holds_outputs=True)
    plan = make_plan(early_free_graph(), budget, policy="keep_all", cost=cost)
    assert (plan.unchanged, plan.result.peak_bytes) == (unchanged, peak)
    assert plan.to_dict()["unchanged"] is unchanged
    assert ("runs unchanged" in plan.notes[-1]) is unchanged
    # A backend whose step frees outputs itself is never "unchanged".
    plain = make_plan(early_free_graph(), budget, policy="keep_all")
    assert (plain.unchanged, plain.result.peak_bytes) == (False, 110)


def test_a_plan_predicted_again_keeps_its_actions_link_and_bound():
    from keras_autovm.planner import make_plan
    from keras_autovm.planner import repredicted

    graph = conv_chain(8)
    cost = CostModel(d2h_bytes_per_s=2**30, h2d_bytes_per_s=2**30, max_in_flight_bytes=2**20)
    plan = make_plan(graph, None, policy="offload_all", cost=cost)
    slower = dataclasses.replace(CostModel(), time_scale=3.0, fwd_scale=2.0)
    again = repredicted(plan, slower)
    assert again.actions == plan.actions and again.prefetch == plan.prefetch
    assert again.cost == dataclasses.replace(cost, time_scale=3.0, fwd_scale=2.0)
    assert again.result.compute_time > 2 * plan.result.compute_time
    assert repredicted(plan, cost).result == plan.result


def test_auto_returns_a_plan_found_under_a_larger_limit(monkeypatch):
    # A candidate whose search, like a greedy one, depends on its limit:
    # under a tight one it reaches only keeping everything, under a larger
    # one it offloads. Asked for a limit between, auto used to refuse while
    # stating a lowest peak (or, on an H200, a least limit) within it.
    from keras_autovm.planner import choose
    g = conv_chain(16)
    low = peak("offload_all", g)

    def path_dependent(graph, cost, budget):
        if budget is not None and budget < low + 100:
            return POLICIES["keep_all"](graph, cost, budget)
        return dataclasses.replace(POLICIES["offload_all"](graph, cost, budget),
                                   policy="path_dependent")

    monkeypatch.setitem(choose.POLICIES, "path_dependent", path_dependent)
    monkeypatch.setitem(choose.REQUIRES, "path_dependent", ())
    monkeypatch.setattr(choose, "CANDIDATES", ("keep_all", "path_dependent"))
    plan = make_plan(g, low + 50)
    assert plan.fits and plan.budget == low + 50
    assert plan.policy == "path_dependent" and plan.result.peak_bytes == low
    assert any("under a larger limit" in n for n in plan.notes)
    with pytest.raises(PlanError) as info:  # Below its peak: still refused.
        make_plan(g, low - 1)
    assert info.value.min_budget > low - 1
