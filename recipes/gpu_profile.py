"""How long AutoVM's profiling takes against a first epoch, and the per-layer
times it measures, for the UVM simulator's calibration.

    python -m keras_autovm.native.build      # once: the native link probe
    python recipes/gpu_profile.py --backend torch --batch-size 32 --steps 30 \
        --out results/calibration

For each model (`--models`, default VGG-19 and ResNet-152 at 224x224,
random weights), in this order: AutoVM's profiling phase
(`keras_autovm.profiling.measure`: each layer call's forward and backward,
then the link), then a first epoch of `--steps` training steps of plain
Keras `fit` (compile included, as a user's first epoch has it), the clock
stopped once the device is done. Writes
`<out>/<model>_profile_<backend>_b<batch>.json` (the `keras_autovm.Profile`,
`Profile.load` reads it) and `<out>/<model>_layer_times_<backend>.json`:

    {"device", "backend", "batch_size",
     "layers": [{"name", "fwd_s", "bwd_s", "output_bytes"}],
     "link": {"pinned_d2h": GB/s, "pinned_h2d": GB/s, ...},
     "profile_s", "first_epoch_s", "steps"}

and prints profiling time as a share of the first epoch. `--smoke` runs a
tiny CNN at 32x32 instead (a CPU check of the script, in seconds).
The CPU figures in docs/planner.md are from

    python recipes/gpu_profile.py --backend B --models small_cnn \
        --batch-size 64 --steps 32 --out /tmp/profile
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch",
                        choices=("torch", "jax", "tensorflow"))
    parser.add_argument("--models", default="vgg19,resnet152",
                        help="comma-separated: vgg19, resnet152, small_cnn "
                             "(recipes/small_cnn.py's model, 64x64)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30,
                        help="training steps in the timed first epoch")
    parser.add_argument("--out", default=os.path.join("results", "calibration"))
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny CNN at 32x32 (runs on a CPU)")
    return parser.parse_args()


def make_model(name, keras):
    if name == "tiny":
        inputs = keras.Input((32, 32, 3))
        x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        return keras.Model(inputs, keras.layers.Dense(10)(x), name="tiny")
    if name == "small_cnn":
        sys.path.insert(0, HERE)
        import small_cnn
        return small_cnn.make_model()
    build = {"vgg19": keras.applications.VGG19,
             "resnet152": keras.applications.ResNet152,
             "resnet50": keras.applications.ResNet50,
             "densenet121": keras.applications.DenseNet121}[name]
    return build(weights=None, input_shape=(224, 224, 3), classes=1000)


def wait_for_device(keras, model):
    """Returns once the device has finished: a weight read back to the host
    waits for every step that wrote it (and torch is synchronised)."""
    if keras.backend.backend() == "torch":
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    keras.ops.convert_to_numpy(model.trainable_variables[-1].value)


def first_epoch_seconds(keras, model, batch_size, steps):
    """Wall time of a first `fit` epoch of `steps` steps on one random batch."""
    import numpy as np

    shape = (batch_size,) + tuple(model.inputs[0].shape[1:])
    classes = model.outputs[0].shape[-1]
    rng = np.random.default_rng(0)
    x = rng.normal(size=shape).astype("float32")
    y = rng.integers(0, classes, batch_size)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return steps

        def __getitem__(self, index):
            return x, y

    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    start = time.perf_counter()
    model.fit(Batches(), epochs=1, verbose=0)
    wait_for_device(keras, model)
    return time.perf_counter() - start


def run(name, args, keras):
    from keras_autovm import mechanisms
    from keras_autovm import profiling

    keras.utils.set_random_seed(0)
    model = make_model(name, keras)
    mechanism = mechanisms.get()
    start = time.perf_counter()
    profile = profiling.measure(model, args.batch_size, mechanism, verbose=1)
    profile_s = time.perf_counter() - start
    epoch_s = first_epoch_seconds(keras, model, args.batch_size, args.steps)
    result = {"device": profile.device, "backend": profile.backend,
              "batch_size": args.batch_size,
              "layers": [{"name": t.name, "fwd_s": t.fwd_s, "bwd_s": t.bwd_s,
                          "output_bytes": t.output_bytes} for t in profile.layers],
              "link": dict(profile.link), "profile_s": profile_s,
              "first_epoch_s": epoch_s, "steps": args.steps}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{name}_layer_times_{args.backend}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    # The profile as AutoVM keeps it (`keras_autovm.Profile.load`), so that
    # plans can be made on a CPU from what the GPU measured.
    profile.save(os.path.join(args.out, f"{name}_profile_{args.backend}_b{args.batch_size}.json"))
    fwd = sum(t.fwd_s for t in profile.layers)
    bwd = sum(t.bwd_s for t in profile.layers)
    print(f"{name}: {len(profile.layers)} layer calls, sum of forward "
          f"{fwd * 1e3:.1f} ms, backward {bwd * 1e3:.1f} ms; link "
          f"{ {k: round(v, 1) for k, v in profile.link.items()} } GB/s")
    print(f"{name}: profiling {profile_s:.2f} s, first epoch ({args.steps} steps) "
          f"{epoch_s:.2f} s: profiling is {profile_s / epoch_s:.1%} of it -> {path}")
    return result


def main():
    args = parse_args()
    os.environ["KERAS_BACKEND"] = args.backend
    import keras

    if keras.backend.backend() != args.backend:
        sys.exit(f"Keras was already imported with backend {keras.backend.backend()!r}")
    names = ["tiny"] if args.smoke else [n.strip() for n in args.models.split(",")]
    print(f"Backend {args.backend}, batch size {args.batch_size}, {args.steps} steps")
    for name in names:
        run(name, args, keras)


if __name__ == "__main__":
    main()
