"""Timeline simulation of one training step under a keep/swap/recompute plan.

Three streams: compute, device-to-host (D2H) and host-to-device (H2D). Each
copy stream runs its copies one at a time in the order they were enqueued.
Compute runs the forward of every op in order, then, op by op in reverse
order, the recomputations that op's backward needs and the backward itself.

Memory is `graph.persistent_bytes` plus live tagged tensors, live gradient
buffers and the workspace of the running op:

- A tensor is allocated when its producer's forward starts. A kept tensor
  is freed after its last use: its last forward reader's forward, or its
  last backward use (a backward reader, or a recomputation that reads it).
- A swapped tensor is copied to host when its producer's forward ends; the
  device copy is freed once that copy is done and its last forward reader
  has run. With `cost.max_in_flight_bytes`, a forward op does not start
  while more than that many bytes of copies to host are outstanding. The copy back is enqueued when compute reaches the backward of
  its prefetch op (or its first backward use, if that comes first), starts
  no earlier than the copy out finished, allocates device memory when it
  starts, and compute waits for it before any op that reads the tensor.
- A recomputed tensor is freed after its last forward reader. In backward,
  before the first op that needs it, its producer's forward is re-run, and
  recursively so for the recomputed inputs that producer needs and that are
  not live. A recomputed tensor lives until its last backward reader that
  is still to run, or, if none, just until the recomputation that needed it.
- The gradient buffer of a tensor (same size) is allocated when the
  backward of its last forward reader starts (its producer's, for a model
  output) and freed when its producer's backward ends. Tensors a layer
  saves inside itself (`internal`) have none.
- An op's workspace is held while it runs. A measured one is what the op
  allocated above the larger of the memory before and after it, so in
  backward the memory while it runs is that larger figure plus the
  workspace. A compiled program's scratch (`scratch_bytes`, per phase)
  comes on top of all that is live, whole.
- With `hold_outputs`, every layer output lives at least until the forward
  pass ends: an eager functional model run unchanged holds them all (its
  dict of outputs), so that is the peak of a step AutoVM leaves alone.
- With `cost.replay_segments`, a recomputed tensor is made again with the
  whole chain of ops linked by recomputed tensors (what torch and
  TensorFlow checkpointing do), its last op included, each tensor living
  to its last backward reader.
"""

import bisect
import collections
import dataclasses

from .cost import CostModel
from .schedule import check_actions
from .schedule import index
from .schedule import schedule
from .schedule import times

OpEvent = collections.namedtuple("OpEvent", ["op", "phase", "start", "end"])
OpEvent.__doc__ = "One compute-stream item: `phase` is fwd, bwd or recompute."

