import dataclasses
import time

import pytest

from keras_autovm.planner import CostModel
from keras_autovm.planner import Graph
from keras_autovm.planner import simulate
from planner_graphs import chain
from planner_graphs import memory_at
from planner_graphs import op
from planner_graphs import tensor

# Copies of 100 bytes take 1 s at 100 B/s: easy arithmetic.
SLOW_LINK = CostModel(d2h_bytes_per_s=100, h2d_bytes_per_s=100)


def test_chain_keep_all_exact_peak():
    g = chain([100, 10, 1], persistent=1000)
    r = simulate(g)
    # fwd o0 [0,1] +t0, o1 [1,2] +t1, o2 [2,3] +t2 (freed at 3: no readers).
    # bwd o2 [3,5]: +g(t2) +g(t1) -> 1000+100+10+1+10 = 1121; at 5 free t1
    # and g(t2); bwd o1 [5,7]: +g(t0) -> 1000 + t0 + g(t1) + g(t0) = 1210.
    assert r.peak_bytes == 1210
    assert r.peak_time == 5.0
    assert memory_at(r, 4.0) == 1121
    live = {(kind, name): n for kind, name, n in r.peak_live}
    assert live == {("persistent", ""): 1000, ("activation", "t0"): 100,
                    ("gradient", "t0"): 100, ("gradient", "t1"): 10}
    # 3 forwards of 1 s and 3 backwards of 2 s.
    assert r.step_time == r.compute_time == 9.0
    assert r.recompute_time == r.stall_time == 0
    assert r.timeline[0] == (0.0, 1000) and r.timeline[-1] == (9.0, 1000)
    times = [t for t, _ in r.timeline]
    assert times == sorted(times)
    assert [(e.op, e.phase) for e in r.op_events] == [
        ("o0", "fwd"), ("o1", "fwd"), ("o2", "fwd"),
        ("o2", "bwd"), ("o1", "bwd"), ("o0", "bwd")]


def boundary_graph():
    # Peak at the forward/backward boundary, where the big t2 and its
    # gradient meet: t0=100, t1=10, t2=200, t3=1 (output).
    return chain([100, 10, 200, 1])


def test_keep_all_boundary_peak():
    r = simulate(boundary_graph())
    # bwd o3 starts at 4: t0+t1+t2 + g(t3) + g(t2) = 310 + 1 + 200.
    assert (r.peak_bytes, r.peak_time) == (511, 4.0)


def test_swap_lowers_peak_without_stall():
    r = simulate(boundary_graph(), {"t0": "swap"}, cost=SLOW_LINK)
    # D2H of t0 [1,2] ends with o1's forward: t0 leaves the device at 2, so
    # at 4 only 10+200+1+200 = 411. Default prefetch is at o2 (one op ahead
    # of its reader o1): H2D [6,7] while bwd o2 runs [6,8]; no stall.
    assert r.peak_bytes == 411
    assert r.stall_time == 0
    assert r.step_time == 12.0
    assert (r.d2h_bytes, r.h2d_bytes) == (100, 100)
    copies = [(c.tensor, c.direction, c.start, c.end) for c in r.copy_events]
    assert copies == [("t0", "d2h", 1.0, 2.0), ("t0", "h2d", 6.0, 7.0)]
    # bwd o2 at 6..8: t1 + g(t2) + t0 back + g(t1) = 10+200+100+10.
    assert memory_at(r, 7.0) == 320


def test_slow_copy_back_stalls_exactly():
    cost = CostModel(d2h_bytes_per_s=100, h2d_bytes_per_s=25)
    r = simulate(boundary_graph(), {"t0": "swap"}, cost=cost)
    # H2D takes 4 s from 6: bwd o1 waits from 8 to 10.
    assert r.stall_time == 2.0
    assert r.stalls == {"t0": 2.0}
    assert r.step_time == 14.0
    bwd_o1 = [e for e in r.op_events if (e.op, e.phase) == ("o1", "bwd")][0]
    assert (bwd_o1.start, bwd_o1.end) == (10.0, 12.0)


def test_earlier_prefetch_removes_stall_but_costs_memory():
    cost = CostModel(d2h_bytes_per_s=100, h2d_bytes_per_s=25)
    r = simulate(boundary_graph(), {"t0": "swap"}, {"t0": "o3"}, cost)
    # Issued when bwd o3 starts (4): H2D [4,8], ready when bwd o1 starts at 8,
    # but t0 is back on the device at the boundary peak: 511 again.
    assert r.stall_time == 0
    assert r.step_time == 12.0
    assert r.peak_bytes == 511


