"""Where torch's device memory goes, layer by layer, against the plan.

    python3 recipes/gpu_torch_memory_trace.py --model resnet152 --batch 32 \
        --policy offload_all --out results/gpu_torch_memory_trace.json

Trains two steps with `AutoVM(policy=...)` on the torch backend and, in the
second step, records `torch.cuda.memory_allocated()` and the peak since the
previous record after each layer's forward (AutoVM's `after_layer`) and
when each layer's backward starts (a hook on its output's gradient), next
to the memory the plan's simulation predicts at the same points. Writes the
trace as JSON, and prints the points where measured and predicted differ
most.
"""

import argparse
import bisect
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("KERAS_BACKEND", "torch")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet152")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--policy", default="offload_all")
    parser.add_argument("--out", default=None)
    parser.add_argument("--snapshot-at", default="step_begin:",
                        help="comma-separated kind:op points at which to list the "
                        "live allocations by the code that made them")
    parser.add_argument("--cap-gib", type=float, default=0.0,
                        help="cap torch's allocator at this many GiB and plan within "
                        "it (AutoVM's budget); 0: no cap, no budget")
    parser.add_argument("--budget-gib", type=float, default=0.0,
                        help="AutoVM's budget (default: the cap); without a cap, what "
                        "gpu_swap.py's predict part does; under a larger cap, a plan "
                        "that runs out of memory at its own budget runs and is traced")
    parser.add_argument("--trace-step", type=int, default=1,
                        help="which training step to trace (0: the first)")
    parser.add_argument("--peak-window", default="",
                        help="kind:op,kind:op: list what was allocated in the traced step "
                        "and still live at the highest point between these two records "
                        "(for example bwd_start:block1_conv2,bwd_start:block1_conv1); "
                        "'worst': where the measured peak exceeds the plan's most")
    args = parser.parse_args()
    wanted = set(args.snapshot_at.split(","))
    snapshots = {}

    import keras
    import numpy as np
    import torch

    import keras_autovm
    from keras_autovm.mechanisms.torch import mechanism as torch_mechanism

    trace, state = [], {"on": False}

    def record(kind, name):
        if state["on"]:
            trace.append({"kind": kind, "op": name,
                          "allocated": torch.cuda.memory_allocated(),
                          "peak_since_last": torch.cuda.max_memory_allocated()})
            torch.cuda.reset_peak_memory_stats()
            if f"{kind}:{name}" in wanted:
                snapshots[f"{kind}:{name}"] = live_by_origin(torch)
            # To place this record among the allocator's events (their time_us).
            trace[-1]["t_us"] = time.time_ns() // 1000

    original = torch_mechanism.TorchMechanism.after_layer

    def after_layer(self, name, outputs, applied):
        outputs = original(self, name, outputs, applied)
        record("fwd_end", name)
        grad = next((x for x in keras.tree.flatten(outputs)
                     if isinstance(x, torch.Tensor) and x.requires_grad), None)
        if grad is not None and state["on"]:
            grad.register_hook(lambda g, name=name: record("bwd_start", name))
        return outputs

    torch_mechanism.TorchMechanism.after_layer = after_layer

    class Second(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            state["on"] = batch == args.trace_step
            if state["on"]:
                torch.cuda.memory._record_memory_history(
                    max_entries=200000, stacks="all" if args.peak_window else "python")
                torch.cuda.synchronize()
                record("step_begin", "")

        def on_train_batch_end(self, batch, logs=None):
            if state["on"]:
                torch.cuda.synchronize()
                record("step_end", "")
                state["on"] = False

    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, {"vgg19": "VGG19", "resnet152": "ResNet152"}[args.model])(
        weights=None)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).normal(size=(args.batch * 2, 224, 224, 3)).astype("float32")
    y = np.random.default_rng(1).integers(0, 1000, args.batch * 2)
    if args.cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cap_gib * 2**30 / total)
    budget = int((args.budget_gib or args.cap_gib) * 2**30) or None
    callback = keras_autovm.AutoVM(budget=budget, policy=args.policy, verbose=0)
    error = None
    try:
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=[callback, Second()])
    except Exception as e:  # Out of memory, no plan left: still write what was traced.
        error = f"{type(e).__name__}: {str(e)[:300]}"
    plan = callback.plan
    if plan is None:  # The fit ended before any plan: what was traced, no plan.
        print(f"no plan: {error}")
    predicted = predicted_points(plan) if plan else {}
    for point in trace:
        point["predicted"] = predicted.get((point["kind"], point["op"]))
    peak = None
    if args.peak_window and (predicted or args.peak_window != "worst"):
        window = (worst_window(trace) if args.peak_window == "worst"
                  else args.peak_window.split(","))
        events = torch.cuda.memory._snapshot()["device_traces"][0]
        peak = dict(peak_breakdown(events, trace, *window), between=window)
        torch.cuda.memory._record_memory_history(enabled=None)
    out = {"model": args.model, "batch": args.batch, "policy": args.policy,
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "predicted_peak": plan and plan.result.peak_bytes,
           "counts": plan and plan.counts(),
           "persistent_bytes": plan and plan.graph.persistent_bytes, "trace": trace,
           "snapshots": snapshots, "peak_breakdown": peak,
           "cap_gib": args.cap_gib, "budget_bytes": budget, "error": error,
           "stats": callback.report.stats if callback.report else None}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f)
    worst = sorted((p for p in trace if p["predicted"]),
                   key=lambda p: p["peak_since_last"] - p["predicted"][1], reverse=True)
    for point, groups in snapshots.items():
        print(f"live at {point}:")
        for g in groups[:12]:
            print(f"  {g['bytes'] / 2**30:7.3f} GiB {g['blocks']:5d} blocks  {g['where']}")
    if peak:
        print(f"highest point between {' and '.join(peak['between'])}: {peak['allocated'] / 2**30:.3f} GiB "
              f"allocated; made in the traced step and live there:")
        for b in peak["live"][:16]:
            print(f"  {b['bytes'] / 2**30:7.3f} GiB  {b['where']}")
        print("events around it (+ allocated, - freed):")
        for e in peak["events"]:
            print(f"  {e}")
    measured = max((p["peak_since_last"] for p in trace), default=0)
    print(f"predicted peak {(out['predicted_peak'] or 0) / 2**30:.2f} GiB, measured max "
          f"{measured / 2**30:.2f} GiB")
    for p in worst[:8]:
        print(f"{p['kind']:9} {p['op']:28} allocated {p['allocated'] / 2**30:6.2f} "
              f"peak {p['peak_since_last'] / 2**30:6.2f} | predicted at {p['predicted'][0] / 2**30:6.2f}"
              f" max {p['predicted'][1] / 2**30:6.2f}")


