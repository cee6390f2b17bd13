import pytest

from keras_autovm.planner import CostModel
from keras_autovm.planner import POLICIES
from keras_autovm.planner import PlanError
from keras_autovm.planner import TensorSpec
from keras_autovm.planner import make_plan
from keras_autovm.planner import simulate
from keras_autovm.planner.choose import CANDIDATES
from keras_autovm.planner.units import dataflow_chains
from planner_graphs import best_time
from planner_graphs import branched
from planner_graphs import chain
from planner_graphs import conv_chain

COST = CostModel()
OLD = [n for n in CANDIDATES if n != "hybrid"]
RECOMPUTE_ONLY = ("keep", "recompute")


def keep_peak(graph, cost=COST):
    return simulate(graph, {}, None, cost).peak_bytes


def least_peak(graph, policy, allowed):
    with pytest.raises(PlanError) as info:
        make_plan(graph, 1, policy, allowed=allowed)
    return info.value.min_budget


@pytest.mark.parametrize("frac", [0.9, 0.7, 0.5])
@pytest.mark.parametrize("make", [lambda: conv_chain(24), lambda: branched()])
def test_auto_never_slower_than_the_older_policies(make, frac):
    g = make()
    budget = int(keep_peak(g) * frac)
    olds = [POLICIES[n](g, COST, budget) for n in OLD]
    fitting = [p.result.step_time for p in olds if p.fits]
    plan = make_plan(g, budget)
    assert plan.fits
    if fitting:
        assert plan.result.step_time <= min(fitting) + 1e-12


def test_hybrid_fits_where_older_recompute_cannot():
    g = branched()
    budget = int(keep_peak(g) * 0.5)
    hybrid = make_plan(g, budget, "hybrid", allowed=RECOMPUTE_ONLY)
    assert hybrid.fits
    assert not POLICIES["sqrt_recompute"](g, COST, budget).fits
    both = make_plan(g, budget, "hybrid")
    for name in OLD:
        plan = POLICIES[name](g, COST, budget)
        assert not plan.fits or both.result.step_time <= plan.result.step_time


def test_branched_minimum_is_well_below_keep_all():
    # Interleaved branches break the consecutive chains sqrt_recompute
    # needs; the hybrid's dataflow chains still reach them.
    g = branched()
    keep = keep_peak(g)
    old = least_peak(g, "sqrt_recompute", RECOMPUTE_ONLY)
    new = least_peak(g, "auto", RECOMPUTE_ONLY)
    assert old > 0.8 * keep
    assert new < 0.45 * keep
    assert least_peak(g, "auto", ("keep", "swap", "recompute")) < 0.45 * keep


def test_dataflow_chains_follow_branches():
    chains = dataflow_chains(branched(cells=1, branches=2, depth=3))
    assert ["c0b0d0", "c0b0d1", "c0b0d2"] in chains
    assert ["c0b1d0", "c0b1d1", "c0b1d2"] in chains


def test_segments_cover_every_recompute_and_are_chains():
    g = branched()
    plan = make_plan(g, int(keep_peak(g) * 0.4), "hybrid", allowed=RECOMPUTE_ONLY)
    assert plan.counts()["swap"] == 0 and plan.counts()["recompute"] > 0
    inner = {op for seg in plan.segments for op in seg[:-1]}
    for name, action in plan.actions.items():
        assert (action == "recompute") == (name in inner)
    tensors = g.tensor_map
    for seg in plan.segments:
        for a, b in zip(seg, seg[1:]):
            assert tensors[a].fwd_readers == (b,)


def test_hybrid_uses_only_allowed_actions_and_never_swaps_outputs():
    g = branched()
    budget = int(keep_peak(g) * 0.6)
    swap_only = make_plan(g, budget, "hybrid", allowed=("keep", "swap"))
    assert swap_only.counts()["recompute"] == 0
    plan = make_plan(g, 1 + least_peak(g, "hybrid", ("keep", "swap")), "hybrid",
                     allowed=("keep", "swap"))
    assert plan.actions[g.outputs[0]] == "keep"
    assert swap_only.counts()["swap"] > 0


def test_internal_tensors_are_not_swapped():
    g = chain([64 * 2**20] * 6)
    saved = TensorSpec("o2:saved", 8 * 2**20, "o2", (), ("o2",), internal=True)
    g = type(g)(g.ops, g.tensors + (saved,), persistent_bytes=0)
    plan = make_plan(g, int(keep_peak(g) * 0.8), "hybrid",
                     allowed=("keep", "swap"))
    assert plan.actions["o2:saved"] == "keep"
    assert plan.counts()["swap"] > 0


def test_swap_where_hidden_recompute_where_exposed():
    # Slow ops hide a copy: swap is free, recompute is not.
    slow = conv_chain(16)
    budget = int(keep_peak(slow) * 0.7)
    cost = CostModel(flops_per_s=2e12)
    plan = make_plan(slow, budget, "hybrid", cost=cost)
    assert plan.counts()["swap"] > 0 and plan.counts()["recompute"] == 0
    assert plan.result.stall_time == 0
    # A slow link exposes every copy: recompute instead.
    slow_link = CostModel(d2h_bytes_per_s=1e8, h2d_bytes_per_s=1e8)
    plan = make_plan(slow, budget, "hybrid", cost=slow_link)
    assert plan.counts()["recompute"] > 0 and plan.counts()["swap"] == 0


def test_prefetch_early_when_memory_allows_later_when_not():
    g = conv_chain(16)
    cost = CostModel(flops_per_s=2e12, h2d_bytes_per_s=2.5e9, d2h_bytes_per_s=2.5e9)
    index = g.op_index
    keep = keep_peak(g, cost)

    def distances(plan):
        return [index[plan.prefetch[t]] - index[t.replace("a", "conv")] - 1
                for t in plan.prefetch]

    loose = make_plan(g, int(keep * 0.9), "hybrid", cost=cost,
                      allowed=("keep", "swap"))
    assert max(distances(loose)) > 1
    tight = make_plan(g, least_peak(g, "hybrid", ("keep", "swap")) + 1, "hybrid",
                      cost=cost, allowed=("keep", "swap"))
    assert tight.fits and min(distances(tight)) < max(distances(loose))


def test_bounded_copies_in_flight_are_respected():
    g = conv_chain(16)
    cost = CostModel(max_in_flight_bytes=2**20)
    plan = make_plan(g, int(keep_peak(g, cost) * 0.7), "hybrid", cost=cost)
    again = simulate(g, plan.actions, plan.prefetch, cost)
    assert plan.fits and again.peak_bytes == plan.result.peak_bytes


def test_no_budget_keeps_everything():
    plan = make_plan(branched(), None, "hybrid")
    assert plan.counts()["keep"] == len(plan.actions)


def test_hybrid_on_500_branched_ops_is_fast_enough():
    g = branched(cells=20, branches=4, depth=6, base=2**16)
    assert len(g.ops) == 501
    budget = int(keep_peak(g) * 0.4)
    seconds, plan = best_time(lambda: make_plan(g, budget))
    # About 0.3 s here; the bound allows for a loaded 2-core CI machine.
    assert seconds < 6.0
    assert plan.fits
    hybrid = make_plan(g, budget, "hybrid")
    assert hybrid.result.step_time <= plan.result.step_time * 1.001