def test_slow_copy_out_keeps_device_copy():
    cost = CostModel(d2h_bytes_per_s=20, h2d_bytes_per_s=100)
    r = simulate(boundary_graph(), {"t0": "swap"}, cost=cost)
    # D2H [1,6] is still running at 4, so t0 is still on the device.
    assert r.peak_bytes == 511
    # The copy back cannot start before the copy out ends: issued at 6,
    # runs [6,7].
    h2d = [c for c in r.copy_events if c.direction == "h2d"][0]
    assert (h2d.start, h2d.end) == (6.0, 7.0)


def test_recompute_chain_exact_times():
    g = chain([100, 10, 200, 1], fwd_times=[1.0, 0.5, 1.0, 1.0])
    r = simulate(g, {"t0": "recompute", "t1": "recompute"})
    # Forward ends at 3.5. bwd o3 [3.5,5.5]; bwd o2 needs t1, whose producer
    # needs t0: recompute o0 [5.5,6.5] then o1 [6.5,7.0]; bwd o2 [7,9], o1
    # [9,11], o0 [11,13].
    assert r.recompute_time == 1.5
    assert r.compute_time == 11.5
    assert r.step_time == 13.0
    phases = [(e.op, e.phase, e.start) for e in r.op_events[4:]]
    assert phases == [("o3", "bwd", 3.5), ("o0", "recompute", 5.5),
                      ("o1", "recompute", 6.5), ("o2", "bwd", 7.0),
                      ("o1", "bwd", 9.0), ("o0", "bwd", 11.0)]
    # At 3.5 only t2 + g(t3) + g(t2): t0 and t1 were dropped after forward.
    assert (r.peak_bytes, r.peak_time) == (401, 3.5)
    # bwd o2: g(t2) + recomputed t0, t1 + g(t1) = 200+100+10+10.
    assert memory_at(r, 8.0) == 320
    # t1 is freed after its only backward use (o2); t0 lives to bwd o1.
    assert memory_at(r, 10.0) == 100 + 100 + 10


def test_recompute_once_per_segment():
    # Three recomputed tensors in a row: one replay of o0..o2 serves all
    # backward readers, each recomputed tensor living to its own reader.
    g = chain([10, 10, 10, 10, 1])
    r = simulate(g, {f"t{i}": "recompute" for i in range(3)})
    replays = [e.op for e in r.op_events if e.phase == "recompute"]
    assert replays == ["o0", "o1", "o2"]
    assert r.recompute_time == 3.0


def shared_input_graph():
    # o0 -> t0; o1(t0) -> t1; o2(t0, t1) -> t2; o3(t2) -> t3. Only t1 (by
    # o2) and t2 (by o3) are read in backward.
    ops = tuple(op(f"o{i}") for i in range(4))
    tensors = (tensor("t0", 100, "o0", ("o1", "o2")),
               tensor("t1", 10, "o1", ("o2",), ("o2",)),
               tensor("t2", 20, "o2", ("o3",), ("o3",)),
               tensor("t3", 1, "o3"))
    return Graph(ops, tensors)


def test_recompute_shares_a_recomputed_input():
    g = shared_input_graph()
    r = simulate(g, {t: "recompute" for t in ("t0", "t1", "t2")})
    # bwd o3 needs t2 <- o2(t0, t1), t1 <- o1(t0): o0, o1, o2 are replayed
    # once each in [4,7]; t0 stays live until o2's replay ends.
    replays = [(e.op, e.start) for e in r.op_events if e.phase == "recompute"]
    assert replays == [("o0", 4.0), ("o1", 5.0), ("o2", 6.0)]
    assert memory_at(r, 6.5) == 130
    # bwd o3 [7,9]: t1 (for o2) + t2 + g(t3) + g(t2); t0 is gone.
    assert memory_at(r, 8.0) == 10 + 20 + 1 + 20
    # bwd o2 [9,11]: t1 + g(t2) + g(t0) + g(t1).
    assert (r.peak_bytes, r.peak_time) == (140, 9.0)


