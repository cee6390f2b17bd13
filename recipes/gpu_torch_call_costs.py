"""Where a swapped torch step's CPU time goes, function by function and
CUDA call by CUDA call (torch).

    python3 recipes/gpu_torch_call_costs.py --model resnet152 --batch 64 \\
        --out $OUT/call_costs.json

Held to one plan, AutoVM's copies to host lengthen ResNet-152's forward at
3x by 60 to 79 ms of CPU (docs/results.md, "What the copies cost a
Python-bound step"), while one copy's CUDA calls cost 31 to 49 us alone.
This recipe trains, taking turns in one process, Keras's step (`incore`),
AutoVM's plan for the in-core need over `--factor` (`autovm`), and the same
plan with its copies to host left out (`autovm_no_copies`), every AutoVM
variant on its first plan (`--parts steps`). In the last round it reports
for each variant:

- `functions_ms`: the wall time per step inside `swap.Step`'s methods
  (inclusive: `layer_done` holds `_copy_out` and `_free`), and how often
  each ran, from perf_counter wrappers (about a microsecond each), over
  every epoch of the last round (the profiled ones too);
- `calls`: one step under `torch.profiler` (CPU and CUDA activity): each
  operator's and CUDA runtime call's count and self CPU time, the most
  costly first, and, for `autovm`, what it adds to `autovm_no_copies`;
- `python_top`, `python_added_by_autovm`, `python_added_by_copies`
  (`--cprofile`): the same for Python's functions, their own time per
  step under cProfile, from one more epoch (the main thread's: on a GPU
  the backward runs on autograd's device thread, inside `run_backward`);
- `threads_busy`: the busiest threads of the process over the last
  round's timed fit, each as its share of one CPU (from /proc);
- `step_collections`: Python's collections inside those fits' timed
  steps (the profiled epoch's not counted), by generation, with their
  seconds;
- `allocator_per_step`: how far the caching allocator's counters moved
  per step in those fits (`ALLOCATOR_COUNTERS`; each epoch's first step
  left out).

More variants take AutoVM apart, one part at a time (`ablation`):
`incore_views`, `incore_hooks`, `autovm_keep_hooks`; `incore_gc_quiet`
and `autovm_gc_quiet` raise Python's first collection threshold.

`--parts dispatch` first times small torch calls alone and while the link
copies to and from pinned host memory (`part_dispatch`); `--parts
pattern` times a loop shaped like a swapped forward pass with its copies
and without (`part_pattern`).

AutoVM's budget is the in-core need (the first in-core fit's peak less
every variant's weights) over `--factor`. The files now in
results/torch/call_costs/ were made while only the in-core model's weights
were taken off, so their budgets are higher by the other variants' weights
(about 0.24 GB each for ResNet-152).
"""

import argparse
import collections
import contextlib
import datetime
import functools
import gc
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
os.environ.setdefault("KERAS_BACKEND", "torch")

import gpu_host_contention as contention  # noqa: E402 -- recipes/, on the path above
import measure  # noqa: E402

VARIANTS = ("incore", "autovm", "autovm_no_copies", "incore_gc_quiet", "autovm_gc_quiet",
            "incore_views", "incore_hooks", "autovm_keep_hooks")
# The caching allocator's counters read around each timed step of the last
# round: device allocations and frees (cudaMalloc/cudaFree, or mapping and
# unmapping with expandable segments) and waits on every stream, which cost
# the CPU far more than a cached block.
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc",
                      "num_device_free", "allocation.all.allocated",
                      "segment.all.allocated", "segment.all.freed")
QUIET = 200_000  # Python's first collection threshold in the `_gc_quiet` variants.
TIMED = ("pack", "unpack", "layer_done", "_copy_out", "_free", "_release",
         "_bound_in_flight", "_swap_internal", "fetch", "forward_done")


