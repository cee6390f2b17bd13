"""Throughput under oversubscription: AutoVM against its peers, one run.

    python3 recipes/gpu_oversub.py --backend torch --model vgg19 --batch 64 \\
        --out $OUT/gpu_oversub_torch_vgg19.json

First in-core without a cap at `--batch`: its measured peak is the in-core
need and its throughput the reference. Then for each factor in `--factors`
the allocator is capped at need / factor (the budget), and each method
trains at the same batch under it, each in its own process:

- `remat`: the model built under `keras.RematScope(mode="full")`;
- `offload_all`: `AutoVM(policy="offload_all")`, every layer output
  swapped (vDNN's policy);
- `save_on_cpu` (torch only): `fit` under
  `torch.autograd.graph.save_on_cpu(pin_memory=True)`;
- `autovm`: `AutoVM(budget=<the cap>)`, `auto` choosing.

For each: status (ok, out of memory, or AutoVM's `PlanError` with the
smallest feasible budget), images/s as a ratio to the reference, the
measured peak against the budget, and AutoVM's predicted peak and step time
against the measured ones. Every step waits for the device (the loss is read
back). With matplotlib, also writes a PNG of throughput ratio against
oversubscription next to the JSON. Training, peaks and timers are
`gpu_swap.py`'s.

With `--noxla-reference`, Keras's own step with `jit_compile=False` also
trains uncapped after the in-core reference, and each run's images/s is
given against it too (`throughput_vs_noxla`): on TensorFlow a plan that
swaps runs without XLA, so this separates what turning XLA off costs from
what the plan's copies and recomputation cost. Each result records the
environment variables set on the command line that change what runs
(`gpu_swap.environment`), such as `TF_XLA_FLAGS`.

    python3 recipes/gpu_oversub.py --merge A.json B.json --out merged.json

puts the factors of several runs of one backend, model and batch in one
file and one plot, on a machine without a GPU. Each ratio stays the one
its own run measured against its own in-core step; where two runs have a
factor and method in common, the later file's is taken. Each factor names
the file (`from`) and command it came from.
"""

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gpu_swap  # noqa: E402
import measure  # noqa: E402

GiB = 2**30
METHODS = ("remat", "offload_all", "save_on_cpu", "autovm")


def child(args):
    """One training run under `args.cap_gib` (0: uncapped)."""
    if args.cap_gib:
        gpu_swap.setup(args.backend, args.cap_gib)
    budget = int(args.cap_gib * GiB) if args.cap_gib else None
    method, policy = {"remat": ("remat", "auto"), "incore": ("incore", "auto"),
                      "incore_noxla": ("incore_noxla", "auto"),
                      "save_on_cpu": ("incore", "auto"),
                      "offload_all": ("autovm_offload", "offload_all"),
                      "autovm": ("autovm_swap", "auto")}[args.method]
    with saving_on_cpu(args.method == "save_on_cpu"):
        out = gpu_swap.train(args.model, method, args.batch, args.steps,
                             policy=policy, budget=budget)
    out["method"] = args.method
    print("RESULT " + json.dumps(out), flush=True)


@contextlib.contextmanager
def saving_on_cpu(active):
    if not active:
        yield
        return
    import torch
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        yield


def spawn(args, method, cap_gib):
    cmd = [sys.executable, __file__, "--child", "--backend", args.backend,
           "--model", args.model, "--batch", str(args.batch), "--steps",
           str(args.steps), "--method", method, "--cap-gib", f"{cap_gib:.4f}"]
    env = dict(os.environ, KERAS_BACKEND=args.backend, PYTHONUNBUFFERED="1")
    start = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        text = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as expired:  # What it said before, to see where.
        text = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part
                       for part in (expired.stdout, expired.stderr) if part)
        return {"method": method, "status": "timeout", "wall_s": time.time() - start,
                "log_tail": text[-2500:]}
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    run = json.loads(lines[-1][7:]) if lines else {"method": method, "status": "crashed"}
    run.update(wall_s=time.time() - start, log_tail=text[-2500:])
    return run


