"""Keras's own torch training step with its convolutions on views of their
inputs (`torch_inputs_on_views` in keras_autovm/internals.py, as AutoVM
runs them) against Keras's copies, side by side in one process. No AutoVM.

    python3 recipes/gpu_torch_conv_views.py --models vgg19,resnet152 --batch 64 \
        --out $OUT/conv_views.json

For each model, `--rounds` rounds; each round trains Keras as it is and
with views (which goes first alternates), each from the same weights on
the same batches (SGD, cuDNN deterministic) for `--steps` steps, the step
timed to its loss read back (which waits for the device). Reports per
variant the median step (each fit's first step left out), the allocated
peak, the ratio views / Keras of both, and the largest weight difference
after the same training (0: the same numbers).
"""

import argparse
import datetime
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
os.environ.setdefault("KERAS_BACKEND", "torch")
import measure  # noqa: E402

CONSTRUCTORS = {"vgg19": "VGG19", "resnet152": "ResNet152"}


def one_model(name, batch, steps, rounds):
    import contextlib

    import keras
    import numpy as np
    import torch

    from keras_autovm import internals

    torch.backends.cudnn.deterministic = True
    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, CONSTRUCTORS[name])(weights=None)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, 224, 224, 3)).astype("float32")
    y = rng.integers(0, 1000, batch * steps)
    start = model.get_weights()
    found = {"keras": [], "views": []}
    weights = {}
    for r in range(rounds):
        order = ("keras", "views") if r % 2 == 0 else ("views", "keras")
        for variant in order:
            model.set_weights(start)
            timer = measure.step_timer(keras)
            context = (internals.torch_inputs_on_views() if variant == "views"
                       else contextlib.nullcontext())
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            with context:
                model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                          callbacks=[timer])
            found[variant].append({"step_s": statistics.median(timer.times[1:]),
                                   "peak_bytes": torch.cuda.max_memory_allocated()})
            weights[variant] = model.get_weights()
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(weights["keras"], weights["views"]))
    out = {"model": name, "batch": batch, "steps": steps, "rounds": found,
           "max_abs_weight_diff": diff}
    for key in ("step_s", "peak_bytes"):
        k = statistics.median(run[key] for run in found["keras"][1:] or found["keras"])
        v = statistics.median(run[key] for run in found["views"][1:] or found["views"])
        out[key] = {"keras": k, "views": v, "views_over_keras": v / k}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vgg19,resnet152")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import keras
    import torch
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "command": "python3 " + " ".join(sys.argv),
               "versions": {"keras": keras.__version__, "torch": torch.__version__,
                            "gpu": torch.cuda.get_device_name(0)},
               "models": []}
    for name in args.models.split(","):
        results["models"].append(one_model(name, args.batch, args.steps, args.rounds))
        torch.cuda.empty_cache()
        measure.save(results, args.out)
    print("model       step keras  step views  ratio   peak keras  peak views  ratio"
          "  max |dw|")
    for m in results["models"]:
        s, p = m["step_s"], m["peak_bytes"]
        print(f"{m['model']:10} {s['keras'] * 1e3:9.1f}ms {s['views'] * 1e3:9.1f}ms "
              f"{s['views_over_keras']:6.3f} {p['keras'] / 2**30:9.2f}GiB "
              f"{p['views'] / 2**30:9.2f}GiB {p['views_over_keras']:6.3f}  "
              f"{m['max_abs_weight_diff']:.3g}")


if __name__ == "__main__":
    main()