CopyEvent = collections.namedtuple(
    "CopyEvent", ["tensor", "direction", "start", "end"]
)
CopyEvent.__doc__ = "One copy: `direction` is d2h or h2d."


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What the simulation predicts for one training step.

    Args:
        peak_bytes: highest device memory in use.
        peak_time: when the peak is first reached, in seconds.
        peak_live: what is allocated at the peak, as `(kind, name, nbytes)`
            with kind `"persistent"`, `"activation"`, `"gradient"` or
            `"workspace"`, largest first.
        step_time: when the last stream finishes, in seconds.
        compute_time: forward plus backward time, without recomputation.
        recompute_time: time spent re-running forwards in backward.
        stall_time: time compute waited for copies: host-to-device copies
            it reads, and device-to-host copies over the in-flight bound.
        stalls: dict tensor name -> seconds compute waited for its copy.
        d2h_bytes: bytes copied device to host.
        h2d_bytes: bytes copied host to device.
        timeline: list of `(time_s, bytes_in_use)`, time non-decreasing.
        op_events: list of `OpEvent` in compute-stream order.
        copy_events: list of `CopyEvent`, D2H then H2D, each in stream order.
        d2h_wait_time: the part of `stall_time` forward ops waited for
            device-to-host copies over `cost.max_in_flight_bytes`.
    """

    peak_bytes: int
    peak_time: float
    peak_live: tuple
    step_time: float
    compute_time: float
    recompute_time: float
    stall_time: float
    stalls: dict
    d2h_bytes: int
    h2d_bytes: int
    timeline: list
    op_events: list
    copy_events: list
    d2h_wait_time: float = 0.0

    @property
    def forward_time(self):
        """When the forward pass ends (its waits for copies included)."""
        return max((e.end for e in self.op_events if e.phase == "fwd"), default=0.0)


def simulate(graph, actions=None, prefetch=None, cost=None, hold_outputs=False):
    """Simulates one training step of `graph` under a plan.

    Args:
        graph: a `Graph`.
        actions: dict tensor name -> `"keep"`, `"swap"` or `"recompute"`.
            Missing tensors are kept. Defaults to `None` (keep all).
        prefetch: dict tensor name -> op name: a swapped tensor's copy back
            is enqueued when the backward of that op starts. Missing swapped
            tensors are prefetched one op ahead of their first backward use.
            Defaults to `None`.
        cost: a `CostModel`. Defaults to `CostModel()`.
        hold_outputs: whether layer outputs (not what layers save inside)
            live until the forward pass ends. Defaults to `False`.

    Returns:
        A `SimResult`.
    """
    actions = dict(actions or {})
    if hold_outputs and any(a != "keep" for a in actions.values()):
        raise ValueError(
            "Argument `hold_outputs` models a step run unchanged, which keeps "
            f"every tensor; received actions that do not: {actions!r}")
    cost = cost or CostModel()
    ix = index(graph)
    check_actions(ix, actions)
    sched = schedule(ix, actions, cost.replay_segments)
    triggers = _triggers(ix, sched, actions, prefetch or {})
    streams = _run(ix, graph, sched, actions, triggers, cost)
    events = _memory_events(ix, graph, sched, streams, actions, hold_outputs)
    return _result(graph, ix, sched, streams, events, actions)



def _triggers(ix, sched, actions, prefetch):
    """Maps each swapped tensor read in backward to its copy-back position."""
    op_pos = {name: i for i, name in enumerate(ix.op_names)}
    issue = {}
    for name, action in actions.items():
        if action != "swap" or name not in sched.uses:
            continue
        first = sched.uses[name][0]
        if name in prefetch:
            if prefetch[name] not in op_pos:
                raise ValueError(
                    f"Unknown op in `prefetch` for {name!r}: {prefetch[name]!r}"
                )
            op = op_pos[prefetch[name]]
        else:
            op = min(sched.group[first] + 1, ix.n - 1)
        # A trigger after the first use would deadlock; issue at the use.
        issue[name] = min(sched.group_start[op], first)
    return issue


_Streams = collections.namedtuple(
    "_Streams", ["starts", "ends", "d2h", "h2d", "stalls", "end", "waited"]
)


def _run(ix, graph, sched, actions, issue, cost):
    """Times every compute item and copy; returns a `_Streams`."""
    fwd_t, bwd_t = times(ix, graph, cost)
    issue_at, gate = {}, {}
    # Copies issued together go in the order compute will need them.
    order = sorted(issue, key=lambda n: (issue[n], sched.uses[n][0]))
    for name in order:
        pos = issue[name]
        issue_at.setdefault(pos, []).append(name)
        for p in sched.uses[name]:
            gate.setdefault(p, []).append(name)
    starts, ends, d2h, h2d, stalls = [], [], {}, {}, {}
    outstanding = _Outstanding()
    now = d2h_free = h2d_free = waited = 0.0
    for pos, (phase, i) in enumerate(sched.items):
        if phase == "fwd" and cost.max_in_flight_bytes is not None:
            ready = outstanding.ready(now, cost.max_in_flight_bytes)
            waited += ready - now
            now = ready
        for name in issue_at.get(pos, ()):
            start = max(now, h2d_free, d2h[name][1])
            h2d_free = start + cost.copy_time(ix.nbytes[name], "h2d")
            h2d[name] = (start, h2d_free)
        start = _wait(now, gate.get(pos, ()), h2d, stalls)
        now = start + (bwd_t[i] if phase == "bwd" else fwd_t[i])
        starts.append(start)
        ends.append(now)
        if phase != "fwd":
            continue
        for name in ix.outputs[i]:
            if actions.get(name) == "swap":
                begin = max(now, d2h_free)
                d2h_free = begin + cost.copy_time(ix.nbytes[name], "d2h")
                d2h[name] = (begin, d2h_free)
                outstanding.add(d2h_free, ix.nbytes[name])
    end = max(now, d2h_free, h2d_free)
    return _Streams(starts, ends, d2h, h2d, stalls, end, waited)


class _Outstanding:
    """The copies to host not yet done, in the order they end.

    One stream runs them in turn, so each ends no earlier than the one
    before: the outstanding ones at any time are the last ones enqueued,
    and a running sum replaces a sort of every copy at each forward op.
    """

    def __init__(self):
        self.copies = collections.deque()
        self.bytes = 0

    def add(self, end, nbytes):
        self.copies.append((end, nbytes))
        self.bytes += nbytes

    def ready(self, now, limit):
        """When the copies outstanding at `now` are within `limit`."""
        copies = self.copies
        while copies and copies[0][0] <= now:
            self.bytes -= copies.popleft()[1]
        # Waiting for a copy retires it; the time only moves forward.
        while copies and self.bytes > limit:
            now, nbytes = copies.popleft()
            self.bytes -= nbytes
        return now


def _wait(now, names, h2d, stalls):
    """Start time of a compute item that reads the swapped tensors `names`."""
    start = now
    for name in sorted(names, key=lambda n: h2d[n][1]):
        ready = h2d[name][1]
        if ready > start:
            stalls[name] = stalls.get(name, 0.0) + ready - start
            start = ready
    return start


def _memory_events(ix, graph, sched, st, actions, hold_outputs=False):
    """Allocations and frees as sorted `(time, rank, delta, key)` tuples.

    `rank` breaks ties at equal times in stream order, so that zero-length
    items still allocate before they free, and a free at the end of one
    item comes before an allocation at the start of the next.
    """
    events = []
    starts, ends = st.starts, st.ends
    # Bytes born and dying at each point, for the measured workspaces only.
    overlap = any(op.workspace_bytes for op in graph.ops)
    born_at, dies_at = collections.Counter(), collections.Counter()

    def span(key, nbytes, born, dies):
        if nbytes:
            events.append((born[0], born[1], nbytes, key))
            events.append((dies[0], dies[1], -nbytes, key))
            if overlap:
                born_at[born] += nbytes
                dies_at[dies] += nbytes

    # Each item's start and end as `(time, rank)`, made once: the spans
    # below ask for them hundreds of thousands of times in a search.
    start_of = [(t, 3 * pos + 1) for pos, t in enumerate(starts)]
    end_of = [(t, 3 * pos + 2) for pos, t in enumerate(ends)]
    start, end = start_of.__getitem__, end_of.__getitem__

    def at(time):
        # Copy-stream events fall just before the next compute item starts.
        return (time, 3 * bisect.bisect_left(starts, time))

    for name, nbytes in ix.nbytes.items():
        born, last_fwd = start(ix.producer[name]), end(ix.last_fwd[name])
        if hold_outputs and not ix.spec[name].internal:
            last_fwd = end(ix.n - 1)
        uses = sched.uses.get(name)
        action = actions.get(name, "keep")
        if action == "keep":
            dies = end(uses[-1]) if uses else last_fwd
            span(("activation", name), nbytes, born, dies)
        elif action == "recompute":
            span(("activation", name), nbytes, born, last_fwd)
        else:
            copied = st.d2h[name][1]
            out = last_fwd if last_fwd[0] >= copied else at(copied)
            span(("activation", name), nbytes, born, out)
            if uses:
                back = at(st.h2d[name][0])
                span(("activation", name), nbytes, back, end(uses[-1]))
        if ix.spec[name].internal:
            continue  # Saved inside a layer: no gradient flows to it.
        fwd = ix.fwd[name]
        reader = fwd[-1] if fwd else ix.producer[name]
        span(("gradient", name), nbytes, start(sched.bwd_pos[reader]),
             end(sched.bwd_pos[ix.producer[name]]))
    for name, first, last in sched.redo:
        span(("activation", name), ix.nbytes[name], start(first), end(last))
    for pos, (phase, i) in enumerate(sched.items):
        op = graph.ops[i]
        extra = op.workspace_bytes
        if phase == "bwd" and extra:
            # A measured workspace is the most allocated above the larger of
            # the memory before and after the op. Here the input gradients
            # are born at its start and what it frees dies at its end, so
            # the overlap of the two comes off (the span may be negative):
            # in the op, memory is max(before, after) + workspace.
            extra -= min(born_at[start(pos)], dies_at[end(pos)])
        extra += op.scratch_bytes[phase == "bwd"]
        span(("workspace", op.name), extra, start(pos), end(pos))
    events.sort()
    return events


def _result(graph, ix, sched, st, events, actions):
    """Sweeps the memory events and assembles the `SimResult`."""
    peak, peak_k, peak_time, timeline = _sweep(graph.persistent_bytes, events)
    durations = collections.Counter()
    op_events = []
    for pos, (phase, i) in enumerate(sched.items):
        durations[phase] += st.ends[pos] - st.starts[pos]
        op_events.append(
            OpEvent(ix.op_names[i], phase, st.starts[pos], st.ends[pos])
        )
    copies = [CopyEvent(n, "d2h", a, b) for n, (a, b) in st.d2h.items()]
    copies += [CopyEvent(n, "h2d", a, b) for n, (a, b) in st.h2d.items()]
    copies.sort(key=lambda c: (c.direction, c.start))
    return SimResult(
        peak_bytes=peak,
        peak_time=peak_time,
        peak_live=_live_at(graph.persistent_bytes, events, peak_k),
        step_time=st.end,
        compute_time=durations["fwd"] + durations["bwd"],
        recompute_time=durations["recompute"],
        stall_time=sum(st.stalls.values()) + st.waited,
        stalls=dict(st.stalls),
        d2h_bytes=sum(ix.nbytes[n] for n in st.d2h),
        h2d_bytes=sum(ix.nbytes[n] for n in st.h2d),
        timeline=timeline,
        op_events=op_events,
        copy_events=copies,
        d2h_wait_time=st.waited,
    )


def _sweep(base, events):
    """Returns (peak bytes, index of the peak event, its time, timeline)."""
    now = peak = base
    peak_k, peak_time = -1, 0.0
    timeline = [(0.0, base)]
    for k, (time, _, delta, _) in enumerate(events):
        now += delta
        timeline.append((time, now))
        if now > peak:
            peak, peak_k, peak_time = now, k, time
    return peak, peak_k, peak_time, timeline


def _live_at(base, events, k):
    """What is allocated just after event `k`, largest first."""
    live = collections.Counter()
    for _, _, delta, key in events[: k + 1]:
        live[key] += delta
    found = [(kind, name, n) for (kind, name), n in live.items() if n > 0]
    found.sort(key=lambda x: (-x[2], x[0], x[1]))
    return tuple([("persistent", "", base)] if base else []) + tuple(found)
