"""What stays on the GPU between torch training steps, with and without AutoVM.

    python3 recipes/gpu_torch_resident.py --cap-gib 10.9 --out results/torch/resident.json

VGG-19 at batch 64 (adam, as `gpu_swap.py` builds it) trains two epochs of
three steps, each variant in its own process: without AutoVM (no cap), and
with `AutoVM(budget=<cap>)` under the cap, with and without its layer-time
profile. After each step, the bytes torch has allocated and reserved; after
the second step, the live allocations grouped by the Python line that made
them (torch's allocator history, recorded from the start of `fit`). A
plan's predicted peak counts weights, optimizer state and the step's own
tensors: anything else still allocated between steps is memory the plan
does not know about.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
os.environ.setdefault("KERAS_BACKEND", "torch")
VARIANTS = ("incore", "autovm", "autovm_no_profile")


def child(args):
    import gpu_swap
    import keras
    import numpy as np
    import torch
    from gpu_torch_memory_trace import live_by_origin

    cap = args.cap_gib if args.variant != "incore" else 0.0
    gpu_swap.setup("torch", cap)
    torch.cuda.memory._record_memory_history(max_entries=200000)
    model = gpu_swap.build("vgg19")
    out = {"variant": args.variant, "cap_gib": cap, "steps": []}

    class Resident(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # Waits for the device.
            out["steps"].append({"batch": batch, "allocated": torch.cuda.memory_allocated(),
                                 "reserved": torch.cuda.memory_reserved(),
                                 "peak": torch.cuda.max_memory_allocated()})
            if len(out["steps"]) == 2:
                out["live_after_step_2"] = live_by_origin(torch)
            print("STEP " + json.dumps(out["steps"][-1]), flush=True)

    callbacks = [Resident()]
    if args.variant != "incore":
        import keras_autovm
        callbacks.insert(0, keras_autovm.AutoVM(
            budget=int(cap * 2**30), verbose=0,
            profile=None if args.variant == "autovm_no_profile" else "auto"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * 3, 224, 224, 3)).astype("float32")
    y = rng.integers(0, 1000, 64 * 3)
    try:
        model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                  callbacks=callbacks)
        out["status"] = "ok"
    except Exception as error:  # noqa: BLE001 -- a failure is a result
        out.update(status="error", error=f"{type(error).__name__}: {str(error)[:600]}")
    if args.variant != "incore" and callbacks[0].plan is not None:
        out["predicted_peak"] = callbacks[0].plan.result.peak_bytes
        out["persistent_bytes"] = callbacks[0].plan.graph.persistent_bytes
        out["counts"] = callbacks[0].plan.counts()
    print("RESULT " + json.dumps(out), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-gib", type=float, default=10.9)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--timeout", type=int, default=90)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    runs = []
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--child", "--variant", variant,
               "--cap-gib", str(args.cap_gib)]
        try:
            text = subprocess.run(cmd, capture_output=True, text=True,
                                  timeout=args.timeout).stdout
        except subprocess.TimeoutExpired:
            runs.append({"variant": variant, "status": "timeout"})
            continue
        found = [ln[7:] for ln in text.splitlines() if ln.startswith("RESULT ")]
        runs.append(json.loads(found[-1]) if found else
                    {"variant": variant, "status": "crashed", "log_tail": text[-1500:]})
        run = runs[-1]
        ends = [f"{s['allocated'] / 2**30:.2f}" for s in run.get("steps", [])]
        print(f"{variant:18} {run.get('status')}: allocated after each step (GiB) {ends}")
        for group in run.get("live_after_step_2", [])[:6]:
            print(f"    {group['bytes'] / 2**30:7.3f} GiB {group['blocks']:5d}  {group['where']}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"command": " ".join(["python3"] + sys.argv), "runs": runs}, f)


if __name__ == "__main__":
    main()