def test_recompute_extends_kept_input():
    g = shared_input_graph()
    r = simulate(g, {"t1": "recompute", "t2": "recompute"})
    # t0 has no backward reader, yet replaying o1 and o2 needs it: it is
    # kept through o3's forward [3,4] (t0 + t2 + t3) until o2's replay [5,6].
    assert memory_at(r, 3.5) == 121
    assert memory_at(r, 5.5) == 130
    assert memory_at(r, 6.5) == 10 + 20 + 1 + 20


def skip_graph():
    # o0 -> t0 -> o1 -> t1 -> o2 -> t2 -> o3(t2, t0) -> t3. o3 is an add:
    # its backward reads nothing; o1's backward reads only its output t1.
    ops = (op("o0"), op("o1"), op("o2"), op("o3"))
    tensors = (tensor("t0", 100, "o0", ("o1", "o3")),
               tensor("t1", 10, "o1", ("o2",), ("o2",)),
               tensor("t2", 20, "o2", ("o3",)),
               tensor("t3", 1, "o3"))
    return Graph(ops, tensors)


def test_skip_connection_extends_lifetime():
    r = simulate(skip_graph())
    # Without the skip, t0 would die after o1's forward (at 2). Its second
    # reader o3 keeps it until 4: o2's forward holds t0+t1+t2 (not 30) and
    # o3's forward t0+t1+t2+t3; at 4 only t1 remains before the gradients.
    assert memory_at(r, 2.5) == 130
    assert memory_at(r, 3.5) == 131
    assert (4.0, 10) in r.timeline


def test_gradient_buffers():
    r = simulate(skip_graph())
    # bwd o3 [4,6]: g(t3)=1, g(t2)=20 and g(t0)=100, allocated at the
    # backward of t0's last forward reader (o3), not of o1.
    assert memory_at(r, 5.0) == 10 + 1 + 20 + 100
    # bwd o2 [6,8]: + g(t1); g(t3) freed with o3's backward.
    assert (r.peak_bytes, r.peak_time) == (140, 6.0)
    # bwd o0 [10,12] still holds g(t0); it goes when o0's backward ends.
    assert memory_at(r, 11.0) == 100
    assert r.timeline[-1] == (12.0, 0)


def test_diamond_concatenation():
    # o0 -> t0 -> {o1 -> t1, o2 -> t2} -> o3 (concat) -> t3 -> o4 -> t4.
    ops = tuple(op(f"o{i}") for i in range(5))
    tensors = (tensor("t0", 40, "o0", ("o1", "o2"), ("o1", "o2")),
               tensor("t1", 10, "o1", ("o3",)),
               tensor("t2", 20, "o2", ("o3",)),
               tensor("t3", 30, "o3", ("o4",), ("o4",)),
               tensor("t4", 1, "o4"))
    r = simulate(Graph(ops, tensors))
    # o3's forward [3,4] holds t0+t1+t2+t3; the branches die after it.
    assert memory_at(r, 3.5) == 100
    assert memory_at(r, 4.5) == 71
    # bwd o2 [9,11]: t0 (o1 still needs it) + g(t0) + g(t1) + g(t2).
    assert (r.peak_bytes, r.peak_time) == (110, 9.0)
    # After bwd o2 only t0, g(t0), g(t1) remain.
    assert memory_at(r, 12.0) == 90


def test_workspace_counts_while_op_runs():
    ops = (op("o0", workspace_bytes=1000), op("o1"))
    tensors = (tensor("t0", 10, "o0", ("o1",), ("o1",)), tensor("t1", 1, "o1"))
    r = simulate(Graph(ops, tensors))
    # o0's forward and backward each hold 1000 bytes of scratch: the
    # backward one with t0's gradient (10) and t0 freed: 1000 + 10.
    assert r.peak_bytes == 1010
    assert memory_at(r, 0.5) == 1010
    assert memory_at(r, 1.5) == 11


def test_zero_length_ops_never_go_negative():
    g = chain([5, 5, 1])
    cost = CostModel(op_overhead_s=0)
    ops = tuple(o.__class__(o.name) for o in g.ops)  # no times: 0 s each
    r = simulate(Graph(ops, g.tensors), cost=cost)
    assert min(b for _, b in r.timeline) == 0
    assert r.peak_bytes == simulate(g).peak_bytes


