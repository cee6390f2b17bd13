"""What AutoVM's layer timing adds to each call, against a real step.

    python3 recipes/gpu_timing_harness.py --models resnet152,vgg19 --batch 64 \\
        --out $OUT/timing_harness.json
    python3 recipes/gpu_timing_harness.py --backend tensorflow --models resnet152 \\
        --batch 64 --smaller 16,8 --out $OUT/timing_harness_tf.json

Per model (random weights, 224x224, one process): AutoVM's profile of the
layers (`profiling.measure`: each call's forward and backward timed alone,
waited for; on torch, AutoVM's taking the trivial call's backward off each,
`timing.grad_call_s`, is turned off here and its figure recorded), the same
timing of a layer that does next to nothing (one multiply on one number:
what the timing itself costs a call), and a few steps of plain Keras
training at the same batch. On torch the steps are split into forward,
backward and the rest by synchronizing the device around
`loss.backward()`; on TensorFlow and JAX only the whole step is timed
(`train_on_batch` returns the loss, so it waits for the device), on
TensorFlow without XLA, as AutoVM runs its plans there, on JAX jitted.

`--smaller A,B` also profiles at batches A > B and scales A's times up to
`--batch` with the fixed part fitted from B (`Profile.with_fixed_times`),
the way a profile timed under a tight budget is scaled to the fit's batch;
its sums are recorded next to the ones timed at the batch itself.

Also recorded: what waiting for an idle device costs (the clock stop each
timing pays), and the link as the backend's `Mechanism.measure_link` times
it (`null` where the mechanism has no timing of its own).

Prints the sums of the layer times, with and without the trivial call's
times taken off each, against the real step.
"""

import argparse
import datetime
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


def warmed_batch(model, batch):
    """A random batch of 224x224 images and labels, after one step on it
    (it compiles, and the convolutions' algorithms are picked)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 224, 224, 3)).astype("float32")
    y = rng.integers(0, 1000, batch)
    model.train_on_batch(x, y)
    return x, y


def real_split(model, batch, steps):
    """Median (forward, backward, rest) seconds of plain Keras steps."""
    import torch

    import measure

    x, y = warmed_batch(model, batch)
    splits = []
    with measure.backward_marks(torch) as marks:
        for _ in range(steps):
            marks.clear()
            start = time.perf_counter()
            float(model.train_on_batch(x, y))
            end = time.perf_counter()
            splits.append((marks[0] - start, marks[1] - marks[0], end - marks[1]))
    return [statistics.median(s[i] for s in splits) for i in range(3)]


def whole_step(model, batch, steps):
    """Median seconds of plain Keras steps (`train_on_batch` returns the
    loss as a number, so each waits for the device)."""
    x, y = warmed_batch(model, batch)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        float(model.train_on_batch(x, y))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def wait_cost(backend, repeats=20):
    """Median seconds of waiting for an idle device: the clock stop each
    layer timing pays."""
    if backend == "tensorflow":
        import tensorflow as tf
        wait = tf.test.experimental.sync_devices
    elif backend == "torch":
        import torch
        wait = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    else:
        import jax
        wait = lambda: jax.block_until_ready(jax.numpy.zeros(()))  # noqa: E731
    wait()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sums(profile, scale=1.0):
    """(forward, backward) sums of a profile's times at `scale` times its batch."""
    times = [t.at(scale) for t in profile.layers]
    return sum(t[0] for t in times), sum(t[1] for t in times)


def scaled_row(model, batch, smaller, mechanism):
    """The profile at the larger of `smaller`, its fixed part fitted from the
    other, scaled up to `batch`, as a tight budget's profile is."""
    from keras_autovm import profiling

    big, small = sorted(smaller, reverse=True)
    fitted = profiling.measure(model, big, mechanism).with_fixed_times(
        profiling.measure(model, small, mechanism))
    fwd, bwd = sums(fitted, batch / big)
    return {"batches": [big, small], "sum_fwd_s": fwd, "sum_bwd_s": bwd,
            "profile_s": fitted.profile_s,
            "layer_times": [(t.name, *t.at(batch / big)) for t in fitted.layers]}


