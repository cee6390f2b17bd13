"""The search behind the hybrid policy (`hybrid.py`): a greedy that acts
on what is live at the simulated peak, cheapest per byte first, fallbacks
when it cannot meet the budget, prefetch distances for the copies back,
and a local search for a faster step within the budget.

Pure standard-library Python, no framework imports.
"""

import bisect
import heapq

from .schedule import first_backward_use
from .simulate import simulate
from .units import halves
from .units import recompute_units
from .units import region_units
from .units import swap_units

# Greedy rounds (one simulation each) before giving up on the budget.
MAX_ROUNDS = 400
# Greedy rounds in a row that may fail to lower the peak.
MAX_STALE = 12
# Simulations the local search may spend after the budget is met.
MAX_TRIES = 80
# A copy back starts when the backward still to run before its first use
# takes at least this many times the copy (earlier where the copies queued
# after it need the link: `_Search._queued_ahead`).
PREFETCH_SLACK = 2.0


def _ahead_of(a, b, budget):
    """Whether the simulated choice `a` beats `b`, each `(actions,
    prefetch, result)`: fitting first, then faster, then fewer actions;
    else a lower peak."""
    fits_a, fits_b = a[2].peak_bytes <= budget, b[2].peak_bytes <= budget
    if fits_a != fits_b:
        return fits_a
    if fits_a:
        return (a[2].step_time, len(a[0])) < (b[2].step_time, len(b[0]))
    return a[2].peak_bytes < b[2].peak_bytes


def _lower(a, b, budget):
    """Whether `a` has a lower peak than `b` (then fewer actions)."""
    return (a[2].peak_bytes, len(a[0])) < (b[2].peak_bytes, len(b[0]))


def search(graph, cost, budget, allowed, base, regions=None, least=False):
    """A finished `_Search`: the greedy, the fallbacks if it did not meet
    the budget, then (unless `least`) the local search.

    Args:
        graph, cost, budget, allowed, least: as `hybrid` takes them.
        base: the keep-all `SimResult`.
        regions: `None` for recompute units that are pieces of chains, or
            how runs of regions are cut (`"counts"`, `"bytes"`).
    """
    found = _Search(graph, cost, budget, allowed, base, regions, least)
    found.greedy()
    if not found.best_fits():
        found.frugal()
    if found.best_fits() and not least:
        found.improve()
    return found


