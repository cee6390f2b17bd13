"""SIMULATED: AutoVM's managed-memory hints against default CUDA UVM paging.

Oversubscribing managed memory is not allowed on the lent GPUs, so this
reproduces the AutoVM seed's claim (VGG-19 up to 2.5x faster with prefetch
and evict hints than with default paging) by simulation
(`keras_autovm.planner.uvm`): per-layer forward and backward times and
output sizes, and link bandwidths measured on the GPU, go in; the step
time of each policy at each oversubscription factor comes out. Nothing
here is measured on a GPU: the JSON says `"SIMULATED": true`.

Layer times come from `--calibration`, a JSON file
`{"device", "backend", "batch_size", "layers": [{"name", "fwd_s", "bwd_s",
"output_bytes"}], "link": {...}}` measured on the GPU. Without it they
come from the planner's roofline estimate for VGG-19 (Keras, active
backend), and the output is flagged `"uncalibrated": true`.
Link figures (GB/s) come from the calibration's `link` if it has them,
else from `--link` (the link probe in `results/gpu_managed_ops.json`).

    python recipes/uvm_sim.py --out results/planner/uvm_sim_vgg19_uncalibrated.json
    python recipes/uvm_sim.py \\
        --calibration results/calibration/vgg19_layer_times_jax.json \\
        --out results/planner/uvm_sim_vgg19_jax.json
"""

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from keras_autovm.planner import uvm  # noqa: E402
from planner_common import application_graph  # noqa: E402
from planner_common import write_json  # noqa: E402

LINK_KEYS = {"fault": "managed_fault_h2d", "prefetch_h2d": "managed_prefetch_h2d",
             "prefetch_d2h": "managed_prefetch_d2h", "evict": "managed_first_eviction"}


def read_link(calibration, link_path):
    """A `UvmLink` from the calibration's link, else the probe's JSON."""
    figures = dict((calibration or {}).get("link") or {})
    if not all(key in figures for key in LINK_KEYS.values()):
        with open(link_path) as f:
            probe = json.load(f)["parts"]["d_link_probe"]["result"]
        figures = {**probe, **figures}
    gbps = {}
    for field, key in LINK_KEYS.items():
        value = figures[key]
        gbps[field] = value["median"] if isinstance(value, dict) else value
    return uvm.UvmLink(**{k: v * 1e9 for k, v in gbps.items()}), gbps


def copy_time_link(path, layers):
    """The managed link figures (GB/s) of `gpu_uvm_copy_times.py`'s file:
    for each kind, the bytes of one copy of every layer output over the
    time the copies took at each layer's own size (layers under the
    probe's floor left out)."""
    with open(path) as f:
        sizes = {r["nbytes"]: r["probe"] for r in json.load(f)["sizes"] if "probe" in r}
    gbps = {}
    for field, key in LINK_KEYS.items():
        moved = [(l.output_bytes, sizes[l.output_bytes]) for l in layers
                 if l.output_bytes in sizes]
        figure = [p[key]["median"] if isinstance(p[key], dict) else p[key] for _, p in moved]
        total = sum(n for n, _ in moved)
        gbps[field] = total / sum(n / g for (n, _), g in zip(moved, figure))
    return uvm.UvmLink(**{k: v * 1e9 for k, v in gbps.items()}), gbps


def roofline_layers(batch):
    """VGG-19's layers with the planner's roofline times (uncalibrated)."""
    from keras_autovm import planner

    graph, _ = application_graph("VGG19", batch)
    cost = planner.CostModel()
    made = {op.name: 0 for op in graph.ops}
    for t in graph.tensors:
        made[t.producer] += t.nbytes
    return [uvm.UvmLayer(op.name, cost.fwd_time(op), cost.bwd_time(op), made[op.name])
            for op in graph.ops]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibration", default=None,
                        help="measured per-layer times (JSON); default: roofline")
    parser.add_argument("--link", default="results/gpu_managed_ops.json")
    parser.add_argument("--copy-times", default=None,
                        help="managed link figures from recipes/gpu_uvm_copy_times.py's "
                             "file, weighted by the layers' sizes (default: --link's)")
    parser.add_argument("--batch", type=int, default=128,
                        help="batch size for the roofline estimate")
    parser.add_argument("--factors", default="1.25,1.5,2,3")
    parser.add_argument("--ahead", type=int, default=None,
                        help="prefetch distance in layers (default: the best of "
                             "planner.uvm.AHEAD)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    calibration = None
    if args.calibration:
        with open(args.calibration) as f:
            calibration = json.load(f)
        layers = [uvm.UvmLayer(l["name"], l["fwd_s"], l["bwd_s"], l["output_bytes"])
                  for l in calibration["layers"]]
        batch = calibration.get("batch_size")
    else:
        print("UNCALIBRATED: layer times are the planner's roofline estimate, "
              "not measurements. Pass --calibration for a calibrated run.")
        layers, batch = roofline_layers(args.batch), args.batch
    link, gbps = read_link(calibration, args.link)
    if args.copy_times:
        link, gbps = copy_time_link(args.copy_times, layers)
    need = uvm.footprint(layers)
    rows = []
    for factor in (float(x) for x in args.factors.split(",")):
        capacity = int(need / factor)
        default = uvm.simulate_uvm(layers, capacity, link)
        evicted, ahead, hinted = uvm.hinted_plan(layers, capacity, link, args.ahead)
        rows.append({"oversubscription": factor, "capacity_bytes": capacity,
                     "speedup": default.step_time / hinted.step_time,
                     "evicted_layers": sorted(evicted), "prefetch_ahead_layers": ahead,
                     "default_uvm": dataclasses.asdict(default),
                     "autovm_hints": dataclasses.asdict(hinted)})
        print(f"SIMULATED {factor}x oversubscription: default UVM "
              f"{default.step_time * 1e3:.1f} ms, AutoVM hints "
              f"{hinted.step_time * 1e3:.1f} ms, speedup {rows[-1]['speedup']:.2f}x")
    out = {"SIMULATED": True,
           "what": "simulated step time of VGG-19 in oversubscribed managed memory: "
                   "default UVM paging vs AutoVM evict/prefetch hints "
                   "(keras_autovm.planner.uvm); not a GPU measurement",
           "uncalibrated": calibration is None,
           "layer_times_from": args.calibration or "planner roofline estimate (CostModel())",
           "device": (calibration or {}).get("device"),
           "backend": (calibration or {}).get("backend"),
           "batch_size": batch, "link_gbps": gbps, "link_from": args.copy_times or (
               args.link if set(LINK_KEYS.values()) - set((calibration or {}).get("link") or {})
               else args.calibration),
           "page_bytes": uvm.PAGE,
           "footprint_bytes": need,
           "compute_s": sum(l.fwd_s + l.bwd_s for l in layers),
           "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
           "command": " ".join(["python"] + sys.argv), "results": rows}
    write_json(args.out, out)


if __name__ == "__main__":
    main()
