"""Managed-memory copy times at each VGG-19 layer's size, measured on the GPU.

The UVM simulator (`keras_autovm.planner.uvm`, `recipes/uvm_sim.py`)
prices every copy at one bandwidth per kind, measured with one 256 MiB
buffer. This measures the same kinds of copy at the size of each layer
output in a calibration file, so `uvm_sim.py --copy-times` can set the
simulator's per-layer copy times beside measured ones. On the lent GPU,
no TensorFlow or Keras needed:

    python3 recipes/gpu_uvm_copy_times.py --out $OUT/uvm_copy_times_vgg19.json

It builds the native module for the machine's Python, then runs its link
probe (`_autovm_native.link_probe`: pinned copies both ways, managed
prefetch both ways, the first eviction of pages new to the host, and
fault-driven migration back) once per distinct output size. The probe
refuses any buffer over a quarter of the free device memory, so managed
memory is never oversubscribed.
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def native_module():
    """Builds and loads `_autovm_native` without importing the package
    (the package imports Keras, which the bare GPU machine lacks)."""
    build = load(os.path.join(ROOT, "keras_autovm", "native", "build.py"), "_build")
    built = build.build_native(force=True)
    return load(str(built), "_autovm_native"), str(built)


def sizes_of(calibration):
    """Distinct output sizes (bytes) of the calibration's layers, with names."""
    by_size = {}
    for layer in calibration["layers"]:
        by_size.setdefault(layer["output_bytes"], []).append(layer["name"])
    return by_size


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibration",
                        default=os.path.join(ROOT, "results", "calibration",
                                             "vgg19_layer_times_torch.json"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(
        os.environ.get("OUT", "."), "uvm_copy_times_vgg19.json"))
    args = parser.parse_args()
    with open(args.calibration) as f:
        calibration = json.load(f)
    nat, built = native_module()
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True)
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "command": " ".join(["python3"] + sys.argv), "gpu": smi.stdout.strip(),
           "python": platform.python_version(), "native": built,
           "calibration": os.path.relpath(args.calibration, ROOT),
           "repeats": args.repeats, "unit": "GB/s (1e9 bytes per second)", "sizes": []}
    for nbytes, names in sorted(sizes_of(calibration).items(), reverse=True):
        row = {"nbytes": nbytes, "layers": names}
        if nbytes < MiB:  # The probe's floor: too small to time one copy.
            row["skipped"] = "under 1 MiB"
        else:
            start = time.perf_counter()
            row["probe"] = nat.link_probe(nbytes, args.repeats, 0)
            row["wall_s"] = time.perf_counter() - start
        out["sizes"].append(row)
        probe = row.get("probe") or {}
        print(f"{nbytes / MiB:8.1f} MiB  " + "  ".join(
            f"{k} {probe[k]['median'] if isinstance(probe[k], dict) else probe[k]:.1f}"
            for k in ("pinned_d2h", "managed_prefetch_h2d", "managed_prefetch_d2h",
                      "managed_first_eviction", "managed_fault_h2d") if k in probe),
              flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