def model_row(name, args, mechanism, trivial):
    import gpu_swap
    from keras_autovm import profiling

    # AutoVM runs TensorFlow plans without XLA; on JAX, False would not jit.
    model = gpu_swap.build(name, jit_compile=False if args.backend == "tensorflow" else "auto")
    profile = profiling.measure(model, args.batch, mechanism)
    fwd, bwd = sums(profile)
    less = (sum(max(t.fwd_s - trivial[0], 0) for t in profile.layers),
            sum(max(t.bwd_s - trivial[1], 0) for t in profile.layers))
    row = {"model": name, "layers": len(profile.layers), "profile_s": profile.profile_s,
           "sum_fwd_s": fwd, "sum_bwd_s": bwd, "sum_fwd_less_trivial_s": less[0],
           "sum_bwd_less_trivial_s": less[1], "link": profile.link,
           "layer_times": [(t.name, t.fwd_s, t.bwd_s) for t in profile.layers]}
    if args.smaller:
        row["scaled"] = scaled_row(model, args.batch, args.smaller, mechanism)
    if args.backend == "torch":
        split = real_split(model, args.batch, args.steps)
        row.update(real_fwd_s=split[0], real_bwd_s=split[1], real_rest_s=split[2],
                   real_step_s=sum(split))
    else:
        row["real_step_s"] = whole_step(model, args.batch, args.steps)
    return row


def print_row(row):
    line = (f"{row['model']}: {row['layers']} calls; layer sums fwd {row['sum_fwd_s']:.3f} s, "
            f"bwd {row['sum_bwd_s']:.3f} s; less the trivial call "
            f"{row['sum_fwd_less_trivial_s']:.3f}, {row['sum_bwd_less_trivial_s']:.3f}; "
            f"real step {row['real_step_s']:.3f} s")
    if "real_fwd_s" in row:
        line += f" (fwd {row['real_fwd_s']:.3f}, bwd {row['real_bwd_s']:.3f})"
    if "scaled" in row:
        s = row["scaled"]
        line += (f"; timed at {s['batches'][0]} (fixed part from {s['batches'][1]}) and "
                 f"scaled: fwd {s['sum_fwd_s']:.3f}, bwd {s['sum_bwd_s']:.3f}")
    print(line, flush=True)


def batches(text):
    try:
        return [int(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected batch sizes such as 10,5. Received: --smaller={text}") from None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=os.environ.get("KERAS_BACKEND", "torch"),
                        choices=("torch", "tensorflow", "jax"))
    parser.add_argument("--models", default="resnet152,vgg19")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--smaller", type=batches, default=None,
                        help="two smaller batches, A,B (A > B)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smaller and (len(args.smaller) != 2 or len(set(args.smaller)) != 2
                         or max(args.smaller) >= args.batch):
        parser.error(f"--smaller takes two different batches below --batch. "
                     f"Received: --smaller={args.smaller}")
    os.environ["KERAS_BACKEND"] = args.backend
    import gpu_swap
    import measure
    from keras_autovm import mechanisms

    mechanism = mechanisms.get()
    grad_call_s = None
    if args.backend == "torch":
        # The layer times as timed, before AutoVM takes the trivial call off.
        from keras_autovm.mechanisms.torch import timing
        grad_call_s = timing.grad_call_s()
        timing.grad_call_s = lambda: 0.0
    trivial = trivial_times(mechanism)
    wait_s = wait_cost(args.backend)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "command": " ".join(["python3"] + sys.argv),
               "backend": args.backend, "batch": args.batch,
               "versions": gpu_swap.versions(args.backend),
               "trivial_call_s": {"fwd": trivial[0], "bwd": trivial[1]},
               "wait_s": wait_s, "grad_call_s": grad_call_s,
               "link": mechanism.measure_link(), "models": []}
    print(f"trivial call: forward {trivial[0] * 1e3:.3f} ms, backward "
          f"{trivial[1] * 1e3:.3f} ms; waiting for an idle device {wait_s * 1e3:.3f} ms; "
          f"link {results['link']}", flush=True)
    # Saved after each part, so that a run cut off keeps what it did.
    measure.save(results, args.out)
    for name in args.models.split(","):
        row = model_row(name, args, mechanism, trivial)
        results["models"].append(row)
        print_row(row)
        measure.save(results, args.out)


if __name__ == "__main__":
    main()
