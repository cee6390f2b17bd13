"""Where a torch training step's time goes under AutoVM, against in-core.

    python3 recipes/gpu_torch_step_profile.py --model vgg19 --batch 64 \\
        --cap-gib 10.9 --out $OUT/step_profile_vgg19.json

Each variant trains in its own process: in-core without a cap, then
`AutoVM(budget=<cap>)` under the cap (and, with `--policies`, AutoVM under
named policies). Three epochs of `--steps` steps: the first plans and
calibrates; the second runs under `torch.profiler` from its second step on;
a third, not profiled, splits each step into forward, backward and the rest
(the device synchronized around the backward pass). With `--cprofile`, a
fourth epoch runs under Python's `cProfile`: the functions that took the
most of its time by themselves, and that time summed by where the code
lives (keras_autovm, Keras, torch, the rest), to find whose Python a
Python-bound step spends. The caching allocator's counters (retries, device
allocations, frees, whole-device syncs) are read around the third epoch.
From the profiler's trace, per step: the wall time (each step waits for the
device), the time the GPU ran kernels (the union of their intervals), the
copies to host and back (and how much of them ran while no kernel did), and
the time the GPU did nothing (roughly: the timed steps' wall time less
the GPU's busy time over the whole profiled window). A step longer than its
plan is then more kernels (recompute), exposed copies, or a GPU waiting for
Python.

`--variants` names the runs instead (`incore`, `autovm`, `autovm:<policy>`),
each optionally with settings: `+expandable` or `+fixed` runs it
with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` or `:False` (AutoVM
turns expandable segments on unless the user chose); `+uncapped` plans
AutoVM for `--cap-gib` but leaves the allocator uncapped, as
`gpu_overhead.py --factor` runs it.
"""

import argparse
import cProfile
import datetime
import json
import os
import pstats
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import measure  # noqa: E402 -- recipes/, on the path above
os.environ.setdefault("KERAS_BACKEND", "torch")
GiB = 2**30
ALLOCATOR = {"expandable": "True", "fixed": "False"}


def union(intervals):
    """Merged (start, end) intervals, sorted."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def length(intervals):
    return sum(end - start for start, end in intervals)


def outside(intervals, cover):
    """How much of `intervals` (merged) lies outside `cover` (merged)."""
    return length(intervals) - length(_intersection(intervals, cover))


def _intersection(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append([start, end])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def breakdown(trace, steps, wall_s):
    """Per-step GPU times (ms) from a Chrome trace of `steps` steps."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    kernels = union((e["ts"], e["ts"] + e["dur"]) for e in events
                    if e.get("cat") == "kernel")
    copies = {d: union((e["ts"], e["ts"] + e["dur"]) for e in events
                       if e.get("cat") == "gpu_memcpy" and d in e.get("name", ""))
              for d in ("DtoH", "HtoD")}
    busy = union(kernels + copies["DtoH"] + copies["HtoD"])
    ms = 1e-3 / steps  # Trace times are microseconds.
    # Where the CPU waited: CUDA runtime and driver calls by total time
    # (the allocator's expandable segments map and unmap through the
    # driver; a cudaFree or
    # a synchronize stops the CPU from queueing work ahead of the GPU).
    runtime = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            runtime[e["name"]] = runtime.get(e["name"], 0.0) + e["dur"] * ms
    # The CPU-side operators by summed time (nested ones count in their
    # callers too): what the Python of a step asks of torch.
    cpu_ops = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            cpu_ops[e["name"]] = cpu_ops.get(e["name"], 0.0) + e["dur"] * ms
    origin = min((start for start, _ in busy), default=0)
    big = [{"name": e["name"], "start_ms": (e["ts"] - origin) / 1e3,
            "ms": e["dur"] / 1e3,
            "without_kernels_ms": outside([[e["ts"], e["ts"] + e["dur"]]], kernels) / 1e3}
           for e in sorted(events, key=lambda e: e["ts"])
           if e.get("cat") == "gpu_memcpy" and e["dur"] > 1000][:12]
    return {
        "big_copies": big,
        "d2h_without_kernels_ms": outside(copies["DtoH"], kernels) * ms,
        "h2d_without_kernels_ms": outside(copies["HtoD"], kernels) * ms,
        "cuda_runtime_ms": dict(sorted(runtime.items(), key=lambda kv: -kv[1])[:12]),
        "cpu_ops_ms": dict(sorted(cpu_ops.items(), key=lambda kv: -kv[1])[:20]),
        "wall_ms": wall_s * 1e3 / steps,
        "kernels_ms": length(kernels) * ms,
        "d2h_ms": length(copies["DtoH"]) * ms,
        "h2d_ms": length(copies["HtoD"]) * ms,
        "copies_without_kernels_ms": outside(union(copies["DtoH"] + copies["HtoD"]),
                                             kernels) * ms,
        "gpu_busy_ms": length(busy) * ms,
        "gpu_idle_ms": wall_s * 1e3 / steps - length(busy) * ms,
    }


