"""Where TensorFlow's device memory goes in one training step, op by op.

    python3 recipes/gpu_tf_memory_trace.py --model vgg19 --batch 64 \\
        --variant autovm:offload_all --out results/tensorflow/trace.json
    python3 recipes/gpu_tf_memory_trace.py --model vgg19 --batch 32,64 \
        --variant keras,keras_xla,autovm:keep_all,autovm:offload_all --out ...
    python3 recipes/gpu_tf_memory_trace.py --smoke --out /tmp/trace.json   # CPU

On a GPU, TensorFlow with AutoVM's explicit swap used 1.5x to 2.2x the
memory its plan predicted, and so did Keras's own step planned as keep-all
(docs/results.md, "TensorFlow explicit swap on a GPU"). This finds out
where. It trains `--steps` steps and runs the last one under TensorFlow's
profiler, whose trace holds every allocation and free of the device's
allocator with the op that made it, the tensor's shape, its region
(output, temp, persist) and the allocator's bytes in use after it. From
them: the step's peak, and what was live at that moment, grouped by layer
and by pass (forward, backward, optimizer), next to what the plan says is
live at its own peak (`SimResult.peak_live`) for the AutoVM variants, and
what the plan has in use while the layer where the step peaked runs
(`peak_layer`, `predicted_at_peak_layer_bytes`).

Variants (`--variant`): `keras` (Keras's step, `jit_compile=False`),
`keras_xla` (Keras's default on TensorFlow: under XLA an op is a compiled
cluster, so the breakdown is by cluster), `autovm:<policy>` (with
`AutoVM(policy=<policy>)`, compiled as Keras compiles by default, with
XLA; AutoVM turns it off for a policy that swaps). Memory held from
before the traced step (weights, optimizer state) is one total, not
broken down.
On a CPU (`--smoke`, a small CNN) the trace is of TensorFlow's CPU
allocator, made a BFC allocator for it (`TF_CPU_ALLOCATOR_USE_BFC`).
"""

import argparse
import collections
import datetime
import glob
import json
import os
import platform
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # Traced on a CPU too.
GiB = 2**30


def build(name, jit):
    import keras
    keras.utils.set_random_seed(0)
    if name == "small":
        model = keras.Sequential([
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv1"),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv2"),
            keras.layers.MaxPooling2D(name="pool"),
            keras.layers.Flatten(name="flatten"),
            keras.layers.Dense(10, name="dense")])
    else:
        make = {"vgg19": keras.applications.VGG19,
                "resnet152": keras.applications.ResNet152}[name]
        model = make(weights=None)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", jit_compile=jit)
    return model


