"""SIMULATED managed memory: default CUDA UVM paging against AutoVM's hints.

A chain of layers trains one step (forward in order, backward in reverse)
in a device that holds `capacity` bytes of managed pages. Layer i's forward
reads its input (the previous output) and writes its output `a[i]`; its
backward reads `a[i]`, its input and the gradient of `a[i]`, writes the
gradient of its input, then frees `a[i]` and its gradient. What stays for
the whole step (weights, optimizer state, the batch) is outside
`capacity`.

- **Default UVM**: a page that is not resident faults in at the fault
  bandwidth, compute waiting; when the device is full, the least recently
  used pages (2 MiB) are written back to the host first, compute waiting
  at the eviction bandwidth.
- **AutoVM hints**: the outputs that do not fit are evicted to the host
  (asynchronously, at the prefetch-to-host bandwidth) after their last
  forward reader, and prefetched back (at the prefetch-to-device
  bandwidth) when the backward is `ahead` layers before their first use.
  Compute waits only for a copy it needs, or for an eviction still running
  when it needs the room; what still does not fit pages as by default.

Pure standard-library Python, no framework imports. This is a model, not a
measurement: its inputs are measured figures, its outputs are predictions.
"""

import collections
import dataclasses

PAGE = 2 * 2**20
# Prefetch distances (layers ahead) `hinted_plan` tries.
AHEAD = (1, 2, 3, 4, 6)


@dataclasses.dataclass(frozen=True)
class UvmLayer:
    """One layer: forward and backward seconds and its output's bytes."""

    name: str
    fwd_s: float
    bwd_s: float
    output_bytes: int


@dataclasses.dataclass(frozen=True)
class UvmLink:
    """Managed-memory bandwidths in bytes per second.

    Args:
        fault: pages migrated to the device by faults.
        prefetch_h2d: `cudaMemPrefetchAsync` to the device.
        prefetch_d2h: `cudaMemPrefetchAsync` to the host.
        evict: pages written back when the device is full.
    """

    fault: float
    prefetch_h2d: float
    prefetch_d2h: float
    evict: float


@dataclasses.dataclass
class UvmResult:
    """What one simulated step costs.

    Attributes:
        step_time: seconds until compute ends.
        compute_time: forward plus backward seconds.
        stall_time: seconds compute waited for pages.
        fault_bytes: bytes migrated by faults.
        evicted_bytes: bytes written back by the driver on demand.
        hint_bytes: bytes moved by eviction and prefetch hints.
        peak_bytes: most bytes resident at once (whole pages).
    """

    step_time: float = 0.0
    compute_time: float = 0.0
    stall_time: float = 0.0
    fault_bytes: int = 0
    evicted_bytes: int = 0
    hint_bytes: int = 0
    peak_bytes: int = 0


