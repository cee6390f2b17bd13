"""The main job: train a small CNN with AutoVM under a memory budget.

Runs on a CPU in a couple of minutes with the active Keras backend
(KERAS_BACKEND=tensorflow, jax or torch): prints the plan, trains with a
progress bar, and prints the report. With no GPU there is no device memory
to manage, so the plan is applied to the CPU run for demonstration
(`apply_without_gpu=True`); the budget is then a pretend device size.

    python recipes/small_cnn.py [--budget 60MiB] [--epochs 3]

By default the budget is halfway between the budget the model needs with
every activation kept and the least budget AutoVM can plan on this backend,
so AutoVM must save memory to meet it.
"""

import argparse

import numpy as np

import keras
import keras_autovm


def make_model(size=64, classes=4):
    """A small VGG-style CNN: three conv blocks and a dense head."""
    inputs = keras.Input((size, size, 3))
    x = inputs
    for filters in (16, 32, 64):
        x = keras.layers.Conv2D(filters, 3, padding="same")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(classes, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="small_cnn")


def make_data(n, size=64, classes=4, seed=0):
    """Noise images whose label is the quadrant holding a bright square."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 1.0, (n, size, size, 3)).astype("float32")
    y = rng.integers(0, classes, n)
    half = size // 2
    for i, label in enumerate(y):
        r, c = divmod(int(label), 2)
        x[i, r * half + 8:r * half + 24, c * half + 8:c * half + 24] += 2.0
    return x, y


def least_budget(model, batch_size, policy="auto"):
    """The smallest budget `policy` fits, as `plan()` states it: a budget,
    so headroom included, that `AutoVM(budget=...)` accepts."""
    try:
        keras_autovm.plan(model, batch_size, budget=1, policy=policy)
    except keras_autovm.PlanError as error:
        return error.min_budget
    raise AssertionError("A one-byte budget cannot fit.")


def default_budget(model, batch_size):
    """Halfway between the budget keeping everything needs and the least
    budget any plan fits, both with the default headroom."""
    fmt = keras_autovm.planner.format_bytes
    keep = least_budget(model, batch_size, policy="keep_all")
    least = least_budget(model, batch_size)
    budget = (keep + least) // 2
    print(f"Keeping every activation needs a budget of {fmt(keep)}, the least "
          f"AutoVM can plan needs {fmt(least)} (both with "
          f"{keras_autovm.mechanisms.get().default_headroom * 100:g}% headroom): "
          f"budget {fmt(budget)}.")
    return budget


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default=None,
                        help="e.g. 90MiB; default: halfway between keep-all and the minimum")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--report-dir", default=None)
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    model = make_model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    print(f"Backend: {keras.backend.backend()}")
    budget = args.budget or default_budget(model, args.batch_size)
    x, y = make_data(args.samples)
    callback = keras_autovm.AutoVM(budget=budget, apply_without_gpu=True,
                                   report_dir=args.report_dir)
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs,
              validation_split=0.1, callbacks=[callback], verbose=1)


if __name__ == "__main__":
    main()