def allocator_counts(torch):
    """The caching allocator's running counts that cost the CPU a call into
    CUDA or a wait: retries after a failed allocation (each frees the cache
    and synchronizes), device allocations and frees, whole-device syncs."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc",
                                         "num_device_free", "num_sync_all_streams")}


def python_time(profile, steps):
    """Per step (ms): the 25 functions with the most time of their own,
    all such time summed by where the code lives, and AutoVM's 20 functions
    with the most time inside them (callees included)."""
    stats = pstats.Stats(profile).stats
    where = {}
    rows, ours = [], []
    for (path, line, name), (_, calls, own, total, _) in stats.items():
        if "keras_autovm" in path:
            ours.append((total * 1e3 / steps, calls // steps,
                         f"{path.split('keras_autovm/')[-1]}:{line}({name})"))
        home = ("keras_autovm" if "keras_autovm" in path else
                "keras" if "/keras/" in path else
                "torch" if "/torch/" in path else
                "builtin" if path == "~" else "other")
        where[home] = where.get(home, 0.0) + own * 1e3 / steps
        rows.append((own * 1e3 / steps, calls // steps, f"{path.split('site-packages/')[-1]}:"
                     f"{line}({name})"))
    rows.sort(reverse=True)
    ours.sort(reverse=True)
    return {"own_ms_by_home": where,
            "keras_autovm_total_ms": [{"ms": ms, "calls": calls, "function": name}
                                      for ms, calls, name in ours[:20]],
            "top_own_ms": [{"ms": ms, "calls": calls, "function": name}
                           for ms, calls, name in rows[:25]]}


def child(args):
    import gpu_swap
    import keras
    import numpy as np
    import torch

    variant, *settings = args.variant.split("+")
    cap = 0.0 if variant == "incore" else args.cap_gib
    if torch.cuda.is_available():
        gpu_swap.setup("torch", 0.0 if "uncapped" in settings else cap)
    model = gpu_swap.build(args.model)
    callbacks = []
    if variant != "incore":
        import keras_autovm
        policy = variant.split(":", 1)[1] if ":" in variant else "auto"
        callbacks.append(keras_autovm.AutoVM(budget=int(cap * GiB), policy=policy,
                                             verbose=0))
    profiled = profiling_callback(keras, torch)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * args.steps, 224, 224, 3)).astype("float32")
    y = rng.integers(0, 1000, args.batch * args.steps)
    model.fit(x, y, batch_size=args.batch, epochs=4 if args.cprofile else 3,
              shuffle=False, verbose=0, callbacks=callbacks + [profiled])
    out = {"variant": args.variant, "cap_gib": cap, "batch": args.batch,
           "allocator_capped": bool(cap) and "uncapped" not in settings,
           "profiled_steps": len(profiled.times),
           "step_ms": [t * 1e3 for t in profiled.times],
           "per_step": breakdown(profiled.trace, len(profiled.times), sum(profiled.times)),
           # The third epoch, not profiled, with the device synchronized
           # around the backward pass: (forward, backward, the rest) per step.
           "split_ms": [[t * 1e3 for t in split] for split in profiled.splits[1:]],
           "allocator": profiled.allocator,
           "cprofile": profiled.python,
           "peak_bytes": torch.cuda.max_memory_allocated()
           if torch.cuda.is_available() else None}
    if callbacks:
        out.update(gpu_swap.plan_facts(callbacks[0]))
    measure.report(out)


def profiling_callback(keras, torch):
    """Profiles the second epoch from its second step, each step timed to
    the device's end (the loss is read back)."""

    class Profiled(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.trace, self.profiler, self.epoch = [], None, None, 0
            self.splits, self.marks, self.split = [], [], None
            self.allocator, self.python, self.cprofile = None, None, None

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            if epoch == 2:
                self.split = measure.backward_marks(torch)
                self.marks = self.split.__enter__()
                self.allocator = allocator_counts(torch)

        def on_train_batch_begin(self, batch, logs=None):
            if self.epoch == 3 and batch == 1:
                self.cprofile = cProfile.Profile()
                self.cprofile.enable()
            if self.epoch == 1 and batch == 1:
                self.profiler = torch.profiler.profile(activities=[
                    torch.profiler.ProfilerActivity.CPU,
                    torch.profiler.ProfilerActivity.CUDA])
                self.profiler.__enter__()
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # Waits for the device.
            if self.epoch == 2 and len(self.marks) == 2:
                end = time.perf_counter()
                self.splits.append((self.marks[0] - self.start, self.marks[1] - self.marks[0],
                                    end - self.marks[1]))
            self.marks.clear()
            if self.profiler is not None:
                self.times.append(time.perf_counter() - self.start)
            if self.cprofile is not None and batch == self.params["steps"] - 1:
                # Before the epoch's end, where AutoVM may replan.
                self.cprofile.disable()
                self.python = python_time(self.cprofile, self.params["steps"] - 1)
                self.cprofile = None

        def on_epoch_end(self, epoch, logs=None):
            if self.split is not None:
                self.split.__exit__(None, None, None)
                self.split = None
                after = allocator_counts(torch)
                self.allocator = {k: after[k] - v for k, v in self.allocator.items()}
            if self.profiler is None:
                return
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)
            with tempfile.TemporaryDirectory() as folder:
                path = os.path.join(folder, "trace.json")
                self.profiler.export_chrome_trace(path)
                with open(path) as f:
                    self.trace = json.load(f)
            self.profiler = None

    return Profiled()