@contextlib.contextmanager
def timed_methods(totals):
    """While open, `totals[name]` gathers [calls, seconds] of each
    `swap.Step` method in `TIMED`."""
    from keras_autovm.mechanisms.torch import swap
    originals = {name: getattr(swap.Step, name) for name in TIMED}

    def wrap(name, method):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                entry = totals[name]
                entry[0] += 1
                entry[1] += time.perf_counter() - start
        return timed

    for name, method in originals.items():
        setattr(swap.Step, name, wrap(name, method))
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(swap.Step, name, method)


def step_collections(keras, counter):
    """A callback counting, in `counter`, Python's collections that run
    inside training steps (from a step's start to its end), by
    generation: `counter[g]` and their seconds `counter[f"{g}_s"]`.
    Collections between steps (AutoVM's planning, Keras's epoch ends) are
    left out."""

    class StepCollections(keras.callbacks.Callback):
        inside, began = False, None

        def note(self, phase, info):
            if not self.inside:
                return
            if phase == "start":
                self.began = time.perf_counter()
            elif self.began is not None:
                generation = info["generation"]
                counter[generation] += 1
                counter[f"{generation}_s"] += time.perf_counter() - self.began
                self.began = None

        def on_train_begin(self, logs=None):
            gc.callbacks.append(self.note)

        def on_train_end(self, logs=None):
            gc.callbacks.remove(self.note)

        def on_train_batch_begin(self, batch, logs=None):
            self.inside = True
            counter["steps"] += 1

        def on_train_batch_end(self, batch, logs=None):
            self.inside = False

    return StepCollections()


@contextlib.contextmanager
def ablation(name):
    """While open, what variant `name` adds to Keras's step, one part of
    AutoVM at a time: `incore_views` runs Keras's convolutions and max
    pooling on views of their inputs (AutoVM does for its whole fit);
    `incore_hooks` that and saved-tensor hooks that hand autograd's tensors
    back unchanged around each training forward; `autovm_keep_hooks` is
    AutoVM keeping every output but run under its hooks (it frees what no
    backward reads) instead of leaving the step unchanged."""
    import torch

    from keras_autovm import internals
    from keras_autovm.mechanisms.torch import mechanism
    with contextlib.ExitStack() as stack:
        if name in ("incore_views", "incore_hooks"):
            stack.enter_context(internals.torch_inputs_on_views())
        if name == "incore_hooks":
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(
                lambda t: t, lambda t: t))
        if name == "autovm_keep_hooks":
            # Planned as if an unchanged step freed nothing, so a keep-all
            # plan runs under the hooks; set back before the next turn.
            stack.callback(setattr, mechanism.TorchMechanism, "holds_outputs",
                           mechanism.TorchMechanism.holds_outputs)
            mechanism.TorchMechanism.holds_outputs = False
        yield