class _Search:
    """The chosen units, prefetch distances, and the best plan seen.

    `regions` is `None` for recompute units that are pieces of chains, or
    how runs of regions are cut (`"counts"`, `"bytes"`: `region_units`).
    """

    def __init__(self, graph, cost, budget, allowed, base, regions=None,
                 least=False):
        self.graph, self.cost, self.budget, self.base = graph, cost, budget, base
        # How a simulated choice beats the best so far; seeking the lowest
        # peak, a round does not price swaps again as the link fills.
        self.least = least
        self.better = _lower if least else _ahead_of
        self.index = graph.op_index
        self.regions = regions
        self.units = []
        if "swap" in allowed:
            self.units += swap_units(graph, cost, base)
        if "recompute" in allowed and regions:
            self.units += region_units(graph, cost, by_bytes=regions == "bytes")
        elif "recompute" in allowed:
            self.units += recompute_units(graph, cost)
        self.swap_of, self.redo_of = {}, {}
        for k, u in enumerate(self.units):
            target = self.swap_of if u.kind == "swap" else self.redo_of
            for t in u.tensors:
                target[t] = k
        self.chosen = set()
        # Units cut in halves: choosing one again would undo its split.
        self.retired = set()
        # Prefetch distances set by the search (a copy back held later for
        # memory, or started earlier for a stall); the others are
        # `_queued_ahead`'s, and `used_ahead` what the last simulation used.
        self.ahead, self.used_ahead = {}, {}
        bwd = [cost.bwd_time(op) for op in graph.ops]
        # after[i]: backward time of ops i+1.. (those run before op i's).
        self.after = [0.0] * len(bwd)
        for i in range(len(bwd) - 2, -1, -1):
            self.after[i] = self.after[i + 1] + bwd[i + 1]
        self.before = [-a for a in self.after]  # Non-decreasing, to bisect.
        fwd = [cost.fwd_time(op) for op in graph.ops]
        self.fwd_total, self.bwd_total = sum(fwd), sum(bwd)
        self.best = self.best_chosen = None
        self.current = self.evaluate()

    def units_of(self, chosen):
        return [self.units[k] for k in sorted(chosen)]

    def actions(self, chosen):
        actions = {}
        for u in self.units_of(chosen):
            for t in u.tensors:
                if u.kind == "recompute" or actions.get(t) != "recompute":
                    actions[t] = u.kind
        return actions

    def evaluate(self, chosen=None, ahead=None):
        """Simulates a choice; records it if it beats the best so far."""
        chosen = self.chosen if chosen is None else chosen
        ahead = self.ahead if ahead is None else ahead
        actions = self.actions(chosen)
        first = first_backward_use(self.graph, actions, self.cost.replay_segments)
        used = self._queued_ahead([t for t, a in actions.items()
                                   if a == "swap" and t in first], first)
        used.update((t, k) for t, k in ahead.items() if t in used)
        last = len(self.graph.ops) - 1
        prefetch = {t: self.graph.ops[min(first[t] + k, last)].name
                    for t, k in used.items()}
        result = simulate(self.graph, actions, prefetch, self.cost)
        self.used_ahead = used
        if self.best is None or self.better((actions, prefetch, result), self.best, self.budget):
            self.best = (actions, prefetch, result)
            self.best_chosen, self.best_ahead = set(chosen), used
        return result

    def _queued_ahead(self, swaps, first):
        """How many ops before its first backward use each swapped tensor's
        copy back starts: where the backward still to run takes twice the
        copy, or earlier where the copies needed after it would otherwise
        queue on the link past its use (one stream copies back, in the
        order the backward needs them)."""
        ahead, start = {}, float("inf")
        for t in sorted(swaps, key=lambda t: (-self.after[first[t]], t)):
            need = self.after[first[t]]
            copy = self.cost.copy_time(self.graph.tensor_map[t].nbytes, "h2d")
            start = min(need, start) - copy
            lead = max(PREFETCH_SLACK * copy, need - start)
            j = bisect.bisect_left(self.before, lead - need, lo=first[t] + 1)
            ahead[t] = max(1, min(j, len(self.after) - 1) - first[t])
        return ahead

    def best_fits(self):
        return self.best[2].peak_bytes <= self.budget

    def greedy(self):
        """Acts on what is live at the peak until the budget is met."""
        stale = 0
        for _ in range(MAX_ROUNDS):
            r = self.current
            if r.peak_bytes <= self.budget or not self._relieve(r):
                return
            lowest = self.best[2].peak_bytes
            self.current = self.evaluate()
            # Rounds that no longer lower the peak are not worth more.
            stale = 0 if self.current.peak_bytes < lowest else stale + 1
            if stale >= MAX_STALE:
                return

    def frugal(self):
        """Tries the most frugal choices: every recompute unit, then every
        swap besides; the best (lowest peak) is kept."""
        redo = {k for k, u in enumerate(self.units)
                if u.kind == "recompute" and k not in self.retired}
        self.evaluate(redo)
        everything = set(redo)
        for k, u in enumerate(self.units):
            if u.kind == "swap":
                self._choose(k, everything)
        for k in redo:
            self._choose(k, everything)
        self.evaluate(everything)

    def _relieve(self, r):
        """Chooses moves that free at least the excess at the peak."""
        live = {name: n for kind, name, n in r.peak_live if kind == "activation"}
        actions = self.actions(self.chosen)
        moved = False
        # A swapped tensor live at a peak in the forward pass waits for its
        # copy to host; in the backward, its copy back may have started too
        # early for the memory: start it later.
        backward = r.peak_time > r.forward_time
        for t, n in live.items():
            if backward and actions.get(t) == "swap" and self.used_ahead.get(t, 1) > 1:
                self.ahead[t] = self.used_ahead[t] // 2
                moved = True
        if moved:
            return True
        options, load = [], self._link_load()
        for k, u in enumerate(self.units):
            if k in self.chosen or k in self.retired:
                continue
            if u.kind == "swap" and u.tensors[0] in self.redo_of \
                    and self.redo_of[u.tensors[0]] in self.chosen:
                continue
            # Recomputing frees a swapped tensor whose copy is not done.
            acted = ("keep",) if u.kind == "swap" else ("keep", "swap")
            freed = sum(live.get(t, 0) for t in u.tensors
                        if actions.get(t, "keep") in acted)
            if freed:
                options.append((self._estimate(u, load) / freed, k, freed))
        if not options:
            return self._split(live, actions)
        self._take(options, r.peak_bytes - self.budget, load)
        return True

    def _split(self, live, actions):
        """Halves the chosen recompute units whose replays are live at the
        peak: their middle outputs are kept, each half replays alone."""
        held = {}
        for t, n in live.items():
            k = self.redo_of.get(t)
            if actions.get(t) == "recompute" and len(self.units[k].segment) > 3:
                held[k] = held.get(k, 0) + n
        if not held:
            return False
        for k in held:
            self.chosen.discard(k)
            self.retired.add(k)
            for piece in halves(self.graph, self.cost, self.units[k]):
                self.units.append(piece)
                for t in piece.tensors:
                    self.redo_of[t] = len(self.units) - 1
                self._choose(len(self.units) - 1)
            # The kept middle output is in no half: a trade for its swap
            # must not bring the whole unit back.
            for t in self.units[k].tensors:
                if self.redo_of.get(t) == k:
                    del self.redo_of[t]
        return True

    def _take(self, options, excess, load):
        """Chooses `options` (cost per byte, unit, bytes freed), cheapest
        first, until `excess` bytes are freed. Each swap taken loads the
        link the next ones share, so (unless seeking the lowest peak) a
        swap's cost is looked at again when its turn comes, and it goes
        back in line if it is no longer the cheapest: costs only grow, so
        the first that holds is."""
        heapq.heapify(options)
        while options and excess > 0:
            ratio, k, freed = heapq.heappop(options)
            unit = self.units[k]
            if unit.kind == "swap" and self.redo_of.get(unit.tensors[0]) in self.chosen:
                continue  # A recompute unit taken this round frees it.
            if unit.kind == "swap" and not self.least:
                now = self._estimate(unit, load) / freed
                if options and now > ratio and now > options[0][0]:
                    heapq.heappush(options, (now, k, freed))
                    continue
                load = self._loaded(load, unit)
            self._choose(k)
            excess -= freed

    def _link_load(self):
        """(to host, back) seconds of the chosen swaps' copies."""
        load = (0.0, 0.0)
        for u in self.units_of(self.chosen):
            if u.kind == "swap":
                load = self._loaded(load, u)
        return load

    def _loaded(self, load, unit):
        return (load[0] + self.cost.copy_time(unit.nbytes, "d2h"),
                load[1] + self.cost.copy_time(unit.nbytes, "h2d"))

    def _estimate(self, unit, load):
        if unit.kind == "recompute":
            return unit.estimate
        d2h, h2d = self._loaded(load, unit)
        # A saturated link exposes what compute cannot cover.
        overload = max(d2h - self.fwd_total, h2d - self.bwd_total, 0.0)
        return max(unit.estimate, overload)

    def _choose(self, k, chosen=None):
        chosen = self.chosen if chosen is None else chosen
        chosen.add(k)
        if self.units[k].kind == "recompute":
            for t in self.units[k].tensors:
                chosen.discard(self.swap_of.get(t))

    def improve(self):
        """Local search from the best fitting plan: accept faster ones."""
        self.chosen, tries = set(self.best_chosen), 0
        improved = True
        while improved and tries < MAX_TRIES:
            improved = False
            for chosen, ahead in self._neighbours():
                if tries >= MAX_TRIES:
                    break
                tries += 1
                before = self.best[2]
                self.evaluate(chosen, ahead)
                if self.best[2] is not before:
                    self.chosen, self.ahead = set(chosen), ahead
                    improved = True
                    break

    def _neighbours(self):
        """Changes to try, the most promising first."""
        stalls = self.best[2].stalls
        actions = self.best[0]

        def cost_of(k):
            u = self.units[k]
            return u.estimate + sum(stalls.get(t, 0.0) for t in u.tensors)

        # Undoing an action puts its bytes back on the device; where they
        # exceed the room under the budget, the undo would surely not fit.
        room = self.budget - self.best[2].peak_bytes
        for k in sorted(self.chosen, key=cost_of, reverse=True):
            if self.units[k].nbytes <= room:
                yield self.chosen - {k}, self.ahead
        for t in sorted(stalls, key=stalls.get, reverse=True):
            if actions.get(t) == "swap":
                ahead = dict(self.ahead)
                ahead[t] = 2 * self.best_ahead.get(t, 1)
                yield self.chosen, ahead
        for k in sorted(self.chosen, key=cost_of, reverse=True):
            yield from self._trades(k)

    def _trades(self, k):
        """Swap in place of a recompute unit, or the reverse."""
        u = self.units[k]
        if u.kind == "recompute":
            swaps = [self.swap_of.get(t) for t in u.tensors]
            if all(s is not None for s in swaps):
                yield (self.chosen - {k}) | set(swaps), self.ahead
        elif u.tensors[0] in self.redo_of:
            chosen = set(self.chosen)
            self._choose(self.redo_of[u.tensors[0]], chosen)
            yield chosen, self.ahead