def test_rejects_bad_actions():
    g = chain([1, 1])
    with pytest.raises(ValueError, match="nope"):
        simulate(g, {"t0": "nope"})
    with pytest.raises(ValueError, match="zz"):
        simulate(g, {"zz": "keep"})
    with pytest.raises(ValueError, match="zz"):
        simulate(g, {"t0": "swap"}, {"t0": "zz"})
    frozen = Graph(g.ops, (g.tensors[0].__class__("t0", 1, "o0", ("o1",),
                                                 ("o1",), can_swap=False),
                           g.tensors[1]))
    with pytest.raises(ValueError, match="cannot be swapped"):
        simulate(frozen, {"t0": "swap"})


def test_500_op_chain_is_fast():
    g = chain([2**20] * 500)
    simulate(g)  # Builds the per-graph index once.
    every_20th_kept = {t.name: "recompute" for t in g.tensors[:-1]
                       if int(t.name[1:]) % 20}
    plans = [{}, {t.name: "swap" for t in g.tensors}, every_20th_kept]
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for actions in plans:
            simulate(g, actions)
        rounds.append((time.perf_counter() - start) / len(plans))
    # About 7 ms each here. The best of five rounds, against a bound that a
    # quadratic simulator would miss by far: other work on a 2-core CI
    # machine (torch's spinning threads) slowed single rounds 20x.
    assert min(rounds) < 0.25


def test_long_recompute_chain_has_no_recursion_limit():
    g = chain([1] * 3000)
    r = simulate(g, {t.name: "recompute" for t in g.tensors[:-1]})
    # Group o2999 replays o0..o2998 once; each then lives to its reader.
    assert r.recompute_time == 2999.0


def test_in_flight_bound_makes_the_forward_wait_for_copies_out():
    # t0 and t1 (100 B each) take 1 s each to copy out at 100 B/s; forwards
    # take 0.1 s, so without a bound the forward runs ahead of the copies.
    g = chain([100, 100, 100, 1], fwd_times=[0.1] * 4)
    actions = {"t0": "swap", "t1": "swap"}
    free = simulate(g, actions, cost=SLOW_LINK)
    bound = dataclasses.replace(SLOW_LINK, max_in_flight_bytes=100)
    held = simulate(g, actions, cost=bound)
    assert free.d2h_wait_time == 0
    # o2 may start only once t0's copy (ends at 1.1 s) is done: 100 B left.
    starts = {(e.op, e.phase): e.start for e in held.op_events}
    assert starts["o2", "fwd"] == pytest.approx(1.1)
    assert held.d2h_wait_time == pytest.approx(1.1 - 0.2)
    assert held.stall_time >= held.d2h_wait_time
    assert held.step_time > free.step_time
    # A bound of 0: every forward op waits for all copies issued before it.
    zero = simulate(g, actions, cost=dataclasses.replace(SLOW_LINK, max_in_flight_bytes=0))
    starts = {(e.op, e.phase): e.start for e in zero.op_events}
    assert starts["o1", "fwd"] == pytest.approx(1.1)  # t0's copy, [0.1, 1.1].
    assert starts["o2", "fwd"] == pytest.approx(2.2)  # t1's, [1.2, 2.2].
    with pytest.raises(ValueError, match="max_in_flight_bytes"):
        CostModel(max_in_flight_bytes=-1)


def test_internal_tensors_have_no_gradient():
    # o1 saves 50 bytes inside itself for its backward: no gradient flows
    # to them, so none is allocated.
    ops = (op("o0"), op("o1"))
    tensors = (tensor("t0", 10, "o0", ("o1",), ("o1",)),
               tensor("o1:saved", 50, "o1", (), ("o1",), internal=True),
               tensor("t1", 1, "o1"))
    r = simulate(Graph(ops, tensors))
    assert not [x for x in r.peak_live if x[0] == "gradient" and x[1] == "o1:saved"]
    # bwd o1 [2,4]: t0 + o1:saved + g(t1) + g(t0).
    assert memory_at(r, 3.0) == 10 + 50 + 1 + 10


def test_backward_workspace_sits_above_the_larger_end():
    # bwd o1: before = t0 = 100 (the output's gradient is born with the
    # backward); after = g(t0) = 100. A measured workspace of 50 above the
    # larger end: 150 while it runs, not t0 + g(t1) + g(t0) + 50 = 251.
    ops = (op("o0"), op("o1", workspace_bytes=50))
    tensors = (tensor("t0", 100, "o0", ("o1",), ("o1",)), tensor("t1", 1, "o1"))
    r = simulate(Graph(ops, tensors))
    assert memory_at(r, 2.5) == 150
    assert memory_at(r, 1.5) == 100 + 1 + 50  # Forward: as measured.
    assert r.peak_bytes == 151


