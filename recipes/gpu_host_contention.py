"""Does copying to host slow a Python-bound training step, and what do the
CUDA calls one swap makes cost the CPU? (torch)

    python3 recipes/gpu_host_contention.py --model resnet152 --batch 64 \\
        --out $OUT/host_contention.json

On torch, ResNet-152's step is bound by Python: the GPU waits for the CPU
(docs/results.md). A swap plan copies gigabytes a step to pinned host
memory while that Python runs. If the copies' traffic through the host's
memory slowed the Python, a swapped step would be slower than in-core with
no fault in AutoVM's code. The host's CPUs, NUMA nodes, the GPU's node, its
load average and the pinned link's rate are always recorded; then, in one
process, the parts `--parts` names:

- `python`: a pure Python loop and a host memory copy (NumPy), each timed
  alone and while pinned copies run on a side stream (to host, to the
  device, both), the two taking turns.
- `step`: Keras's in-core training step (no AutoVM) timed alone and with
  `--gb` GB of copies to host queued on a side stream as it starts, taking
  turns step by step. Each step ends when its loss is read back (which
  waits for the compute stream only); the side stream is waited for
  between steps, outside the clock.
- `calls`: the CPU time of each CUDA call a swap's copy to host makes
  (`swap.Step._copy_out`), alone, and of the whole sequence.
- `reuse`: a copy back dropped unread while it runs, and zeros made at
  once: whether they come out overwritten (AutoVM's `swap.Copy` marks
  such a block with `record_stream`).
- `enqueue`: the CPU's time to queue 8 GB of copies to host in 16 to 400
  pieces (each after a wait for the compute stream, or not), against the
  time they take to run: whether queuing copies holds the CPU up.
- `split`: ways to train taking turns, one `fit` each (`--variants`):
  Keras's step (`incore`), AutoVM's plan for the in-core need over
  `--factor` (`autovm`), the same with its copies to host left out (its
  Python without the link: `autovm_no_copies`), or with copies back on
  the stream that copies to host (`autovm_one_stream`, as before each
  direction had its own), and Keras's step with `--gb` GB copied to host
  from each step's start (the link without AutoVM's Python:
  `incore_busy_link`).
"""

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import measure  # noqa: E402 -- recipes/, on the path above
os.environ.setdefault("KERAS_BACKEND", "torch")
CHUNK = 512 << 20  # Bytes per side copy: large enough for the link's rate.


def host_facts(torch):
    """CPUs, NUMA nodes (their CPU lists), the GPU's node, load."""
    nodes = {}
    base = "/sys/devices/system/node"
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else ():
        if name.startswith("node") and name[4:].isdigit():
            with open(os.path.join(base, name, "cpulist")) as f:
                nodes[name] = f.read().strip()
    return {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "numa_nodes": nodes, "gpu_numa_node": _gpu_node(torch),
            "loadavg": os.getloadavg()}


def _gpu_node(torch):
    props = torch.cuda.get_device_properties(0)
    bus = getattr(props, "pci_bus_id", None)
    domain = getattr(props, "pci_domain_id", 0)
    device = getattr(props, "pci_device_id", None)
    if bus is None or device is None:
        return None
    path = f"/sys/bus/pci/devices/{domain:04x}:{bus:02x}:{device:02x}.0/numa_node"
    try:
        with open(path) as f:
            return int(f.read())
    except OSError:
        return None


class Link:
    """Pinned buffers and a side stream that copy `gb` GB when asked."""

    def __init__(self, torch):
        self.torch = torch
        self.device = torch.empty(CHUNK, dtype=torch.uint8, device="cuda")
        self.device2 = torch.empty_like(self.device)
        self.host = torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True)
        self.host2 = torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True)
        self.streams = torch.cuda.Stream(), torch.cuda.Stream()

    def start(self, gb, direction="d2h"):
        """Queues the copies (returns at once)."""
        count = max(1, round(gb * 1e9 / CHUNK))
        if direction in ("d2h", "both"):
            with self.torch.cuda.stream(self.streams[0]):
                for _ in range(count):
                    self.host.copy_(self.device, non_blocking=True)
        if direction in ("h2d", "both"):
            with self.torch.cuda.stream(self.streams[1]):
                for _ in range(count):
                    self.device2.copy_(self.host2, non_blocking=True)

    def busy(self):
        return not all(s.query() for s in self.streams)

    def wait(self):
        for s in self.streams:
            s.synchronize()

    def rate(self, gb, direction):
        """GB/s of `gb` GB copied in `direction` (both: the two summed)."""
        self.wait()
        start = time.perf_counter()
        self.start(gb, direction)
        self.wait()
        return gb * (2 if direction == "both" else 1) / (time.perf_counter() - start)


