"""What AutoVM's layer timing adds to each call, against a real torch step.

    python3 recipes/gpu_timing_harness.py --models resnet152,vgg19 --batch 64 \\
        --out $OUT/timing_harness.json

Per model (random weights, 224x224, one process): AutoVM's profile of the
layers (`profiling.measure`: each call's forward and backward timed alone,
waited for; AutoVM's taking the trivial call's backward off each,
`timing.grad_call_s`, is turned off here and its figure recorded), the same
timing of a layer that does next to nothing (one
multiply on one number: what the timing itself costs a call), and three
steps of plain Keras `fit` split into forward, backward and the rest by
synchronizing the device around `loss.backward()`. Prints the sums of the
layer times, with and without the trivial call's times taken off each,
against the real step's forward and backward.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
os.environ.setdefault("KERAS_BACKEND", "torch")


def trivial_times(mechanism, repeats=20):
    """`(fwd_s, bwd_s)` of the timing on a layer that multiplies one number."""
    import keras

    class Scale(keras.layers.Layer):
        def call(self, x):
            return x * 2.0

    layer = Scale()
    x = keras.ops.ones((1, 1))
    layer(x)
    runs = [mechanism.time_call(layer, (x,), {}, repeats=5) for _ in range(repeats)]
    return (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))


def real_split(model, batch, steps):
    """Median (forward, backward, rest) seconds of plain Keras steps."""
    import numpy as np
    import torch

    import measure

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 224, 224, 3)).astype("float32")
    y = rng.integers(0, 1000, batch)
    model.train_on_batch(x, y)  # Warm-up: cuDNN picks its algorithms.
    splits = []
    with measure.backward_marks(torch) as marks:
        for _ in range(steps):
            marks.clear()
            start = time.perf_counter()
            float(model.train_on_batch(x, y))
            end = time.perf_counter()
            splits.append((marks[0] - start, marks[1] - marks[0], end - marks[1]))
    return [statistics.median(s[i] for s in splits) for i in range(3)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet152,vgg19")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import gpu_swap
    import measure
    from keras_autovm import mechanisms
    from keras_autovm import profiling

    from keras_autovm.mechanisms.torch import timing
    mechanism = mechanisms.get()
    # The layer times as timed, before AutoVM takes the trivial call off.
    grad_call_s = timing.grad_call_s()
    timing.grad_call_s = lambda: 0.0
    fwd0, bwd0 = trivial_times(mechanism)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "command": " ".join(["python3"] + sys.argv),
               "versions": gpu_swap.versions("torch"),
               "trivial_call_s": {"fwd": fwd0, "bwd": bwd0},
               "grad_call_s": grad_call_s, "models": []}
    print(f"trivial call: forward {fwd0 * 1e3:.3f} ms, backward {bwd0 * 1e3:.3f} ms")
    for name in args.models.split(","):
        model = gpu_swap.build(name)
        profile = profiling.measure(model, args.batch, mechanism)
        fwd = sum(t.fwd_s for t in profile.layers)
        bwd = sum(t.bwd_s for t in profile.layers)
        less = (sum(max(t.fwd_s - fwd0, 0) for t in profile.layers),
                sum(max(t.bwd_s - bwd0, 0) for t in profile.layers))
        split = real_split(model, args.batch, args.steps)
        row = {"model": name, "layers": len(profile.layers), "profile_s": profile.profile_s,
               "sum_fwd_s": fwd, "sum_bwd_s": bwd, "sum_fwd_less_trivial_s": less[0],
               "sum_bwd_less_trivial_s": less[1], "real_fwd_s": split[0],
               "real_bwd_s": split[1], "real_rest_s": split[2],
               "layer_times": [(t.name, t.fwd_s, t.bwd_s) for t in profile.layers]}
        results["models"].append(row)
        print(f"{name}: {len(profile.layers)} calls; layer sums fwd {fwd:.3f} s, "
              f"bwd {bwd:.3f} s; less the trivial call {less[0]:.3f}, {less[1]:.3f}; "
              f"real step fwd {split[0]:.3f}, bwd {split[1]:.3f}, rest {split[2]:.3f}")
        del model
    if args.out:
        measure.save(results, args.out)


if __name__ == "__main__":
    main()
