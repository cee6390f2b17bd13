"""How each layer's transient and saved bytes grow with the batch, on torch.

    python3 recipes/gpu_torch_transients.py --model vgg19 --batches 2,4,16,32,64 \
        --out $OUT/torch_transients_vgg19.json

AutoVM's torch profile (`mechanisms/torch/profile.py`) measures, per layer
call, the bytes autograd saves inside the layer and the transient bytes
of its forward and backward, at batch sizes 2 and 4, and extrapolates
linearly to the training batch. This runs the same measurement at each of
`--batches` and writes the figures per op, so the extrapolation can be
checked against the measured values at the real batch.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("KERAS_BACKEND", "torch")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg19")
    parser.add_argument("--batches", default="2,4,16,32,64")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import keras
    import torch
    from keras_autovm.mechanisms.torch import profile

    model = getattr(keras.applications, {"vgg19": "VGG19", "resnet152": "ResNet152"}[
        args.model])(weights=None)
    out = {"model": args.model, "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "batches": {}}
    for batch in [int(b) for b in args.batches.split(",")]:
        start = time.time()
        found = profile._run(model, batch, None)
        torch.cuda.synchronize()
        out["batches"][batch] = {name: {"saved_tags": sorted(tags), "internal": internal,
                                        "transient": transient}
                                 for name, (tags, internal, transient) in found.items()}
        out.setdefault("seconds", {})[batch] = time.time() - start
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(out, f)
        print(f"batch {batch}: {time.time() - start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