def spawn(args, variant):
    command = [sys.executable, os.path.abspath(__file__), "--child",
               "--variant", variant, "--model", args.model, "--batch", str(args.batch),
               "--steps", str(args.steps), "--cap-gib", str(args.cap_gib)]
    command += ["--cprofile"] if args.cprofile else []
    env = dict(os.environ)
    for setting in variant.split("+")[1:]:
        if setting in ALLOCATOR:
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:" + ALLOCATOR[setting]
    return measure.run_child(command, args.timeout, env, variant=variant)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg19", choices=("vgg19", "resnet152"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cap-gib", type=float, default=10.9)
    parser.add_argument("--policies", default="",
                        help="AutoVM policies besides auto, comma-separated")
    parser.add_argument("--variants", default="",
                        help="the runs, comma-separated (see above); replaces "
                             "incore, autovm and --policies")
    parser.add_argument("--cprofile", action="store_true",
                        help="a fourth epoch under cProfile")
    measure.child_arguments(parser, 150, variant=True)
    args = parser.parse_args()
    if args.child:
        return child(args)
    import gpu_swap
    variants = ["incore", "autovm"] + [f"autovm:{p}" for p in args.policies.split(",") if p]
    if args.variants:
        variants = args.variants.split(",")
    for variant in variants:
        for setting in variant.split("+")[1:]:
            if setting not in (*ALLOCATOR, "uncapped"):
                parser.error(f"unknown setting {setting!r} in variant {variant!r}")
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "command": " ".join(["python3"] + sys.argv),
               "versions": gpu_swap.versions("torch"),
               "runs": [spawn(args, v) for v in variants]}
    for run in results["runs"]:
        row = run.get("per_step", {})
        print(f"{run['variant']:28s} {run['status']:8s} "
              + " ".join(f"{k} {v:.1f}" for k, v in row.items() if isinstance(v, float))
              + (f" | plan {run['predicted_step_s'] * 1e3:.1f} ms {run['counts']}"
                 if "counts" in run else ""), flush=True)
    measure.save(results, args.out)


if __name__ == "__main__":
    main()
