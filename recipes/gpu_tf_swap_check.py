"""Does TensorFlow's explicit swap lower the GPU peak, and change no number?

Trains one Keras CNN several times, each in the same process from the same
seed and data: without AutoVM, then under AutoVM swap policies in explicit
mode (host copies; no `enable_managed_memory()`). For each it records the
peak of `tf.config.experimental.get_memory_info("GPU:0")` during `fit`
(reset before; `null` without a GPU), the median step time (each step waits
for its loss), AutoVM's predicted peak and counters, and the largest weight
difference to the run without AutoVM. Op determinism is on, so that cuDNN's
algorithm choice cannot make runs differ (`--no-determinism` turns it off).

It also checks the program TensorFlow ran for the first swap policy that
plans: from the per-device partition graphs, that each swapped tensor is
sent to the host, that only gated copies come back to the GPU, each gate on
the host waiting for a control token from the GPU, and that no GPU gradient
op reads a swapped tensor (shape-only ops aside). On a CPU there is one
device and nothing to move: the lists are empty.

On the GPU machine (TensorFlow staged, ../shared/gpu/README.md):

    source .gpu/env.sh && python3 recipes/gpu_tf_swap_check.py --out $OUT/tf_swap.json

On a CPU, as a smoke test (the host copy is then host to host):

    KERAS_BACKEND=tensorflow python recipes/gpu_tf_swap_check.py \\
        --size 16 --batch 8 --steps 3 --out /tmp/tf_swap.json

Writes JSON to --out with the device, versions, date, command and all
numbers, and prints one line per run.
"""

import argparse
import datetime
import json
import os
import platform
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_autovm  # noqa: E402
from keras_autovm.mechanisms.tensorflow import internals as tf_internals  # noqa: E402

SHAPE_OPS = ("Shape", "ShapeN", "Size", "Rank")


def cnn(size, channels, blocks):
    """A plain CNN whose activations dwarf its weights: conv, batch norm and
    ReLU blocks, a pooling every other block."""
    inputs = keras.Input((size, size, 3))
    x = inputs
    for i in range(blocks):
        x = keras.layers.Conv2D(channels, 3, padding="same", name=f"conv{i}")(x)
        x = keras.layers.BatchNormalization(name=f"bn{i}")(x)
        x = keras.layers.ReLU(name=f"relu{i}")(x)
        if i % 2 and x.shape[1] > 4:
            x = keras.layers.MaxPooling2D(name=f"pool{i}")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(x), name="cnn")