def live_by_origin(torch):
    """Live allocations summed by the innermost Python frame that made them."""
    groups = {}
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f for f in block.get("frames", []) if f["filename"].endswith(".py")]
            where = next((f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
                          for f in frames if "torch/" not in f["filename"]
                          or "checkpoint" in f["filename"]), "?")
            entry = groups.setdefault(where, [0, 0])
            entry[0] += block["size"]
            entry[1] += 1
    top = sorted(groups.items(), key=lambda kv: -kv[1][0])[:30]
    return [{"where": w, "bytes": b, "blocks": n} for w, (b, n) in top]


def worst_window(trace):
    """The two records around the highest measured peak over the plan's."""
    i = max((i for i in range(1, len(trace)) if trace[i]["predicted"]),
            key=lambda i: trace[i]["peak_since_last"] - trace[i]["predicted"][1])
    return [f"{p['kind']}:{p['op']}" for p in (trace[i - 1], trace[i])]


def peak_breakdown(events, trace, start, end):
    """The blocks allocated after the step began and live at the highest
    point of allocated memory between the records `start` and `end`
    ("kind:op"), by what made them, and the allocator events around it.

    Replays the allocator's event history (`events`, torch's
    `_snapshot()["device_traces"][0]`: alloc / free_completed), so the
    blocks are the ones torch's `memory_allocated` counts, record_stream
    deferrals included; a block made before the history began counts in
    the first record's `allocated` until its free."""
    marks = {f"{p['kind']}:{p['op']}": p for p in trace}
    times = [e.get("time_us", 0) for e in events]
    first = bisect.bisect_right(times, marks[start]["t_us"])
    last = bisect.bisect_right(times, marks[end]["t_us"])
    if first >= last:  # The allocator's clock is not ours: the whole step.
        first, last = 0, len(events)
    base = trace[0]["allocated"]  # Allocated when the history began.
    live, now, best = {}, base, (base, first, {})
    for i, e in enumerate(events[:last]):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            now += e["size"]
        elif e["action"] == "free_completed":  # Made in the step or before it.
            now -= live.pop(e["addr"], e)["size"]
        if i >= first and now > best[0]:
            best = (now, i, dict(live))
    allocated, at, blocks = best
    groups = {}
    for e in blocks.values():
        groups.setdefault(_origin(e), []).append(e["size"])
    around = [f"{'+' if e['action'] == 'alloc' else '-'}{e['size'] / 2**30:.3f} GiB "
              f"{_origin(e)}" for e in events[max(first, at - 12):at + 4]
              if e["action"] in ("alloc", "free_completed")]
    return {"allocated": allocated, "at_event": at, "window": [first, last],
            "live": sorted(({"where": w, "bytes": sum(s), "blocks": len(s)}
                            for w, s in groups.items()), key=lambda g: -g["bytes"]),
            "events": around}


def _origin(event):
    """A short name for what made a block: the innermost Python frame outside
    torch, else the innermost ATen / autograd / cuDNN C++ frame."""
    frames = event.get("frames", [])
    for f in frames:
        if f["filename"].endswith(".py") and "torch/" not in f["filename"]:
            return f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
    for f in frames:
        name = f["name"]
        if any(k in name for k in ("at::native::", "autograd::generated", "cudnn", "at::cuda")):
            return name[:120]
    return "?"


def predicted_points(plan):
    """(kind, op) -> (predicted bytes at that point, max since the last point)."""
    r = plan.result
    times = {}
    for e in r.op_events:
        if e.phase == "fwd":
            times[("fwd_end", e.op)] = e.end
        elif e.phase == "bwd":
            times[("bwd_start", e.op)] = e.start
    ordered = sorted(times.items(), key=lambda kv: kv[1])
    out, k, running_max = {}, 0, 0
    timeline = r.timeline
    for key, t in ordered:
        while k < len(timeline) and timeline[k][0] <= t:
            running_max = max(running_max, timeline[k][1])
            k += 1
        now = timeline[k - 1][1] if k else timeline[0][1]
        out[key] = (now, running_max)
        running_max = now
    return out


if __name__ == "__main__":
    main()
