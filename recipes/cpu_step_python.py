"""What AutoVM's torch hooks cost a Python-bound step, on a CPU.

    KERAS_BACKEND=torch python3 recipes/cpu_step_python.py \\
        --out results/torch/step_python/cpu_step_python.json

Keras's eager torch step of a deep model is bound by Python on a GPU (on
an H200, ResNet-152's forward runs about 60 ms of kernels in 250 to 450
ms). A CPU shows that Python without a GPU when the layers are tiny: a
ResNet-like model of `--blocks` bottleneck blocks (3 convolutions, 3
batch norms, 3 ReLUs, an add and a ReLU each; 554 layers at 50 blocks)
with 8 channels on 8x8 inputs. Each variant trains in its own
process, `--steps` steps of batch 4, in turns over `--rounds`:

- `incore`: Keras's own step;
- `keep`: AutoVM keeping every output, under its hooks (the plan that runs
  unchanged where holding every output fits is turned off);
- `offload`: AutoVM's `offload_all` (603 swaps; copies to host memory,
  synchronous without a GPU).

Per variant: the median and mean step after the first five, and the
collector's collections in those steps per generation, with their summed
time.
"""

import argparse
import datetime
import gc
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import measure  # noqa: E402 -- recipes/, on the path above

POLICY = {"keep": "keep_all", "offload": "offload_all"}
FIRST = 5  # Steps before this one are not counted.


def model(keras, blocks):
    def block(x, i):
        skip = x
        for j in range(3):
            x = keras.layers.Conv2D(8, 3 if j == 1 else 1, padding="same")(x)
            x = keras.layers.BatchNormalization()(x)
            if j < 2:
                x = keras.layers.ReLU()(x)
        return keras.layers.ReLU()(keras.layers.Add()([x, skip]))

    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    for i in range(blocks):
        x = block(x, i)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))


def collections(keras, first):
    """A callback recording Python's collections (generation, seconds) in
    `.done`, from the start of step `first` to the end of the last step
    (not the end of the fit, where AutoVM makes its report)."""

    class Collections(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.done, self.started = [], []

        def record(self, phase, info):
            if phase == "start":
                self.started.append(time.perf_counter())
            else:
                self.done.append((info["generation"],
                                  time.perf_counter() - self.started.pop()))

        def on_train_batch_begin(self, batch, logs=None):
            if batch == first:
                gc.callbacks.append(self.record)

        def on_train_batch_end(self, batch, logs=None):
            if batch == self.params["steps"] - 1 and self.record in gc.callbacks:
                gc.callbacks.remove(self.record)

    return Collections()


def child(args):
    import keras
    import numpy as np
    import torch

    import keras_autovm
    from keras_autovm.mechanisms.torch import mechanism, swap

    torch.set_num_threads(1)
    variant = args.variant
    keras.utils.set_random_seed(0)
    net = model(keras, args.blocks)
    net.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    callbacks = []
    if variant != "incore":
        swap.MIN_BYTES = 0  # Tiny tensors, swapped as a GPU's large ones.
        mechanism.TorchMechanism.holds_outputs = False  # Under the hooks.
        callbacks.append(keras_autovm.AutoVM(budget="1GiB", policy=POLICY[variant],
                                             verbose=0, apply_without_gpu=True))
    timer = measure.step_timer(keras)
    rng = np.random.default_rng(0)
    x = rng.random((4 * args.steps, 8, 8, 3), dtype=np.float32)
    y = rng.integers(0, 10, 4 * args.steps)
    recorded = collections(keras, FIRST)
    net.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
            callbacks=callbacks + [timer, recorded])
    done = recorded.done
    steps = timer.times[FIRST:]
    out = {"variant": args.variant, "step_ms": [t * 1e3 for t in timer.times],
           "median_step_ms": statistics.median(steps) * 1e3,
           "mean_step_ms": statistics.mean(steps) * 1e3,
           "collections": {g: [sum(1 for k, _ in done if k == g),
                               sum(s for k, s in done if k == g) * 1e3] for g in range(3)}}
    if callbacks:
        out["counts"] = callbacks[0].plan.counts()
    measure.report(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="incore,keep,offload")
    parser.add_argument("--blocks", type=int, default=50)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    measure.child_arguments(parser, 300, variant=True)
    args = parser.parse_args()
    if args.child:
        return child(args)
    import keras
    import torch
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "command": " ".join(["python3"] + sys.argv),
               "versions": {"keras": keras.__version__, "torch": torch.__version__,
                            "python": sys.version.split()[0], "cpus": os.cpu_count()},
               "runs": []}
    env = dict(os.environ, KERAS_BACKEND="torch")
    for turn in range(args.rounds):
        for variant in args.variants.split(","):
            command = [sys.executable, os.path.abspath(__file__), "--child",
                       "--variant", variant, "--blocks", str(args.blocks),
                       "--steps", str(args.steps)]
            run = measure.run_child(command, args.timeout, env, variant=variant)
            run["round"] = turn
            results["runs"].append(run)
            print(f"{variant:16s} {run['status']:6s} median "
                  f"{run.get('median_step_ms', 0):6.1f} ms, mean "
                  f"{run.get('mean_step_ms', 0):6.1f} ms, collections "
                  f"{run.get('collections')}", flush=True)
    measure.save(results, args.out)


if __name__ == "__main__":
    main()