class Device:
    """Resident managed pages in least-recently-used order."""

    def __init__(self, capacity, link, result):
        self.capacity, self.link, self.result = capacity, link, result
        self.pages = collections.OrderedDict()  # (buffer, page) -> None
        self.count = collections.Counter()  # buffer -> resident pages
        self.sizes = {}  # buffer -> pages
        self.leaving = {}  # buffer -> when its hinted eviction ends

    def touch(self, buf, now, pinned):
        """Makes `buf` resident (faulting and evicting); returns the time."""
        missing = [(buf, j) for j in range(self.sizes[buf])
                   if (buf, j) not in self.pages]
        if missing:
            now = self.make_room(len(missing), now, pinned)
            self.result.fault_bytes += len(missing) * PAGE
            now += len(missing) * PAGE / self.link.fault
            self.add(missing)
        for j in range(self.sizes[buf]):
            self.pages.move_to_end((buf, j))
        return now

    def allocate(self, buf, nbytes, now, pinned):
        """A new buffer first touched on the device; returns the time."""
        self.sizes[buf] = max(1, -(-nbytes // PAGE))
        now = self.make_room(self.sizes[buf], now, pinned)
        self.add([(buf, j) for j in range(self.sizes[buf])])
        return now

    def add(self, pages):
        for page in pages:
            self.pages[page] = None
            self.count[page[0]] += 1
        self.result.peak_bytes = max(self.result.peak_bytes,
                                     len(self.pages) * PAGE)

    def drop(self, buf):
        for j in range(self.sizes[buf]):
            if self.pages.pop((buf, j), 0) is None:
                self.count[buf] -= 1

    def retire(self, now):
        """Frees the pages of hinted evictions finished by `now`."""
        for buf, end in list(self.leaving.items()):
            if end <= now:
                self.drop(buf)
                del self.leaving[buf]

    def make_room(self, need, now, pinned):
        """Frees `need` pages: waits for hinted evictions, then evicts LRU."""
        self.retire(now)
        for buf, end in sorted(self.leaving.items(), key=lambda x: x[1]):
            if len(self.pages) + need <= self.capacity:
                break
            now = max(now, end)
            self.retire(now)
        over = len(self.pages) + need - self.capacity
        if over <= 0:
            return now
        victims = []
        for page in self.pages:
            if page[0] not in pinned and page[0] not in self.leaving:
                victims.append(page)
                if len(victims) == over:
                    break
        for page in victims:
            del self.pages[page]
            self.count[page[0]] -= 1
        self.result.evicted_bytes += len(victims) * PAGE
        return now + len(victims) * PAGE / self.link.evict


def simulate_uvm(layers, capacity, link, evict=(), ahead=2):
    """Simulates one training step of a chain of layers in managed memory.

    Args:
        layers: list of `UvmLayer` in forward order.
        capacity: device bytes for the layers' outputs and gradients.
        link: a `UvmLink`.
        evict: indices of the layers whose outputs AutoVM's hints evict
            and prefetch; empty for default UVM paging. Defaults to `()`.
        ahead: how many layers before its first backward use a hinted
            output's prefetch starts. Defaults to 2.

    Returns:
        A `UvmResult`.
    """
    if capacity <= 0:
        raise ValueError(f"Argument `capacity` must be positive, received: {capacity}")
    result = UvmResult()
    dev = Device(capacity // PAGE, link, result)
    evict = set(evict)
    n, now, d2h_free, h2d_free, ready = len(layers), 0.0, 0.0, 0.0, {}

    def run(now, seconds, reads, new=()):
        pinned = set(reads) | {b for b, _ in new}
        for buf in reads:
            if buf in ready and ready[buf] > now:  # A prefetch in flight.
                result.stall_time += ready[buf] - now
                now = ready[buf]
            start = now
            now = dev.touch(buf, now, pinned)
            result.stall_time += now - start
        for buf, nbytes in new:
            start = now
            now = dev.allocate(buf, nbytes, now, pinned)
            result.stall_time += now - start
        result.compute_time += seconds
        return now + seconds

    for i, layer in enumerate(layers):
        reads = [("a", i - 1)] if i else []
        now = run(now, layer.fwd_s, reads, [(("a", i), layer.output_bytes)])
        if i - 1 in evict:  # Its last forward reader has run.
            d2h_free = max(now, d2h_free) + layers[i - 1].output_bytes / link.prefetch_d2h
            dev.leaving[("a", i - 1)] = d2h_free
            result.hint_bytes += layers[i - 1].output_bytes
    waiting = []  # Hinted outputs due for prefetch, soonest needed first.
    for i in reversed(range(n)):
        # a[m] is first read by the backward of layer m + 1; its prefetch is
        # due `ahead` layers before, and starts once the room is free (or
        # when it is needed, evicting as the driver would).
        waiting += sorted((m for m in evict if min(m + 1 + ahead, n - 1) == i),
                          reverse=True)
        while waiting:
            m, size = waiting[0], dev.sizes[("a", waiting[0])]
            dev.retire(now)
            if min(m + 1, n - 1) < i and len(dev.pages) + size > dev.capacity:
                break
            h2d_free = _prefetch(dev, layers, waiting.pop(0), now, h2d_free,
                                 ready, result)
        reads = [("a", i)] + ([("a", i - 1)] if i else [])
        reads += [("g", i)] if i < n - 1 else []
        new = [(("g", i - 1), layers[i - 1].output_bytes)] if i else []
        if i == n - 1:
            new.append((("g", i), layers[i].output_bytes))
        now = run(now, layers[i].bwd_s, reads, new)
        for buf in (("a", i), ("g", i)):
            dev.drop(buf)
            dev.leaving.pop(buf, None)
    result.step_time = now
    return result


def _prefetch(dev, layers, m, now, h2d_free, ready, result):
    """Queues the copy back of a[m]; returns when the copy stream is free."""
    buf = ("a", m)
    start = max(now, h2d_free, dev.leaving.pop(buf, now))
    dev.retire(start)
    dev.drop(buf)
    start = dev.make_room(dev.sizes[buf], start, {buf})
    dev.add([(buf, j) for j in range(dev.sizes[buf])])
    ready[buf] = start + layers[m].output_bytes / dev.link.prefetch_h2d
    result.hint_bytes += layers[m].output_bytes
    return ready[buf]


def hinted_plan(layers, capacity, link, ahead=None):
    """AutoVM's hints: evict the first m outputs, prefetch k layers ahead,
    for the m and k (in `AHEAD`, or `ahead` if given) whose simulated step
    is fastest; m = 0 (no hints) is among them.

    Returns:
        `(set of layer indices, k, UvmResult)`.
    """
    best = None
    for k in ([ahead] if ahead else AHEAD):
        for m in range(len(layers)):
            result = simulate_uvm(layers, capacity, link, evict=range(m), ahead=k)
            if best is None or result.step_time < best[2].step_time:
                best = (set(range(m)), k, result)
            if not result.fault_bytes and not result.evicted_bytes:
                break  # Evicting more would only add copies.
    return best


def footprint(layers):
    """Device bytes the step needs with nothing paged out (whole pages)."""
    unbounded = UvmLink(1.0, 1.0, 1.0, 1.0)
    return simulate_uvm(layers, 2**62, unbounded).peak_bytes


def speedup(layers, capacity, link, ahead=None):
    """Default UVM step time over AutoVM's, with both results.

    Returns:
        `(speedup, default UvmResult, hinted UvmResult)`.
    """
    default = simulate_uvm(layers, capacity, link)
    _, _, hinted = hinted_plan(layers, capacity, link, ahead)
    return default.step_time / hinted.step_time, default, hinted