def python_work(n=400_000):
    """Dict and list traffic, as an interpreter running Keras makes."""
    table, out = {}, []
    for i in range(n):
        table[i & 4095] = (i, str(i & 255))
        out.append(table.get(i >> 3 & 4095))
    return len(out)


def part_python(torch, link, rounds):
    import numpy as np
    src = np.ones(256 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    work = {"python": python_work, "memcpy": lambda: np.copyto(dst, src)}
    out = {}
    for name, fn in work.items():
        for direction in ("d2h", "h2d", "both"):
            alone, busy, overlapped = [], [], 0
            for _ in range(rounds):
                start = time.perf_counter()
                fn()
                alone.append(time.perf_counter() - start)
                link.start(8, direction)  # ~0.15 s of copying: outlasts fn.
                start = time.perf_counter()
                fn()
                busy.append(time.perf_counter() - start)
                overlapped += link.busy()
                link.wait()
            out[f"{name}_{direction}"] = {
                "alone_ms": statistics.median(alone) * 1e3,
                "busy_ms": statistics.median(busy) * 1e3,
                "ratio": statistics.median(busy) / statistics.median(alone),
                "copies_outlasted_work": f"{overlapped}/{rounds}"}
    return out


def part_step(torch, link, args):
    import gpu_swap
    import numpy as np
    model = gpu_swap.build(args.model)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, 224, 224, 3)).astype("float32")
    y = rng.integers(0, 1000, args.batch)
    for _ in range(3):  # Builds the optimizer, warms cuDNN and the allocator.
        model.train_on_batch(x, y)
    alone, busy, outlasted = [], [], 0
    for _ in range(args.rounds * args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.train_on_batch(x, y)
        alone.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        start = time.perf_counter()
        link.start(args.gb, "d2h")
        model.train_on_batch(x, y)
        busy.append(time.perf_counter() - start)
        outlasted += link.busy()
        link.wait()
    return {"model": args.model, "batch": args.batch, "gb_per_step": args.gb,
            "alone_ms": [t * 1e3 for t in alone], "busy_ms": [t * 1e3 for t in busy],
            "median_alone_ms": statistics.median(alone) * 1e3,
            "median_busy_ms": statistics.median(busy) * 1e3,
            "ratio": statistics.median(busy) / statistics.median(alone),
            "copies_outlasted_step": f"{outlasted}/{len(busy)}"}


VARIANTS = ("incore", "autovm", "autovm_no_copies", "autovm_one_stream",
            "incore_busy_link")


def part_split(torch, link, args):
    """Keras's step, AutoVM's plan for the in-core need over `--factor`
    (not capped, as `gpu_overhead.py --factor` runs it), the same plan with
    its copies to host left out (swapped tensors are then kept: everything
    AutoVM does in Python but the copies), and Keras's step with `--gb` GB
    copied to host from each step's start; one `fit` each in turn."""
    import gpu_overhead
    import gpu_swap
    import keras
    import numpy as np

    import keras_autovm
    variants = args.variants.split(",")
    if variants[0] != "incore" or not set(variants) <= set(VARIANTS):
        raise SystemExit(f"--variants must start with incore and name only {VARIANTS}; "
                         f"got {args.variants!r}")
    models = {name: gpu_swap.build(args.model) for name in variants
              if name != "incore_busy_link"}
    models["incore_busy_link"] = models["incore"]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * args.steps, 224, 224, 3)).astype("float32")
    y = rng.integers(0, 1000, args.batch * args.steps)
    callbacks, budget = {}, None
    times = {name: [] for name in variants}
    phases = {name: [] for name in variants}
    for turn in range(args.rounds):
        for name in variants:
            extra = []
            if name.startswith("autovm"):
                if name not in callbacks:
                    callbacks[name] = keras_autovm.AutoVM(budget=budget, verbose=0)
                    if args.fixed_plan:  # Every AutoVM variant runs one plan.
                        callbacks[name]._calibrate = lambda *a, **k: False
                extra = [callbacks[name]]
            elif name == "incore_busy_link":
                extra = [_BusyLink(keras, link, args.gb)]
            timer = _phase_timer(keras)
            gpu_swap.reset_peak("torch")
            with _copies_left_out(name == "autovm_no_copies"), \
                    _streams_replaced(name), \
                    _phases(torch, timer, args.phases):
                models[name].fit(x, y, batch_size=args.batch, epochs=args.epochs,
                                 shuffle=False, verbose=0, callbacks=extra + [timer])
            link.wait()
            if budget is None:  # The in-core need, from the first in-core fit.
                need = gpu_swap.peak("torch") - gpu_overhead.variable_bytes(models["incore"])
                budget = int(need / args.factor)
            if turn:
                times[name].append(timer.times[1:])
                phases[name].extend(timer.phases[1:])
    out = _split_summary(args, variants, times, callbacks, budget)
    if args.phases:
        names = ("forward_python", "forward_catching_up", "backward", "rest")
        out["phases_ms"] = {n: {k: statistics.median(p[i] for p in phases[n]) * 1e3
                                for i, k in enumerate(names)} for n in variants}
    return out


