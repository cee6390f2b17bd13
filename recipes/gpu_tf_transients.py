"""What one layer call allocates for a moment on TensorFlow, alone and in a chain.

Measures, on the GPU, the transient bytes (`mechanisms/tensorflow/timing.py`'s
`_transient`) of a few VGG-19 and ResNet layers called alone, with Grappler's
layout optimizer on and off, and of the same layers run as a chain in one
function, and counts the Transpose ops in each optimized backward graph
(all, and those the layout optimizer made):
the layout optimizer's part of what `gpu_tf_layer_transients.py` measured
for each VGG-19 layer alone, and what decides which calls AutoVM's
timing counts a workspace for. Writes JSON.

The committed `results/tensorflow/workspace/transients_b44_cap*.json` came
from this recipe at 0c21607, which measured each call through
`timing.time_call` (then every call's workspace) and counted Transposes in
the input's gradient only; it wrote no date, command or device name.

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
from keras_autovm.mechanisms.timing import call_values  # noqa: E402
from keras_autovm.mechanisms.timing import variable_values  # noqa: E402

MiB = 1 << 20


def cases(batch):
    return {
        "vgg_block1_conv2": ((batch, 224, 224, 64), lambda: keras.layers.Conv2D(
            64, 3, padding="same", activation="relu")),
        "vgg_block1_pool": ((batch, 224, 224, 64), lambda: keras.layers.MaxPooling2D()),
        "resnet_bn_56x256": ((batch, 56, 56, 256), lambda: keras.layers.BatchNormalization()),
        "resnet_conv_1x1": ((batch, 56, 56, 64), lambda: keras.layers.Conv2D(256, 1)),
    }


def _runs(shape, make):
    """The layer's call, with its weights, as the layer timing runs it."""
    layer = make()
    x = tf.ones(shape)
    y = layer(x)
    kwargs = {"training": True} if isinstance(layer, keras.layers.BatchNormalization) else {}
    tv, ntv = variable_values(layer)
    runs = timing._Runs(lambda tv, xs: call_values(layer, tv, ntv, (xs[0],), kwargs), [(tv, [x])])
    return runs, x, y


def alone(shape, make):
    """The call's transients, forward and backward, whatever AutoVM counts."""
    runs, x, y = _runs(shape, make)
    forward = lambda: runs.runs(runs.arguments)  # noqa: E731
    forward()
    gradient = runs._gradient()
    gradient()
    fwd, bwd = timing._transient(forward), timing._transient(gradient)
    return {"input_mib": x.numpy().nbytes / MiB, "output_mib": int(tf.size(y)) * 4 / MiB,
            "workspace_mib": max(fwd, bwd) / MiB, "forward_mib": fwd / MiB,
            "backward_mib": bwd / MiB}


def transposes(shape, make):
    """Transposes in the call's optimized backward (weights' gradients
    included), all of them and those the layout optimizer made."""
    runs, _, _ = _runs(shape, make)
    graphs = internals.tf_function_graphs(runs._gradient())
    nodes = [n for g in graphs for n in g.post_optimization_graph.node]
    return {"transposes": sum(n.op == "Transpose" for n in nodes),
            "layout_transposes": sum(n.op == "Transpose" and "LayoutOptimizer" in n.name
                                     for n in nodes),
            "ops": len(nodes)}


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
