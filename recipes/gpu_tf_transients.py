"""What one layer call allocates for a moment on TensorFlow, alone and in a chain.

Measures, on the GPU, the transient bytes (`mechanisms/tensorflow/timing.py`'s
`_transient`) of a few VGG-19 and ResNet layers called alone, with Grappler's
layout optimizer on and off, and of the same layers run as a chain in one
function, and counts the Transpose ops in each optimized backward graph:
the layout optimizer's part of what `gpu_tf_layer_transients.py` measured
for each VGG-19 layer alone, and what decides which calls AutoVM's
timing counts a workspace for. Writes JSON.

    python3 recipes/gpu_tf_transients.py --batch 44 --out results/tensorflow/workspace/transients_b44_cap0.json
    python3 recipes/gpu_tf_transients.py --batch 44 --cap-gib 8 --out results/tensorflow/workspace/transients_b44_cap8.json
"""

import argparse
import datetime
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# Run from a checkout: the package is the folder above this one.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_autovm.mechanisms.tensorflow import internals  # noqa: E402
from keras_autovm.mechanisms.tensorflow import timing  # noqa: E402

MiB = 1 << 20


def cases(batch):
    return {
        "vgg_block1_conv2": ((batch, 224, 224, 64), lambda: keras.layers.Conv2D(
            64, 3, padding="same", activation="relu")),
        "vgg_block1_pool": ((batch, 224, 224, 64), lambda: keras.layers.MaxPooling2D()),
        "resnet_bn_56x256": ((batch, 56, 56, 256), lambda: keras.layers.BatchNormalization()),
        "resnet_conv_1x1": ((batch, 56, 56, 64), lambda: keras.layers.Conv2D(256, 1)),
    }


def alone(shape, make):
    layer = make()
    x = tf.ones(shape)
    y = layer(x)
    kwargs = {"training": True} if isinstance(layer, keras.layers.BatchNormalization) else {}
    measured = timing.time_call(layer, (x,), kwargs, 1)
    return {"input_mib": x.numpy().nbytes / MiB, "output_mib": int(tf.size(y)) * 4 / MiB,
            "workspace_mib": measured.workspace_bytes / MiB,
            "fwd_ms": measured.fwd_s * 1e3, "bwd_ms": measured.bwd_s * 1e3}


def transposes(shape, make):
    layer = make()
    x = tf.ones(shape)
    layer(x)
    kwargs = {"training": True} if isinstance(layer, keras.layers.BatchNormalization) else {}
    runs = timing._Runs(lambda tv, xs: layer(xs[0], **kwargs), [([], [x])])
    gradient = runs._gradient()
    graphs = internals.tf_function_graphs(gradient)
    ops = [n.op for g in graphs for n in g.post_optimization_graph.node]
    return {"transposes": ops.count("Transpose"), "ops": len(ops)}


def chain(batch):
    """VGG-19's first block, as one function: its transient against the sum
    of its layers' alone."""
    layers = [keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
              keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
              keras.layers.MaxPooling2D()]
    model = keras.Sequential([keras.Input((224, 224, 3))] + layers)
    x = tf.ones((batch, 224, 224, 3))
    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    runs = timing._Runs(lambda tv, xs: model.stateless_call(tv, ntv, xs[0])[0], [(tv, [x])])
    gradient = runs._gradient()
    gradient()
    return {"block1_chain_workspace_mib": timing._transient(gradient) / MiB,
            "block1_chain_forward_mib": timing._transient(lambda: runs.runs(runs.arguments)) / MiB}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--cap-gib", type=float, default=0.0,
                        help="cap TensorFlow's GPU allocator (0: no cap)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    gpus = tf.config.list_physical_devices("GPU")
    if gpus and args.cap_gib:
        tf.config.set_logical_device_configuration(gpus[0], [
            tf.config.LogicalDeviceConfiguration(memory_limit=int(args.cap_gib * 1024))])
    details = tf.config.experimental.get_device_details(gpus[0]) if gpus else {}
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": " ".join(["python3"] + sys.argv), "batch": args.batch,
              "cap_gib": args.cap_gib, "tensorflow": tf.__version__, "keras": keras.__version__,
              "gpu": details.get("device_name", ""), "layers": {}}
    for name, (shape, make) in cases(args.batch).items():
        row = {"layout_on": alone(shape, make), **transposes(shape, make)}
        tf.config.optimizer.set_experimental_options({"layout_optimizer": False})
        row["layout_off"] = alone(shape, make)
        row["layout_off_transposes"] = transposes(shape, make)["transposes"]
        tf.config.optimizer.set_experimental_options({"layout_optimizer": True})
        result["layers"][name] = row
        print(name, json.dumps(row))
    result.update(chain(args.batch))
    print(json.dumps({k: v for k, v in result.items() if k != "layers"}))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
