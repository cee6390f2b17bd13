"""Each VGG-19 layer call's transient memory on TensorFlow, run alone.

    python3 recipes/gpu_tf_layer_transients.py --batch 64 --out results/tensorflow/trace/layer_transients.json

What a layer call allocates on the GPU beyond what it keeps, when its
forward and its backward run alone, each in its own `tf.function` (as
AutoVM's layer timing runs them): the allocator's peak while the pass runs,
above the larger of what was allocated before and after it, after
`--warmups` runs of the pass. This was tried as the TensorFlow memory
model's per-op workspace and dropped: run alone, VGG-19's `block1_conv2`
measured 7.06 GiB at batch 64, where the training step's allocator trace
(`gpu_tf_memory_trace.py`) shows about 2.4 GiB of temporaries in its
backward. Run alone, each call converts its tensors to cuDNN's
channels-first layout and back; in the step, TensorFlow's layout optimizer
converts the whole graph once. Kept to show that, on a GPU only. AutoVM
now measures them for the calls whose backward alone has no Transpose
(`gpu_tf_transients.py` sets the layout optimizer's part apart).
"""

import argparse
import datetime
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ["KERAS_BACKEND"] = "tensorflow"


def passes(layer, x):
    """`(forward, backward)`: the call's forward, and its backward alone."""
    import tensorflow as tf
    tv = [tf.identity(v.value) for v in layer.trainable_variables]
    ntv = [v.value for v in layer.non_trainable_variables]

    @tf.function
    def fwd(tv, x):
        return layer.stateless_call(tv, ntv, x)[0]

    with tf.GradientTape(persistent=True) as tape:
        tape.watch([tv, x])
        y = fwd(tv, x)
    return (lambda: fwd(tv, x)), (lambda: tape.gradient(y, [tv, x]))


def above_ends(run):
    """Peak bytes while `run()` runs, above the larger of before and after."""
    import tensorflow as tf
    tf.test.experimental.sync_devices()
    before = tf.config.experimental.get_memory_info("GPU:0")["current"]
    tf.config.experimental.reset_memory_stats("GPU:0")
    result = run()  # Held until `current` is read: what the call keeps.
    tf.test.experimental.sync_devices()
    info = tf.config.experimental.get_memory_info("GPU:0")
    del result
    return max(0, info["peak"] - max(before, info["current"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmups", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import keras
    import tensorflow as tf
    if not tf.config.list_physical_devices("GPU"):
        raise SystemExit("gpu_tf_layer_transients.py measures a GPU's allocator; there is none.")
    model = keras.applications.VGG19(weights=None)
    x = tf.zeros((args.batch, 224, 224, 3))
    found = {}
    for layer in model.layers[1:]:
        top = {}
        for name, run in zip(("forward", "backward"), passes(layer, x)):
            for _ in range(args.warmups):
                run()
            top[name] = above_ends(run)
        found[layer.name] = top
        print(f"{layer.name:14s} forward {top['forward'] / 2**20:8.0f} MiB  "
              f"backward {top['backward'] / 2**20:8.0f} MiB", flush=True)
        x = layer(x)
    result = {"command": " ".join(["python3"] + sys.argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                           "python": platform.python_version()},
              "gpu": tf.config.experimental.get_device_details(
                  tf.config.list_physical_devices("GPU")[0]).get("device_name"),
              "batch": args.batch, "warmups": args.warmups, "transient_bytes": found}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