def step_allocator(keras, torch, totals):
    """A callback adding, in `totals`, how much each of the allocator's
    `ALLOCATOR_COUNTERS` moved inside training steps, each epoch's first
    step left out (`totals["steps"]`: how many steps were counted). After
    `measure.step_timer` in the callbacks, its first read falls inside
    the timed step, alike for every variant."""

    def counters():
        stats = torch.cuda.memory_stats()
        return collections.Counter({k: stats.get(k, 0) for k in ALLOCATOR_COUNTERS})

    class StepAllocator(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.before = counters() if batch else None

        def on_train_batch_end(self, batch, logs=None):
            if self.before is not None:
                after = counters()
                totals.update({k: after[k] - self.before[k] for k in after})
                totals["steps"] += 1

    return StepAllocator()


@contextlib.contextmanager
def gc_quiet(active):
    """While open (if `active`), Python's young collections run
    `QUIET / 700` times less often."""
    thresholds = gc.get_threshold()
    if active:
        gc.set_threshold(QUIET, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def profiler_callback(keras, torch, step, out):
    """Profiles training step `step` of the epoch (CPU and CUDA activity)
    and stores each event's count and self CPU time in `out`."""
    from torch.profiler import ProfilerActivity, profile

    class Profile(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == step:
                torch.cuda.synchronize()
                self.profile = profile(activities=[ProfilerActivity.CPU,
                                                   ProfilerActivity.CUDA])
                self.profile.__enter__()
                self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if batch == step:
                torch.cuda.synchronize()
                out["step_ms"] = (time.perf_counter() - self.start) * 1e3
                self.profile.__exit__(None, None, None)
                out["events"] = {
                    e.key: {"count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                            "cpu_ms": e.cpu_time_total / 1e3}
                    for e in self.profile.key_averages()}

    return Profile()


def thread_cpu():
    """{thread id: [name, seconds of CPU so far]} for each of the
    process's threads (Linux's /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # The thread ended.
            continue
        threads[tid] = [name, (int(fields[11]) + int(fields[12])) / ticks]
    return threads


def threads_busy(before, after, seconds, n=8):
    """The `n` threads that used the most CPU between two `thread_cpu`
    readings, as a share of `seconds` of wall time."""
    used = {f"{tid} {name}": round((cpu - before.get(tid, [name, 0.0])[1]) / seconds, 3)
            for tid, (name, cpu) in after.items()}
    return dict(sorted(used.items(), key=lambda kv: -kv[1])[:n])


def siblings():
    """Each CPU's hyperthread siblings, as Linux lists them."""
    base = "/sys/devices/system/cpu"
    found = set()
    for name in os.listdir(base):
        path = f"{base}/{name}/topology/thread_siblings_list"
        if name[3:].isdigit() and os.path.exists(path):
            with open(path) as f:
                found.add(f.read().strip())
    return sorted(found)


def cprofile_callback(keras, out):
    """Runs every step of the epoch but the first under cProfile and
    stores, per Python function, its calls and own and cumulative
    milliseconds per step in `out` (cProfile inflates them all)."""
    import cProfile
    import pstats

    class Profile(keras.callbacks.Callback):
        profile, steps = cProfile.Profile(), 0

        def on_train_batch_begin(self, batch, logs=None):
            if batch:
                self.steps += 1
                self.profile.enable()

        def on_train_batch_end(self, batch, logs=None):
            if batch:
                self.profile.disable()

        def on_train_end(self, logs=None):
            stats = pstats.Stats(self.profile).stats
            for (path, line, function), (_, calls, own, cumulative, _) in stats.items():
                where = "/".join(path.split("/")[-3:])
                out[f"{where}:{line}:{function}"] = {
                    "count": calls / self.steps, "tottime_ms": own / self.steps * 1e3,
                    "cumtime_ms": cumulative / self.steps * 1e3}

    return Profile()


def top(events, n, key="self_cpu_ms"):
    """The `n` events that spend the most `key`."""
    ranked = sorted(events.items(), key=lambda kv: -kv[1][key])
    return dict(ranked[:n])


def added(events, base, n, key="self_cpu_ms"):
    """What `events` spends beyond `base`, by event, the most first."""
    names = set(events) | set(base)
    zero = {"count": 0, key: 0.0}
    diff = {k: {"count": events.get(k, zero)["count"] - base.get(k, zero)["count"],
                key: events.get(k, zero)[key] - base.get(k, zero)[key]} for k in names}
    return top(diff, n, key)


def dispatch_us(torch, a, n):
    """Microseconds of CPU per round of three small torch calls on the GPU
    (a view, an allocation, a kernel launch), as a step's layers make."""
    start = time.perf_counter()
    for _ in range(n):
        a.view(-1)
        torch.empty(256, device="cuda")
        a.add_(1.0)
    return (time.perf_counter() - start) / n * 1e6


def part_dispatch(torch, rounds, n=4000, gb=16):
    """`dispatch_us` alone and while `gb` GB are copied on a side stream:
    to one 512 MiB pinned buffer over and over (`d2h_same`), to `gb`
    GB of distinct pinned memory (`d2h_distinct`, as a swap plan's host
    pool is written), and back from it (`h2d_distinct`), taking turns. The
    loop is short enough to end before the copies do (checked)."""
    chunk = 512 << 20
    device = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    pieces = int(gb * 1e9 // chunk)
    host = torch.empty(pieces * chunk, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    a = torch.zeros(64, device="cuda")

    def start(mode):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(pieces):
                target = host[i * chunk:(i + 1) * chunk]
                if mode == "d2h_same":
                    host[:chunk].copy_(device, non_blocking=True)
                elif mode == "d2h_distinct":
                    target.copy_(device, non_blocking=True)
                elif mode == "h2d_distinct":
                    device.copy_(target, non_blocking=True)

    modes = ("alone", "d2h_same", "d2h_distinct", "h2d_distinct")
    times = {m: [] for m in modes}
    outlasted = {m: True for m in modes[1:]}
    dispatch_us(torch, a, n)  # Warm.
    for _ in range(rounds):
        for mode in modes:
            torch.cuda.synchronize()
            if mode != "alone":
                start(mode)
            times[mode].append(dispatch_us(torch, a, n))
            if mode != "alone":
                outlasted[mode] &= not side.query()
            torch.cuda.synchronize()
    medians = {m: statistics.median(t) for m, t in times.items()}
    return {"us_per_round": times, "median_us": medians,
            "ratio_to_alone": {m: medians[m] / medians["alone"] for m in modes[1:]},
            "copies_outlasted_loop": outlasted, "gb": gb, "calls": n}


def pattern_ms(torch, mode, pool, layers=800, every=5, work=40, nbytes=40 << 20):
    """Milliseconds of CPU for a loop shaped like a swapped forward pass:
    `layers` layers of `work` small torch calls each (a view, an
    allocation, a launch), every `every`-th making an `nbytes` output. With
    `mode` "copy", that output is copied to its own slice of `pool` on a
    side stream (after a wait for the compute stream, an event recorded)
    and freed under `record_stream`, as `swap.Step` does; "copy_kept"
    keeps it alive to the loop's end instead (no `record_stream`);
    "none" makes and drops it."""
    side = _pattern_stream(torch)
    small = torch.zeros(64, device="cuda")
    kept, events = [], []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(layers):
        for _ in range(work):
            small.view(-1)
            torch.empty(256, device="cuda")
            small.add_(1.0)
        if i % every:
            continue
        out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        if mode == "none":
            continue
        host = pool[(i // every) * nbytes:(i // every + 1) * nbytes]
        # The calls of `swap.Step._copy_out`, written out as
        # gpu_host_contention.py's `part_calls` does: a timed mimic, not a
        # helper shared with the package (a call into it would add its own
        # Python to what is timed).
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host.copy_(out, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        events.append(event)  # Held to the end, as `swap.Step` holds its in flight.
        if mode == "copy":
            out.record_stream(side)
        else:
            kept.append(out)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed * 1e3


def _pattern_stream(torch, cache={}):
    # One side stream, made once, for every loop: as `swap.Step` copies on
    # one stream per process.
    return cache.setdefault("side", torch.cuda.Stream())


def part_pattern(torch, rounds, layers=800, every=5, nbytes=40 << 20):
    """`pattern_ms` in each mode, taking turns."""
    pool = torch.empty(layers // every * nbytes, dtype=torch.uint8, pin_memory=True)
    modes = ("none", "copy", "copy_kept")
    pattern_ms(torch, "copy", pool)  # Warm.
    times = {m: [] for m in modes}
    for _ in range(rounds):
        for mode in modes:
            times[mode].append(pattern_ms(torch, mode, pool))
    medians = {m: statistics.median(t) for m, t in times.items()}
    return {"ms": times, "median_ms": medians,
            "ratio_to_none": {m: medians[m] / medians["none"] for m in modes[1:]},
            "copies": layers // every, "copy_bytes": nbytes}


class Record:
    """What the turns of one run gather, per variant."""

    def __init__(self, variants):
        self.times = {n: [] for n in variants}  # Each fit's steps, after round one.
        self.peaks = {n: [] for n in variants}  # Each fit's peak, after round one.
        self.functions, self.busy = {}, {}  # The last round's.
        self.calls = {n: {} for n in variants}
        self.pythons = {n: {} for n in variants}
        self.collections = {n: collections.Counter() for n in variants}
        self.callbacks, self.budget = {}, None
        self.allocator = {}  # The last round's allocator counters, per step.


def turn(args, modules, record, name, model, data, turn_index):
    """One variant's fit of `--epochs`, and, in the last round, its
    profiled epochs; records what `Record` holds."""
    keras, torch, keras_autovm = modules
    last = turn_index == args.rounds - 1
    extra = []
    if name.startswith("autovm"):
        if name not in record.callbacks:
            budget = None if name == "autovm_keep_hooks" else record.budget
            record.callbacks[name] = keras_autovm.AutoVM(budget=budget, verbose=0)
            record.callbacks[name]._calibrate = lambda *a, **k: False  # One plan.
        extra = [record.callbacks[name]]
    timer = measure.step_timer(keras)
    totals = collections.defaultdict(lambda: [0, 0.0])
    counted = step_collections(keras, record.collections[name] if last
                               else collections.Counter())
    torch.cuda.reset_peak_memory_stats()
    fit = functools.partial(model.fit, *data, batch_size=args.batch, shuffle=False, verbose=0)
    with contention._copies_left_out(name == "autovm_no_copies"), \
            gc_quiet(name.endswith("_gc_quiet")), ablation(name), timed_methods(totals):
        before, start = thread_cpu(), time.perf_counter()
        allocator = collections.Counter()
        fit(epochs=args.epochs, callbacks=extra + [timer, counted,
                                                   step_allocator(keras, torch, allocator)])
        if last:
            record.allocator[name] = {k: allocator[k] / max(allocator["steps"], 1)
                                      for k in ALLOCATOR_COUNTERS}
            record.busy[name] = threads_busy(before, thread_cpu(),
                                             time.perf_counter() - start)
            # One more epoch with a step under torch's profiler, and one
            # under cProfile: inside the wrappers, whose totals count them.
            fit(epochs=1, callbacks=extra + [profiler_callback(
                keras, torch, args.steps - 2, record.calls[name])])
            if args.cprofile:
                fit(epochs=1, callbacks=extra + [cprofile_callback(
                    keras, record.pythons[name])])
    if turn_index:
        record.times[name].append(timer.times[1:])
        record.peaks[name].append(torch.cuda.max_memory_allocated())
    if last:
        steps = args.steps * (args.epochs + 1 + args.cprofile)  # Every epoch's.
        record.functions[name] = {
            k: {"calls_per_step": c / steps, "ms_per_step": s / steps * 1e3}
            for k, (c, s) in totals.items()}


def run(args):
    import gpu_overhead
    import gpu_swap
    import keras
    import numpy as np
    import torch

    import keras_autovm
    variants = args.variants.split(",")
    if (variants[:3] != list(VARIANTS[:3]) or not set(variants) <= set(VARIANTS)
            or len(set(variants)) != len(variants)):
        raise SystemExit(f"--variants must start with {','.join(VARIANTS[:3])} and name "
                         f"only {VARIANTS}, each once; got {args.variants!r}")
    models = {name: gpu_swap.build(args.model) for name in variants}
    rng = np.random.default_rng(0)
    data = (rng.normal(size=(args.batch * args.steps, 224, 224, 3)).astype("float32"),
            rng.integers(0, 1000, args.batch * args.steps))
    record = Record(variants)
    for turn_index in range(args.rounds):
        for name in variants:
            turn(args, (keras, torch, keras_autovm), record, name, models[name], data,
                 turn_index)
            if record.budget is None:  # The in-core need, from the first in-core fit:
                # every variant's model is on the device by then.
                weights = sum(gpu_overhead.variable_bytes(m) for m in models.values())
                need = torch.cuda.max_memory_allocated() - weights
                record.budget = int(need / args.factor)
    return summary(args, variants, record)


def summary(args, variants, record):
    medians = {n: statistics.median(t for run in record.times[n] for t in run)
               for n in variants}
    calls = {n: record.calls[n].get("events", {}) for n in variants}
    pythons = record.pythons
    return {"model": args.model, "batch": args.batch, "factor": args.factor,
            "budget_bytes": record.budget,
            "median_step_ms": {n: m * 1e3 for n, m in medians.items()},
            "median_step_ms_by_round": {n: [statistics.median(run) * 1e3
                                            for run in record.times[n]] for n in variants},
            "ratio_to_incore": {n: medians["incore"] / medians[n] for n in variants[1:]},
            "functions_ms": record.functions,
            "peak_allocated_bytes": record.peaks,
            "allocator_per_step": record.allocator,
            "threads_busy": record.busy,
            "step_collections": {n: {str(k): v for k, v in c.items()}
                                 for n, c in record.collections.items()},
            "profiled_step_ms": {n: record.calls[n].get("step_ms") for n in variants},
            "calls_top": {n: top(calls[n], args.top) for n in variants},
            "calls_added_by_copies": added(calls["autovm"], calls["autovm_no_copies"],
                                           args.top),
            "calls_added_by_autovm": added(calls["autovm_no_copies"], calls["incore"],
                                           args.top),
            "python_top": {n: top(pythons[n], args.top, "tottime_ms") for n in variants},
            "python_added_by_autovm": added(pythons["autovm_no_copies"], pythons["incore"],
                                            args.top, "tottime_ms"),
            "python_added_by_copies": added(pythons["autovm"], pythons["autovm_no_copies"],
                                            args.top, "tottime_ms"),
            "autovm": {n: {"counts": c.plan.counts(), "stats": c.report.stats}
                       for n, c in record.callbacks.items()}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet152")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--cprofile", action="store_true",
                        help="steps: in the last round, one more epoch per variant "
                             "under cProfile (functions' own time per step)")
    parser.add_argument("--top", type=int, default=30,
                        help="how many profiler events to keep per list")
    parser.add_argument("--variants", default=",".join(VARIANTS[:3]),
                        help=f"steps: which of {', '.join(VARIANTS)} take turns "
                             f"(the first three first)")
    parser.add_argument("--parts", default="dispatch,pattern,steps",
                        help="dispatch: small torch calls with the link busy and not; "
                             "pattern: a swap-shaped loop with copies and without; "
                             "steps: the variants' steps, timed and profiled")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch
    import gpu_swap
    if not torch.cuda.is_available():
        sys.exit("gpu_torch_call_costs.py: needs a CUDA GPU")
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "command": " ".join(["python3"] + sys.argv),
               "versions": gpu_swap.versions("torch"),
               "host": dict(contention.host_facts(torch), siblings=siblings())}
    if "dispatch" in args.parts:
        results["dispatch"] = part_dispatch(torch, args.rounds * 2)
        print("dispatch:", results["dispatch"]["median_us"], results["dispatch"]["ratio_to_alone"],
              results["dispatch"]["copies_outlasted_loop"], flush=True)
    if "pattern" in args.parts:
        results["pattern"] = part_pattern(torch, args.rounds * 2)
        print("pattern:", results["pattern"]["median_ms"], results["pattern"]["ratio_to_none"],
              flush=True)
    if "steps" not in args.parts:
        measure.save(results, args.out)
        return
    results.update(run(args))
    print("median steps (ms)", results["median_step_ms"], "ratio", results["ratio_to_incore"])
    for name in results["ratio_to_incore"]:
        print(name, "functions (ms/step):",
              {k: round(v["ms_per_step"], 1) for k, v in results["functions_ms"][name].items()})
    for key in ("calls_added_by_copies", "calls_added_by_autovm"):
        print(key, {k: (v["count"], round(v["self_cpu_ms"], 1))
                    for k, v in list(results[key].items())[:15]}, flush=True)
    for key in ("python_added_by_autovm", "python_added_by_copies"):
        print(key, {k: (round(v["count"]), round(v["tottime_ms"], 1))
                    for k, v in list(results[key].items())[:20]}, flush=True)
    measure.save(results, args.out)


if __name__ == "__main__":
    main()