def tracer(logdir, step):
    """A callback running batch `step` of the fit under the profiler."""
    import keras
    import tensorflow as tf

    class Trace(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == step:
                tf.profiler.experimental.start(logdir, options=tf.profiler.experimental.
                                               ProfilerOptions(host_tracer_level=2))

        def on_train_batch_end(self, batch, logs=None):
            if batch == step:
                float(logs["loss"])  # The step has ended on the device.
                tf.profiler.experimental.stop()

    return Trace()


def allocator_events(logdir, device):
    """`[(time_ps, kind, stats)]` of the allocator of `device` ("GPU" or
    "CPU"), in time order, from the profiler's trace."""
    try:
        from tsl.profiler.protobuf import xplane_pb2
    except ImportError:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    events = []
    for path in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            names = {k: v.name for k, v in plane.event_metadata.items()}
            stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
            for line in plane.lines:
                for event in line.events:
                    kind = names.get(event.metadata_id, "")
                    if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                        continue
                    stats = {stat_names[s.metadata_id]: _value(s, stat_names) for s in event.stats}
                    if _ours(stats.get("allocator_name", ""), device):
                        events.append((line.timestamp_ns * 1000 + event.offset_ps, kind, stats))
    events.sort(key=lambda e: e[0])
    return events


def _value(stat, names):
    kind = stat.WhichOneof("value")
    value = getattr(stat, kind)
    return names.get(value) if kind == "ref_value" else value


def _ours(allocator, device):
    name = allocator.lower()
    if device == "GPU":
        return name.startswith("gpu_") and "host" not in name
    return "cpu" in name and "gpu" not in name.replace("for_gpu", "")


def live_at_peak(events):
    """The peak of bytes in use over `events`, what was live then (by
    address), and what was live before the first event (held from before
    the step: weights, optimizer state)."""
    if not events:
        return None
    live, best, best_live, best_op = {}, -1, {}, None
    first = events[0][2]
    sign = 1 if events[0][1] == "MemoryAllocation" else -1
    before = first.get("bytes_allocated", 0) - sign * first.get("allocation_bytes", 0)
    for _, kind, stats in events:
        addr = stats.get("addr")
        if kind == "MemoryAllocation":
            live[addr] = stats
        else:
            live.pop(addr, None)
        if stats.get("bytes_allocated", 0) > best:
            best, best_live, best_op = stats["bytes_allocated"], dict(live), stats.get("tf_op")
    return {"peak_bytes": best, "held_before_bytes": before, "peak_op": best_op or "?",
            "allocator_peak_bytes": max(s.get("peak_bytes_in_use", 0) for _, _, s in events),
            "live": list(best_live.values())}


def group(live, layers):
    """Bytes live at the peak by (pass, layer) and by region."""
    by_layer, by_region = collections.Counter(), collections.Counter()
    for stats in live:
        op = stats.get("tf_op", "") or "?"
        nbytes = stats.get("allocation_bytes", 0)
        by_layer[(_pass(op), _layer(op, layers))] += nbytes
        by_region[stats.get("region_type", "?") or "?"] += nbytes
    rows = [{"pass": p, "layer": l, "bytes": n} for (p, l), n in by_layer.most_common()]
    return rows, dict(by_region)


def largest(live, count=30):
    """The `count` largest allocations live at the peak: op, shape, region."""
    keys = ("allocation_bytes", "tf_op", "shape", "region_type", "data_type")
    return [{k: stats.get(k) for k in keys} for stats in
            sorted(live, key=lambda s: -s.get("allocation_bytes", 0))[:count]]


def _pass(op):
    lower = op.lower()
    if "gradient_tape" in lower or "gradients" in lower:
        return "backward"
    if any(k in lower for k in ("adam", "sgd", "optimizer", "assignadd", "assignsub")):
        return "optimizer"
    return "forward"


def _layer(op, layers):
    for part in op.split("/"):
        name = re.sub(r"_\d+$", "", part)
        if part in layers or name in layers:
            return part if part in layers else name
    return op.split("/")[0] if "/" in op else op


def run(args):
    import numpy as np
    import tensorflow as tf

    if args.cap_gib:
        if not tf.config.list_physical_devices("GPU"):
            raise ValueError(f"--cap-gib={args.cap_gib} needs a GPU; there is none.")
        gpu = tf.config.list_physical_devices("GPU")[0]
        tf.config.set_logical_device_configuration(
            gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=int(args.cap_gib * 1024))])
    device = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
    # Keras's default on TensorFlow is XLA; AutoVM turns it off itself for a
    # policy that swaps (and says so).
    model = build(args.model, jit=args.variant != "keras")
    callbacks = []
    if args.variant.startswith("autovm:"):
        import keras_autovm
        budget = int(args.budget_gib * GiB) if args.budget_gib else None
        callbacks.append(keras_autovm.AutoVM(
            budget=budget, policy=args.variant.split(":", 1)[1], verbose=0,
            apply_without_gpu=device == "CPU" and budget is not None))
    logdir = tempfile.mkdtemp(prefix="autovm_tf_trace_")
    callbacks.append(tracer(logdir, args.steps - 1))
    shape = model.input_shape[1:]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * args.steps,) + shape).astype("float32")
    y = rng.integers(0, model.output_shape[-1], args.batch * args.steps)
    model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0,
              callbacks=callbacks)
    events = allocator_events(logdir, device)
    if not events:
        raise RuntimeError(f"the profiler recorded no allocation of the {device}'s allocator")
    found = live_at_peak(events)
    layers = {layer.name for layer in model.layers}
    live = found.pop("live", [])
    rows, regions = group(live, layers)
    out = {"device_kind": device, "events": len(events), **found,
           "live_at_peak": rows, "live_at_peak_by_region": regions,
           "largest_live_at_peak": largest(live)}
    if callbacks[0] is not callbacks[-1] and callbacks[0].plan is not None:
        plan = callbacks[0].plan
        out.update(predicted_peak_bytes=plan.result.peak_bytes, policy=plan.policy,
                   counts=plan.counts(), stats=callbacks[0].report.stats,
                   predicted_live_at_peak=[list(x) for x in plan.result.peak_live])
        # What the plan has in use where the step peaked, not at its own peak.
        phase = peak_phase(out["peak_op"])
        out["peak_layer"] = [phase or "optimizer", _layer(out["peak_op"], layers)]
        out["predicted_at_peak_layer_bytes"] = predicted_during(
            plan.result, out["peak_layer"][1], phase) if phase else None
    return out


def peak_phase(op):
    """The simulator's phase of a traced op: "fwd" or "bwd"; `None` for the
    optimizer's update, which the simulator has no item for."""
    return {"forward": "fwd", "backward": "bwd"}.get(_pass(op))