def summary(run, reference, budget_gib, noxla=None):
    """The row printed for a run: status, throughput ratio (and against
    Keras's step without XLA where `noxla` trained), peaks."""
    row = {"status": run.get("status")}
    if run.get("status") == "ok":
        row["throughput_ratio"] = run["images_per_s"] / reference["images_per_s"]
        if noxla and noxla.get("status") == "ok":
            row["throughput_vs_noxla"] = run["images_per_s"] / noxla["images_per_s"]
        row["measured_peak_gib"] = (run.get("steady_peak_bytes") or 0) / GiB
        row["budget_gib"] = budget_gib
        if run.get("predicted_step_s"):
            row["step_measured_over_predicted"] = run["step_s"] / run["predicted_step_s"]
            row["peak_measured_over_predicted"] = (
                run["steady_peak_bytes"] / run["predicted_peak_bytes"])
    elif run.get("error"):
        row["error"] = run["error"][:300]
    return row


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in results["methods"]:
        points = [(f["factor"], f["summary"][method].get("throughput_ratio", 0.0))
                  for f in results["factors"]
                  if f["summary"][method].get("status") != "not run"]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
    ax.set_xlabel("oversubscription (in-core need / budget)")
    ax.set_ylabel("throughput / in-core uncapped (0: did not run)")
    ax.set_title(f"{results['model']} batch {results['batch']}, {results['backend']}, "
                 f"{results['versions'].get('gpu', '').split(',')[0]}")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def merged(runs, names):
    """The factors of `runs` (results of one backend, model and batch, in
    the order given) in one result: each factor with the summaries of every
    method measured at it, a later run's replacing an earlier one's."""
    first = runs[0]
    for run in runs[1:]:
        same = [run[k] == first[k] for k in ("backend", "model", "batch")]
        if not all(same):
            raise ValueError(f"--merge takes runs of one backend, model and batch; "
                             f"received {first['backend']} {first['model']} {first['batch']} "
                             f"and {run['backend']} {run['model']} {run['batch']}")
    factors = {}
    for run, name in zip(runs, names):
        for entry in run["factors"]:
            into = factors.setdefault(entry["factor"], {"factor": entry["factor"],
                                                        "summary": {}, "from": {}})
            for method, row in entry["summary"].items():
                into["summary"][method] = dict(row, budget_gib=entry["budget_gib"])
                into["from"][method] = name
    methods = sorted({m for f in factors.values() for m in f["summary"]})
    for entry in factors.values():  # Not measured at this factor: no point.
        for method in methods:
            entry["summary"].setdefault(method, {"status": "not run"})
    return {"backend": first["backend"], "model": first["model"], "batch": first["batch"],
            "versions": first["versions"], "methods": methods,
            "merged": [{"from": n, "command": r["command"], "date": r["date"],
                        "incore_images_per_s": r["incore_uncapped"].get("images_per_s"),
                        "incore_noxla_images_per_s": (r.get("incore_noxla_uncapped")
                                                      or {}).get("images_per_s")}
                       for r, n in zip(runs, names)],
            "factors": [factors[k] for k in sorted(factors)]}


def merge(paths, out):
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    save(merged(runs, [os.path.basename(p) for p in paths]), out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch", choices=("torch", "tensorflow", "jax"))
    parser.add_argument("--model", default="vgg19", choices=("vgg19", "resnet152"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--factors", default="1,1.5,2,3,4")
    parser.add_argument("--methods", default=",".join(METHODS))
    measure.child_arguments(parser, 240)
    parser.add_argument("--method", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cap-gib", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--noxla-reference", action="store_true",
                        help="also train Keras's step without XLA, uncapped, as a reference")
    parser.add_argument("--merge", nargs="+", default=None,
                        help="results of this recipe to put in one file and plot")
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.noxla_reference and args.backend != "tensorflow":
        parser.error("--noxla-reference is TensorFlow's: on JAX a step without XLA runs "
                     "eagerly, and torch has no XLA step")
    if args.merge:
        if not args.out:
            parser.error("--merge needs --out, the merged file to write")
        return merge(args.merge, args.out)
    methods = [m for m in args.methods.split(",")
               if m != "save_on_cpu" or args.backend == "torch"]
    # Before `versions`, which imports Keras: its backend is fixed at import.
    os.environ["KERAS_BACKEND"] = args.backend
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "command": " ".join(["python3"] + sys.argv), "backend": args.backend,
               "model": args.model, "batch": args.batch, "methods": methods,
               "environment": gpu_swap.environment(),
               "versions": gpu_swap.versions(args.backend), "factors": []}
    reference = spawn(args, "incore", 0.0)
    results["incore_uncapped"] = reference
    print(f"in-core uncapped: {reference.get('status')}, "
          f"{reference.get('images_per_s', 0):.1f} img/s, peak "
          f"{(reference.get('steady_peak_bytes') or 0) / GiB:.2f} GiB", flush=True)
    if reference.get("status") != "ok":
        return save(results, args.out)
    noxla = spawn(args, "incore_noxla", 0.0) if args.noxla_reference else None
    if noxla:
        results["incore_noxla_uncapped"] = noxla
        print(f"in-core without XLA, uncapped: {noxla.get('status')}, "
              f"{noxla.get('images_per_s', 0):.1f} img/s ("
              f"{summary(noxla, reference, 0.0).get('throughput_ratio', 0):.3f}x)", flush=True)
    need = reference["steady_peak_bytes"] / GiB
    for factor in [float(f) for f in args.factors.split(",")]:
        cap = need / factor
        runs = {m: spawn(args, m, cap) for m in methods}
        entry = {"factor": factor, "budget_gib": cap, "runs": runs,
                 "summary": {m: summary(r, reference, cap, noxla) for m, r in runs.items()}}
        results["factors"].append(entry)
        for m, row in entry["summary"].items():
            print(f"x{factor:<4} {cap:6.2f} GiB {m:12s} {json.dumps(row)[:200]}", flush=True)
        save(results, args.out)
    return save(results, args.out)


def save(results, out):
    """The results, then their plot beside them (named in the results)."""
    if not out:
        return
    measure.save(results, out)
    results["plot"] = plot(results, out[:-5] + ".png" if out.endswith(".json") else out + ".png")
    measure.save(results, out)


if __name__ == "__main__":
    main()
