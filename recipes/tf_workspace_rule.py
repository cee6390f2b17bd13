"""What TensorFlow's measured workspaces do to plans, recomputed on a CPU.

Takes a profile measured on a GPU (the profile cache's JSON, with each
layer call's `workspace_bytes`) and plans the model with it under three
rules for which workspaces count: every one measured (code 0c21607), the
rule AutoVM has now (none for calls whose backward alone has a layout
Transpose on a GPU -- convolutions and max pooling, taken here by layer
class -- and a Dense layer's kernel bytes off), and none. For each it
records `offload_all`'s predicted peak, what that plan has in use during
the backward of the layers named with `--at`, and what `auto` plans under
`--budget-gib` at each headroom of `--headrooms`. Predictions of the
simulator, from measured layer times and workspaces; nothing runs on a GPU.
A profile from 0c21607 holds, per call, the most of its forward's and its
backward's transients, where AutoVM now measures the backward's alone.

    python recipes/tf_workspace_rule.py --model resnet152 --batch 264 \\
        --profile results/tensorflow/workspace/0c21607_profile_resnet152_b264.json \\
        --at conv2_block1_0_bn,conv2_block1_3_bn \\
        --out results/tensorflow/workspace/rule_resnet152_b264.json
"""

import argparse
import dataclasses
import json
import os
import sys
import warnings

os.environ["KERAS_BACKEND"] = "tensorflow"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import keras  # noqa: E402

import keras_autovm  # noqa: E402
from gpu_tf_memory_trace import predicted_during  # noqa: E402
from keras_autovm import profiling  # noqa: E402

GiB = 1 << 30
MODELS = {"resnet152": keras.applications.ResNet152, "vgg19": keras.applications.VGG19}
# Layers whose optimized backward, alone on a GPU, has a Transpose.
TRANSPOSED = ("Conv2D", "MaxPooling2D")


def rules(model, profile):
    """The profile under each rule, by name."""
    layers = {layer.name: layer for layer in model.layers}

    def now(t):
        layer = layers.get(t.name)
        if isinstance(layer, tuple(getattr(keras.layers, k) for k in TRANSPOSED)):
            return dataclasses.replace(t, workspace_bytes=0)
        weights = sum(int(v.numpy().nbytes) for v in layer.trainable_weights) if layer else 0
        return dataclasses.replace(t, workspace_bytes=max(0, t.workspace_bytes - weights))

    def with_layers(change):
        return dataclasses.replace(profile, layers=tuple(change(t) for t in profile.layers))

    return {"every_call": profile, "now": with_layers(now),
            "none": with_layers(lambda t: dataclasses.replace(t, workspace_bytes=0))}


def predict(model, batch, profile, at, budget, headrooms):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # The profile's architecture hash is the GPU run's.
        return _predict(model, batch, profile, at, budget, headrooms)


def _predict(model, batch, profile, at, budget, headrooms):
    offload = keras_autovm.plan(model, batch, "1000GiB", policy="offload_all", profile=profile)
    row = {"offload_all_peak_gib": offload.result.peak_bytes / GiB, "during_bwd_gib": {}}
    for name in at:
        during = predicted_during(offload.result, name, "bwd")
        row["during_bwd_gib"][name] = during / GiB if during is not None else None
    for headroom in headrooms:
        key = f"auto_budget_{budget:g}gib_headroom_{headroom:g}"
        try:
            plan = keras_autovm.plan(model, batch, int(budget * GiB), policy="auto",
                                     headroom=headroom, profile=profile)
            row[key] = {"peak_gib": plan.result.peak_bytes / GiB}
        except keras_autovm.PlanError as error:
            row[key] = {"refused": str(error), "min_budget_gib": error.min_budget / GiB}
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--profile", required=True)
    parser.add_argument("--at", default="", help="layers, comma-separated")
    parser.add_argument("--budget-gib", type=float, default=8.0)
    parser.add_argument("--headrooms", default="0.05,0.15")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model = MODELS[args.model](weights=None)
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    profile = profiling.Profile.load(args.profile)
    at = [name for name in args.at.split(",") if name]
    headrooms = [float(h) for h in args.headrooms.split(",")]
    result = {"command": " ".join(["python"] + sys.argv), "model": args.model,
              "batch": args.batch, "profile": args.profile, "SIMULATED": True, "rules": {}}
    for name, ruled in rules(model, profile).items():
        result["rules"][name] = predict(model, args.batch, ruled, at, args.budget_gib, headrooms)
        print(name, json.dumps(result["rules"][name]))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