def predicted_during(result, op, phase):
    """The most a `SimResult` has in use while `op`'s `phase` ("fwd" or
    "bwd") runs, or `None` where it does not run: from what it allocated
    as it started (the last point at its start) to before its end (the
    points at its end are its frees and the next op's allocations)."""
    for event in result.op_events:
        if event.op == op and event.phase == phase:
            started = [b for t, b in result.timeline if t <= event.start][-1:]
            inside = [b for t, b in result.timeline if event.start < t < event.end]
            return max(started + inside)
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg19", choices=("vgg19", "resnet152", "small"))
    parser.add_argument("--batch", default="64", help="one batch size, or several: 32,64")
    parser.add_argument("--variant", default="keras", help="one variant, or several: "
                        "keras,keras_xla,autovm:keep_all,autovm:offload_all")
    parser.add_argument("--steps", type=int, default=3, help="the last one is traced")
    parser.add_argument("--cap-gib", type=float, default=0.0)
    parser.add_argument("--budget-gib", type=float, default=0.0,
                        help="AutoVM's budget (default: none, or the device's memory)")
    parser.add_argument("--timeout", type=int, default=300,
                        help="seconds for each run, when there are several")
    parser.add_argument("--smoke", action="store_true", help="a small CNN, on a CPU")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    runs = [(v, int(b)) for b in args.batch.split(",") for v in args.variant.split(",")]
    if len(runs) > 1:
        return several(args, runs)
    args.variant, args.batch = runs[0]
    if args.smoke:
        args.model, args.batch = "small", min(args.batch, 16)
    import keras
    import tensorflow as tf
    result = {"command": " ".join(["python3"] + sys.argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                           "python": platform.python_version()},
              "model": args.model, "batch": args.batch, "variant": args.variant}
    try:
        result.update(run(args))
    except Exception as error:  # noqa: BLE001 -- the failure is the result
        result["error"] = f"{type(error).__name__}: {error}"[-1500:]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print_summary(result)


def several(args, runs):
    """Each (variant, batch) of `runs` in its own process (a process's
    allocator and peak are its run's); one JSON file, rewritten after each
    run so that a machine cut off keeps what was done."""
    import subprocess
    out = {"command": " ".join(["python3"] + sys.argv),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (variant, batch) in enumerate(runs):
            path = os.path.join(tmp, f"{i}.json")
            cmd = [sys.executable, __file__, "--model", args.model, "--batch", str(batch),
                   "--variant", variant, "--steps", str(args.steps), "--cap-gib",
                   str(args.cap_gib), "--budget-gib", str(args.budget_gib), "--out", path]
            cmd += ["--smoke"] if args.smoke else []
            try:
                subprocess.run(cmd, timeout=args.timeout, check=False)
                failed = None
            except (subprocess.TimeoutExpired, OSError) as error:  # OSError: no start.
                failed = error
            try:
                with open(path) as f:
                    out["runs"].append(json.load(f))
                if failed:  # On an H200 a run wrote its result, then hung on exit.
                    out["runs"][-1]["exit"] = f"wrote this, then did not exit in {args.timeout} s"
            except (OSError, ValueError) as error:
                error = failed or error
                out["runs"].append({"variant": variant, "batch": batch,
                                    "error": f"{type(error).__name__}: {error}"[-500:]})
                print_summary(out["runs"][-1])
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)


def print_summary(result):
    if "error" in result:
        print(f"{result.get('variant')}, batch {result.get('batch')}: {result['error']}")
        return
    print(f"{result['variant']}, batch {result['batch']}: peak {result['peak_bytes'] / GiB:.3f} "
          f"GiB in the traced step ({result['events']} allocator events; held before it "
          f"{result['held_before_bytes'] / GiB:.3f} GiB)"
          + (f"; plan {result['predicted_peak_bytes'] / GiB:.3f} GiB"
             if "predicted_peak_bytes" in result else ""))
    if result.get("predicted_at_peak_layer_bytes") is not None:
        phase, layer = result["peak_layer"]
        print(f"  peaked in the {phase} of {layer}, where the plan has "
              f"{result['predicted_at_peak_layer_bytes'] / GiB:.3f} GiB in use")
    for row in result["live_at_peak"][:15]:
        print(f"  {row['pass']:9s} {row['layer'][:40]:40s} {row['bytes'] / 2**20:10.1f} MiB")
    # In the output too: a run that hangs after writing its JSON may lose it.
    print("  largest allocations live at the peak:")
    for row in result["largest_live_at_peak"][:10]:
        print(f"    {row['allocation_bytes'] / 2**20:10.1f} MiB {row['region_type']} "
              f"{row['shape']} {str(row['tf_op'])[-100:]}")


if __name__ == "__main__":
    main()