class StepTimes(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        float(logs["loss"])  # Waits for the step.
        self.times.append(time.perf_counter() - self.start)

    def on_train_begin(self, logs=None):
        self.times = []


def gpu():
    return bool(tf.config.list_physical_devices("GPU"))


def run(args, data, policy=None, graphs=False):
    """One training: weights, peak, step time, AutoVM's report."""
    keras.utils.set_random_seed(args.seed)
    model = cnn(args.size, args.channels, args.blocks)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    callbacks, autovm = [StepTimes()], None
    if policy:
        budget = args.budget
        if policy == "greedy_offload":
            keep = keras_autovm.plan(model, args.batch, budget=2**50, policy="keep_all")
            budget = int(keep.result.peak_bytes * args.greedy_fraction)
            try:
                keras_autovm.plan(model, args.batch, budget=budget, policy=policy,
                                  headroom=0)
            except keras_autovm.PlanError as error:  # As tight as greedy gets.
                budget = error.min_budget
        autovm = keras_autovm.AutoVM(budget=budget, policy=policy, verbose=0, headroom=0,
                                     apply_without_gpu=True)
        callbacks.append(autovm)
    if gpu():
        tf.config.experimental.reset_memory_stats("GPU:0")

    def fit():
        model.fit(*data, batch_size=args.batch, epochs=1, shuffle=False,
                  callbacks=callbacks, verbose=0)

    ran = tf_internals.tf_function_graphs(fit) if graphs else fit()
    peak = tf.config.experimental.get_memory_info("GPU:0")["peak"] if gpu() else None
    times = sorted(callbacks[0].times[1:]) or callbacks[0].times
    result = {"policy": policy or "none", "peak_bytes": peak,
              "step_time_s": times[len(times) // 2]}
    if autovm is not None:
        plan = autovm.report.plan
        result.update(counts=plan.counts(), predicted_peak_bytes=plan.result.peak_bytes,
                      predicted_step_time_s=plan.result.step_time,
                      stats=autovm.report.stats)
    return model.get_weights(), result, ran


def transfers(function_graphs, device):
    """What the partition graphs move between `device` and the host."""
    moves = {"to_host": [], "to_device": [], "gates": 0, "gate_devices": set(),
             "gates_waiting": 0,
             "device_grads_reading_swapped": []}
    sent, grads = set(), []
    # Other functions TensorFlow instantiated meanwhile can be listed too.
    function_graphs = [f for f in function_graphs if any(
        "autovm_swap_out" in n.name for n in f.post_optimization_graph.node)]
    for function in function_graphs:
        for part in function.partition_graphs:
            for n in part.node:
                name = n.attr["tensor_name"].s.decode() if "tensor_name" in n.attr else ""
                on_device = n.device.endswith(device)
                if n.op == "_Send" and on_device and not name.endswith("/ctrl") \
                        and "gradient_tape" not in name:
                    moves["to_host"].append(name)
                    sent.update(n.input)
                elif n.op == "_Recv" and on_device:
                    moves["to_device"].append(name)
                elif n.name.endswith("/gate"):
                    moves["gates"] += 1
                    moves["gate_devices"].add(n.device)
                    moves["gates_waiting"] += any(i.startswith("^") for i in n.input)
                elif "gradient_tape" in n.name and on_device and n.op not in SHAPE_OPS:
                    grads.append((n.name, set(n.input)))
    moves["device_grads_reading_swapped"] = [g for g, inputs in grads if inputs & sent]
    moves["gate_devices"] = sorted(moves["gate_devices"])
    moves["only_gates_come_back"] = all(m.endswith("/gate") for m in moves["to_device"])
    return moves


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--policies", default="offload_all,greedy_offload,sqrt_offload")
    parser.add_argument("--budget", default="64GiB",
                        help="budget for offload_all and sqrt_offload")
    parser.add_argument("--greedy-fraction", type=float, default=0.8,
                        help="greedy_offload's budget, a share of keep_all's predicted peak")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-determinism", action="store_true")
    args = parser.parse_args()
    if not args.no_determinism:
        tf.config.experimental.enable_op_determinism()
    rng = np.random.default_rng(args.seed)
    n = args.batch * args.steps
    data = (rng.normal(size=(n, args.size, args.size, 3)).astype("float32"),
            rng.normal(size=(n, 10)).astype("float32"))
    device = "GPU:0" if gpu() else "CPU:0"
    reference, base, _ = run(args, data)
    results, check = [base], None
    for policy in (p for p in args.policies.split(",") if p):
        try:
            weights, result, graphs = run(args, data, policy, graphs=check is None)
        except keras_autovm.PlanError as error:
            results.append({"policy": policy, "error": str(error)})
            continue
        diffs = [float(np.max(np.abs(a - b))) if a.size else 0.0
                 for a, b in zip(reference, weights, strict=True)]
        result.update(max_abs_weight_diff=max(diffs), weights_identical=not any(diffs))
        if graphs is not None:
            check = transfers(graphs, device)
        results.append(result)
    for r in results:
        if "error" in r:
            print(f"{r['policy']:15s} {r['error']}")
            continue
        peak = "null" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f} MiB"
        print(f"{r['policy']:15s} peak {peak:>12s}  step {r['step_time_s'] * 1e3:8.2f} ms"
              f"  identical {r.get('weights_identical', '-')}  {r.get('counts', '')}")
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "command": " ".join(sys.argv), "host": platform.node(), "device": device,
           "device_details": (tf.config.experimental.get_device_details(
               tf.config.list_physical_devices("GPU")[0]) if gpu() else None),
           "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                        "python": platform.python_version()},
           "args": vars(args), "op_determinism": not args.no_determinism,
           "results": results, "transfers": check}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