def _phase_timer(keras):
    """`measure.step_timer`'s callback, which also splits each step of the
    last epoch into forward, backward and the rest at the marks that
    `measure.backward_marks` appends to its `marks`, where they are taken:
    the forward's Python (until the backward pass is called), the compute
    stream catching up, the backward, and the rest."""

    class PhaseTimer(type(measure.step_timer(keras))):
        marks = ()

        def on_epoch_begin(self, epoch, logs=None):
            super().on_epoch_begin(epoch, logs)
            self.phases = []

        def on_train_batch_begin(self, batch, logs=None):
            self.seen = len(self.marks)
            super().on_train_batch_begin(batch, logs)

        def on_train_batch_end(self, batch, logs=None):
            super().on_train_batch_end(batch, logs)
            if len(self.marks) >= self.seen + 3:
                came, before, after = self.marks[self.seen:self.seen + 3]
                end = self.start + self.times[-1]
                self.phases.append((came - self.start, before - came, after - before,
                                    end - after))

    return PhaseTimer()


@contextlib.contextmanager
def _phases(torch, timer, active):
    """Marks each backward pass for `timer`, waiting for the compute
    stream only (if `active`)."""
    if not active:
        yield
        return
    with measure.backward_marks(torch, all_streams=False, arrival=True) as marks:
        timer.marks = marks
        yield


def _split_summary(args, variants, times, callbacks, budget):
    medians = {n: statistics.median(t for run in times[n] for t in run) for n in variants}
    rounds = {n: [statistics.median(a) / statistics.median(b)
                  for a, b in zip(times["incore"], times[n])] for n in variants[1:]}
    return {"model": args.model, "batch": args.batch, "factor": args.factor,
            "budget_bytes": budget, "gb_per_busy_step": args.gb,
            "steps_ms": {n: [[t * 1e3 for t in run] for run in times[n]] for n in variants},
            "median_step_ms": {n: m * 1e3 for n, m in medians.items()},
            "ratio_to_incore": {n: medians["incore"] / medians[n] for n in variants[1:]},
            "ratio_to_incore_per_round": rounds,
            "autovm": {n: {"counts": c.plan.counts(), "stats": c.report.stats,
                           "predicted_step_s": c.report.epochs[-1]["predicted_step_time"]}
                       for n, c in callbacks.items()}}


def _BusyLink(keras, link, gb):
    class BusyLink(keras.callbacks.Callback):
        """Queues `gb` GB of copies to host as each step starts."""

        def on_train_batch_begin(self, batch, logs=None):
            link.wait()
            link.start(gb, "d2h")

    return BusyLink()


@contextlib.contextmanager
def _copies_left_out(active):
    """While open (if `active`), AutoVM's torch step copies nothing to
    host: what its plan swaps stays on the device, kept for the backward."""
    from keras_autovm.mechanisms.torch import swap
    original = swap.Step._copy_out
    if active:
        swap.Step._copy_out = lambda self, key, storage, device: None
    try:
        yield
    finally:
        swap.Step._copy_out = original


@contextlib.contextmanager
def _streams_replaced(name):
    """While open, for `autovm_one_stream`, AutoVM's torch step copies back
    on the stream that copies to host: copies back queue behind copies to
    host, as before each direction had its own stream."""
    from keras_autovm.mechanisms.torch import streams as streams_lib
    from keras_autovm.mechanisms.torch import swap
    original = swap.Step.__init__

    def init(self, layout, pool, streams, *rest, **kwargs):
        if streams is not None:
            streams = streams_lib.Streams(streams.to_host, streams.to_host)
        original(self, layout, pool, streams, *rest, **kwargs)

    if name == "autovm_one_stream":
        swap.Step.__init__ = init
    try:
        yield
    finally:
        swap.Step.__init__ = original