def test_program_scratch_sits_whole_above_everything_live():
    # A compiled program's temporaries (XLA's) are allocated beside its
    # inputs and outputs: nothing of them overlaps what is live, in either
    # phase, unlike a measured workspace (above).
    tensors = (tensor("t0", 100, "o0", ("o1",), ("o1",)), tensor("t1", 1, "o1"))
    plain = simulate(Graph((op("o0"), op("o1")), tensors))
    scratched = simulate(Graph((op("o0"), op("o1", scratch_bytes=(5, 50))), tensors))
    assert memory_at(scratched, 1.5) == memory_at(plain, 1.5) + 5  # o1's forward
    assert memory_at(scratched, 2.5) == memory_at(plain, 2.5) + 50  # o1's backward
    assert memory_at(scratched, 4.5) == memory_at(plain, 4.5)  # o0's backward
    assert scratched.peak_bytes == plain.peak_bytes + 50


def test_replayed_chain_brings_back_everything_it_saves_at_once():
    # o0 -> t0 -> o1 -> t1 -> o2 -> t2 -> o3; t0, t1 recomputed. XLA makes
    # each again when needed; a checkpointed chain (torch, TensorFlow)
    # replays o0..o2 at o2's backward, t0 and t1 at once, and o2 again with
    # it: what o2 saves of its own output (t2, read by its backward) is
    # made a second time until o2's backward ends.
    ops = tuple(op(f"o{i}") for i in range(4))
    tensors = (tensor("t0", 100, "o0", ("o1",), ("o1",)),
               tensor("t1", 10, "o1", ("o2",), ("o2",)),
               tensor("t2", 1000, "o2", ("o3",), ("o2", "o3")),
               tensor("t3", 1, "o3"))
    actions = {"t0": "recompute", "t1": "recompute"}
    lazy = simulate(Graph(ops, tensors), actions)
    replay = simulate(Graph(ops, tensors), actions, cost=CostModel(replay_segments=True))
    assert [e.op for e in lazy.op_events if e.phase == "recompute"] == ["o0", "o1"]
    assert [e.op for e in replay.op_events if e.phase == "recompute"] == ["o0", "o1", "o2"]
    # bwd o2: t2 twice, t0 and t1, g(t2) and g(t1).
    bwd_o2 = next(e for e in replay.op_events if e.op == "o2" and e.phase == "bwd")
    assert memory_at(replay, bwd_o2.start) == 2000 + 100 + 10 + 1000 + 10
    assert replay.peak_bytes == lazy.peak_bytes + 1000


def early_free_graph():
    # t0 is read in the forward only (o1 saves its output, not its input):
    # freed after o1 unless every output is held to the end of the forward.
    ops = tuple(op(f"o{i}") for i in range(4))
    tensors = (tensor("t0", 100, "o0", ["o1"]), tensor("t1", 10, "o1", ["o2"], ["o2"]),
               tensor("t2", 10, "o2", ["o3"], ["o3"]), tensor("t3", 1, "o3"))
    return Graph(ops, tensors)


def test_held_outputs_live_to_the_end_of_the_forward():
    freed = simulate(early_free_graph())
    held = simulate(early_free_graph(), hold_outputs=True)
    # Freed: fwd o1 [1,2] holds t0+t1; at 4, bwd o3 t1+t2 + g(t3)+g(t2)
    # (the output t3 has no reader left).
    assert (freed.peak_bytes, memory_at(freed, 4.0)) == (110, 31)
    # Held: fwd o3 [3,4] holds t0..t3 = 121; t0 goes at 4, before bwd o3.
    assert (held.peak_bytes, held.peak_time) == (121, 3.0)
    assert memory_at(held, 4.0) == 31
    assert held.step_time == freed.step_time


def test_held_outputs_model_a_step_that_keeps_everything():
    with pytest.raises(ValueError, match="hold_outputs"):
        simulate(early_free_graph(), {"t0": "swap"}, hold_outputs=True)
    assert simulate(early_free_graph(), {"t0": "keep"}, hold_outputs=True).peak_bytes == 121
