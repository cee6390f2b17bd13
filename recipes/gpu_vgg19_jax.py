"""GPU evidence for the foundation: VGG-19 on JAX, under a capped allocator.

Each variant runs in its own process (XLA's memory cap is fixed when JAX
starts) and trains VGG-19 (224x224, random data, Adam) at one batch size:

- incore_uncapped: no cap, no AutoVM: the reference throughput and peak;
- incore_capped: the cap, no AutoVM: expected to run out of memory;
- remat_capped: the cap, every layer under `keras.RematScope(mode="full")`;
- autovm_capped: the cap, `AutoVM(budget=...)` (plans keep/swap/recompute);
- equivalence: a small CNN trained with and without AutoVM swapping
  everything (offload_all) on the GPU: the weights must agree.

    python recipes/gpu_vgg19_jax.py --out results/gpu_vgg19_jax.json

Writes one JSON file with device, driver, versions, date, command and every
measurement, and prints a table of throughput ratios last.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # The repository root: keras_autovm.
sys.path.insert(0, HERE)

import measure  # noqa: E402 -- recipes/, on the path above


def run_variant(name, batch, steps, budget):
    """Runs inside the child process: one variant, returns a dict."""
    import jax
    import keras
    import numpy as np

    import keras_autovm

    keras.utils.set_random_seed(0)
    if name == "equivalence":
        return equivalence()
    scope = keras.RematScope(mode="full") if name == "remat_capped" else None
    if scope:
        with scope:
            model = keras.applications.VGG19(weights=None)
    else:
        model = keras.applications.VGG19(weights=None)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).normal(size=(batch * steps, 224, 224, 3)).astype("float32")
    y = np.random.default_rng(1).integers(0, 1000, batch * steps)
    timer = measure.step_timer(keras)
    callbacks = [timer]
    autovm = None
    if name == "autovm_capped":
        autovm = keras_autovm.AutoVM(budget=budget, verbose=1)
        callbacks.insert(0, autovm)
    stats = jax.devices()[0].memory_stats() or {}
    model.fit(x, y, batch_size=batch, epochs=2, callbacks=callbacks, verbose=2)
    stats = jax.devices()[0].memory_stats() or {}
    out = {"bytes_limit": stats.get("bytes_limit"),
           "peak_bytes": stats.get("peak_bytes_in_use"),
           "step_times": timer.times,
           "images_per_s": batch / float(np.median(timer.times[1:]))}
    if autovm is not None and autovm.report is not None:
        report = autovm.report.to_dict()
        out["plan"] = {k: report["plan"][k] for k in report["plan"]
                       if k in ("policy", "counts", "result", "budget_bytes",
                                "headroom", "limit_bytes")}
        out["epochs"] = report["epochs"]
        out["stats"] = report["stats"]
    return out


def equivalence():
    """Same weights with and without AutoVM offloading every activation."""
    import keras
    import numpy as np

    import keras_autovm

    def train(callbacks):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((32, 32, 3))
        x = inputs
        for f in (32, 64, 64):
            x = keras.layers.Conv2D(f, 3, padding="same", activation="relu")(x)
            x = keras.layers.BatchNormalization()(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        model = keras.Model(inputs, keras.layers.Dense(10)(x))
        model.compile(keras.optimizers.SGD(0.05), "mse")
        rng = np.random.default_rng(0)
        data = rng.normal(size=(256, 32, 32, 3)).astype("float32")
        target = rng.normal(size=(256, 10)).astype("float32")
        model.fit(data, target, batch_size=32, epochs=2, shuffle=False,
                  callbacks=callbacks, verbose=0)
        return model.get_weights()

    callback = keras_autovm.AutoVM(budget=None, policy="offload_all", verbose=0)
    with_autovm = train([callback])
    without = train([])
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(with_autovm, without)]
    return {"max_abs_weight_diff": max(diffs),
            "identical": all(d == 0.0 for d in diffs),
            "counts": callback.report.plan.counts(),
            "stats": callback.report.stats}




def child(args):
    try:
        budget = float(args.budget) if args.budget else None
        result = run_variant(args.variant, args.batch, args.steps, budget)
        result["status"] = "ok"
    except Exception as error:  # noqa: BLE001 - report every failure kind
        text = f"{type(error).__name__}: {error}"
        oom = "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "OOM" in text
        result = {"status": "oom" if oom else "error", "error": text[-2000:]}
    print("RESULT " + json.dumps(result))


def spawn(variant, args, fraction, budget=None):
    env = dict(os.environ, KERAS_BACKEND="jax")
    if fraction:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(fraction)
    if variant == "equivalence":  # Same convolution algorithms both times.
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true"
    cmd = [sys.executable, __file__, "--child", "--variant", variant,
           "--batch", str(args.batch), "--steps", str(args.steps)]
    if budget:
        cmd += ["--budget", budget]
    start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    result = json.loads(lines[-1][7:]) if lines else {
        "status": "crashed", "returncode": proc.returncode}
    result.update(variant=variant, mem_fraction=fraction, budget=budget,
                  wall_s=time.time() - start, log_tail=(proc.stdout + proc.stderr)[-3000:])
    print(f"{variant}: {result['status']} ({result['wall_s']:.0f} s)", flush=True)
    return result


def versions():
    import jax
    import keras
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.strip()
    except FileNotFoundError:
        smi = "no GPU (nvidia-smi not found)"
    return {"gpu": smi, "jax": jax.__version__,
            "keras": keras.__version__, "python": platform.python_version()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--variant", default=None)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fraction", type=float, default=0.15,
                        help="XLA_PYTHON_CLIENT_MEM_FRACTION for the capped runs")
    parser.add_argument("--budget", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--budgets", default="1.0,0.8,0.65",
                        help="AutoVM budgets (fractions of the capped limit) tried "
                        "in turn until one trains: the planner cannot see XLA's "
                        "scratch buffers, so its first estimate may be short")
    parser.add_argument("--timeout", type=int, default=240)
    parser.add_argument("--variants", default="equivalence,incore_uncapped,"
                        "incore_capped,autovm_capped,remat_capped")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        return child(args)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "batch": args.batch, "steps": args.steps, "fraction": args.fraction,
               "versions": versions(), "runs": {}}
    for variant in args.variants.split(","):
        fraction = None if variant in ("incore_uncapped", "equivalence") else args.fraction
        if variant == "autovm_capped":
            attempts = []
            for budget in args.budgets.split(","):
                attempts.append(spawn(variant, args, fraction, budget))
                if attempts[-1]["status"] != "oom":
                    break
            results["runs"][variant] = dict(attempts[-1], attempts=[
                {k: a.get(k) for k in ("budget", "status", "error", "wall_s")}
                for a in attempts])
        else:
            results["runs"][variant] = spawn(variant, args, fraction)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    table(results)


def table(results):
    runs = results["runs"]
    base = runs.get("incore_uncapped", {}).get("images_per_s")
    print(f"\nVGG-19, batch {results['batch']}, {results['versions']['gpu']}")
    print(f"{'variant':18} {'status':8} {'img/s':>8} {'vs in-core':>10} "
          f"{'peak GiB':>9} {'limit GiB':>9}")
    for name, run in runs.items():
        ips = run.get("images_per_s")
        ratio = f"{ips / base:.2f}" if ips and base else "-"
        peak = run.get("peak_bytes")
        limit = run.get("bytes_limit")
        print(f"{name:18} {run['status']:8} {ips or 0:8.1f} {ratio:>10} "
              f"{(peak or 0) / 2**30:9.2f} {(limit or 0) / 2**30:9.2f}")
    eq = runs.get("equivalence", {})
    if eq.get("status") == "ok":
        print(f"equivalence: identical={eq['identical']} "
              f"max |dw|={eq['max_abs_weight_diff']:.3g} counts={eq['counts']}")


if __name__ == "__main__":
    main()