def part_calls(torch, repeats=2000):
    """Microseconds of CPU per call, each call alone, and the whole
    sequence `_copy_out` makes for one swapped storage. The copies are of
    64 KiB, so that the link never holds the loop up: the CPU's cost is
    what is timed."""
    side = torch.cuda.Stream()
    flat = torch.empty(64 << 10, dtype=torch.uint8, device="cuda")
    host = torch.empty(64 << 10, dtype=torch.uint8, pin_memory=True)
    storage = flat.untyped_storage()
    compute = torch.cuda.current_stream()
    event = torch.cuda.Event()
    event.record(side)

    def copy():
        with torch.cuda.stream(side):
            host.copy_(flat, non_blocking=True)

    def sequence():
        view = torch.empty(0, dtype=torch.uint8, device="cuda").set_(storage)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host.copy_(view, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        view.record_stream(side)
        done.query()

    calls = {
        "nothing": lambda: None,
        "current_stream": torch.cuda.current_stream,
        "wait_stream": lambda: side.wait_stream(compute),
        "stream_context": lambda: _enter_exit(torch, side),
        "view_of_storage": lambda: torch.empty(0, dtype=torch.uint8,
                                               device="cuda").set_(storage),
        "copy_to_host_in_context": copy,
        "event_new_and_record": lambda: torch.cuda.Event().record(side),
        "event_query": event.query,
        "record_stream": lambda: flat.record_stream(side),
        "whole_copy_out": sequence,
    }
    out = {}
    for name, fn in calls.items():
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for i in range(repeats):
                fn()
            times.append((time.perf_counter() - start) / repeats)
            side.synchronize()
        out[name] = min(times) * 1e6
    out["whole_copy_out_queued_behind_compute"] = _queued(torch, side, sequence)
    # Twice: behind the first such copy in a process the kernel took 78
    # ms, behind the second 0.07 ms (results/torch/host_contention/reuse.json).
    out["compute_behind_a_copy_ms"] = [_compute_behind_copy(torch, side)
                                       for _ in range(2)]
    return out


def _compute_behind_copy(torch, side, nbytes=4 << 30):
    """Milliseconds a tiny kernel on the compute stream takes to finish,
    launched just after a copy to host of `nbytes` was queued on `side`:
    near zero unless the compute stream waits for the other stream."""
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    small = torch.ones(16, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        host.copy_(device, non_blocking=True)
    start = time.perf_counter()
    small.add_(1.0)
    torch.cuda.current_stream().synchronize()
    kernel = time.perf_counter() - start
    copy_busy = not side.query()
    side.synchronize()
    return {"kernel_done_ms": kernel * 1e3, "copy_still_running_then": copy_busy,
            "copy_gb": nbytes / 1e9}


def _queued(torch, side, sequence, repeats=200):
    """The same sequence's CPU time while the compute stream is still busy
    (a sleeping kernel ahead of it), which an asynchronous copy must not
    wait for: microseconds per call."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # About a second of GPU time at ~2 GHz.
    start = time.perf_counter()
    for _ in range(repeats):
        sequence()
    spent = (time.perf_counter() - start) / repeats
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    return {"us": spent * 1e6, "compute_still_busy_after": busy}


def part_enqueue(torch, total=8e9):
    """Does queuing many copies to host hold the CPU up? `total` bytes as
    `count` copies, queued on a side stream each after a wait for
    the compute stream (as a swap queues them): the CPU's time to queue
    them all against the time they took to run."""
    side = torch.cuda.Stream()
    out = {}
    for count in (16, 64, 200, 400):
        size = int(total // count)
        device = torch.empty(size * count, dtype=torch.uint8, device="cuda")
        host = torch.empty(size * count, dtype=torch.uint8, pin_memory=True)
        for wait in (False, True):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for i in range(count):
                if wait:
                    side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    host[i * size:(i + 1) * size].copy_(device[i * size:(i + 1) * size],
                                                        non_blocking=True)
            queued = time.perf_counter() - start
            side.synchronize()
            done = time.perf_counter() - start
            out[f"{count}x{size >> 20}MiB" + ("_after_waits" if wait else "")] = {
                "queue_ms": queued * 1e3, "done_ms": done * 1e3}
        del device, host
    return out


def part_reuse(torch, nbytes=2 << 30, tries=5):
    """A copy back that no backward reads (its node did not run, or the
    step was given up) is dropped while it still runs; a tensor of zeros
    made at once must not get its block and then the copy's bytes. How
    many tries of `tries` had zeros overwritten, as AutoVM does it
    (`swap.Copy` marks such a block with `record_stream`) and without
    that mark (as before 2026-11-27)."""
    from keras_autovm.mechanisms.torch import streams, swap

    class Layout:
        max_in_flight = None

    host = torch.full((nbytes,), 7, dtype=torch.uint8, pin_memory=True)
    stats = {"bytes_to_device": 0}
    marked = swap.Copy.__del__
    out = {"tries": tries, "bytes": nbytes}
    for name, mark in (("marked", marked), ("not_marked", lambda self: None)):
        swap.Copy.__del__ = mark
        try:
            dirty = 0
            for _ in range(tries):
                torch.cuda.synchronize()
                step = swap.Step(Layout(), None, streams.Streams.shared(), stats, [])
                done = torch.cuda.Event()
                done.record()
                copy = swap.Copy(host, nbytes, torch.device("cuda"), done)
                step.fetch(copy)
                del copy  # Never unpacked: freed with its copy back running.
                zeros = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
                torch.cuda.synchronize()
                dirty += bool(zeros.any().item())
                del zeros
        finally:
            swap.Copy.__del__ = marked
        out[f"zeros_overwritten_{name}"] = dirty
    return out


def _enter_exit(torch, stream):
    with torch.cuda.stream(stream):
        pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet152")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--gb", type=float, default=8.0,
                        help="GB copied to host at the start of each busy step")
    parser.add_argument("--factor", type=float, default=3.0,
                        help="split: AutoVM's budget is the in-core need over this")
    parser.add_argument("--epochs", type=int, default=2,
                        help="split: epochs per fit, the last timed")
    parser.add_argument("--variants", default="incore,autovm,autovm_no_copies,incore_busy_link",
                        help=f"split: which of {', '.join(VARIANTS)} take turns "
                             "(incore first)")
    parser.add_argument("--phases", action="store_true",
                        help="split: wait for the compute stream around each "
                             "backward pass and report the forward's Python, the "
                             "compute stream catching up, the backward and the rest")
    parser.add_argument("--fixed-plan", action="store_true",
                        help="split: AutoVM keeps its first plan (no calibration "
                             "or replanning), so that its variants run the same plan")
    parser.add_argument("--parts", default="python,calls,step,split")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch
    import gpu_swap
    if not torch.cuda.is_available():
        sys.exit("gpu_host_contention.py: needs a CUDA GPU")
    parts = args.parts.split(",")
    link = Link(torch)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "command": " ".join(["python3"] + sys.argv),
               "versions": gpu_swap.versions("torch"), "host": host_facts(torch),
               "link_gbps": {d: link.rate(8, d) for d in ("d2h", "h2d", "both")}}
    if "python" in parts:
        results["python"] = part_python(torch, link, 2 * args.rounds)
        print("python:", results["python"], flush=True)
    if "calls" in parts:
        results["calls_us"] = part_calls(torch)
        print("calls (us):", results["calls_us"], flush=True)
    if "reuse" in parts:
        results["reuse"] = part_reuse(torch)
        print("reuse:", results["reuse"], flush=True)
    if "enqueue" in parts:
        results["enqueue"] = part_enqueue(torch)
        print("enqueue:", results["enqueue"], flush=True)
    if "step" in parts:
        results["step"] = part_step(torch, link, args)
        s = results["step"]
        print(f"step: alone {s['median_alone_ms']:.1f} ms, with {args.gb} GB to host "
              f"{s['median_busy_ms']:.1f} ms ({s['ratio']:.3f}x); copies outlasted "
              f"{s['copies_outlasted_step']}", flush=True)
    if "split" in parts:
        results["split"] = part_split(torch, link, args)
        s = results["split"]
        print("split: median steps (ms)", s["median_step_ms"], "ratio to in-core",
              s["ratio_to_incore"], "per round", s["ratio_to_incore_per_round"],
              "phases (ms)", s.get("phases_ms"),
              "AutoVM", {n: (a["counts"], a["stats"].get("bytes_to_host"))
                         for n, a in s["autovm"].items()}, flush=True)
    results["host"]["loadavg_after"] = os.getloadavg()
    print("host:", results["host"], "link:", results["link_gbps"], flush=True)
    measure.save(results, args.out)


if __name__ == "__main__":
    main()
