"""How long AutoVM's profiling pass takes: this checkout's keras_autovm
against a reference copy of it, side by side on one device.

    git worktree add /tmp/ref 22184ad && mkdir -p .ref \\
        && cp -r /tmp/ref/keras_autovm .ref/ && echo 22184ad > .ref/COMMIT
    echo /.ref/ >> .git/info/exclude     # never committed; `carry` it to a GPU
    python recipes/profile_speed.py --backend jax --reference .ref \\
        --models resnet152 --batch-size 64 --out results/profiling/profile_speed_jax.json

For each model (`--models`: resnet152, densenet121, resnet50, small_cnn;
224x224 but small_cnn's 64x64, random weights), the reference and then
this code each time the model in a fresh Python process
(`keras_autovm.profiling.measure`, the link included), so neither reuses
the other's compiled programs. `--only-new` skips the reference for the
models it names. Writes one JSON:

    {"device", "backend", "versions", "date", "command", "commits":
     {"new", "reference"}, "runs": [{"model", "code", "batch_size",
     "profile_s", "layer_calls", "distinct_calls", "sum_fwd_s",
     "sum_bwd_s"}], "ratios": {model: reference profile_s / new}}

`--smoke` runs small_cnn at batch 8 (a CPU check, in seconds).
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="jax", choices=("torch", "jax", "tensorflow"))
    parser.add_argument("--reference", help="a folder holding the reference keras_autovm/")
    parser.add_argument("--models", default="resnet152")
    parser.add_argument("--only-new", default="", help="models timed with this code only")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per process")
    parser.add_argument("--out", default=os.path.join("results", "profiling", "profile_speed.json"))
    parser.add_argument("--commit", help="this code's commit, as recorded (a copy of the "
                        "tree on another machine may not say it)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args()


def child(args):
    """Times one profile with the keras_autovm under `args.child`; prints
    its record as the last line."""
    sys.path.insert(0, os.path.abspath(args.child))
    os.environ["KERAS_BACKEND"] = args.backend
    import keras

    import keras_autovm
    from keras_autovm import mechanisms
    from keras_autovm import profiling
    from keras_autovm.profile_cache import call_key
    from keras_autovm.model_graph import layer_calls

    assert keras_autovm.__file__.startswith(os.path.abspath(args.child)), keras_autovm.__file__
    sys.path.insert(0, HERE)
    from gpu_profile import make_model
    keras.utils.set_random_seed(0)
    model = make_model(args.models, keras)
    start = time.perf_counter()
    profile = profiling.measure(model, args.batch_size, mechanisms.get())
    seconds = time.perf_counter() - start
    print(json.dumps({
        "model": args.models, "batch_size": args.batch_size, "profile_s": seconds,
        "layer_calls": len(profile.layers),
        "distinct_calls": len({call_key(layer, node) for layer, node in layer_calls(model)}),
        "sum_fwd_s": sum(t.fwd_s for t in profile.layers),
        "sum_bwd_s": sum(t.bwd_s for t in profile.layers),
        "device": profile.device, "keras": keras.__version__,
        "backend_version": __import__(args.backend).__version__}))


def one(args, model, code, label):
    command = [sys.executable, os.path.abspath(__file__), "--child", code,
               "--backend", args.backend, "--models", model,
               "--batch-size", str(args.batch_size)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        sys.exit(f"{label} {model}: no profile within --timeout {args.timeout:g} s")
    if done.returncode != 0:
        sys.exit(f"{label} {model} failed:\n{done.stderr[-3000:]}")
    record = json.loads(done.stdout.strip().splitlines()[-1])
    record["code"] = label
    print(f"{model} ({label}): profiling {record['profile_s']:.1f} s, "
          f"{record['distinct_calls']} distinct calls of {record['layer_calls']}", flush=True)
    return record


def _commit(folder):
    path = os.path.join(folder, "COMMIT")
    if os.path.exists(path):
        return open(path).read().strip()
    return subprocess.run(["git", "-C", folder, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or None


def main():
    args = parse_args()
    if args.child:
        return child(args)
    if args.smoke:
        args.models, args.batch_size = "small_cnn", 8
    models = [m.strip() for m in args.models.split(",")]
    only_new = {m.strip() for m in args.only_new.split(",") if m.strip()}
    runs = []
    for model in models:  # Written after each run: a cut-off call keeps what ran.
        if args.reference and model not in only_new:
            runs.append(one(args, model, args.reference, "reference"))
            write(args, runs)
        runs.append(one(args, model, ROOT, "new"))
        write(args, runs)


def write(args, runs):
    models = list(dict.fromkeys(r["model"] for r in runs))
    by = {(r["model"], r["code"]): r["profile_s"] for r in runs}
    ratios = {m: by[(m, "reference")] / by[(m, "new")] for m in models
              if (m, "reference") in by and (m, "new") in by}
    result = {
        "device": runs[-1]["device"], "backend": args.backend,
        "versions": {"keras": runs[-1]["keras"], args.backend: runs[-1]["backend_version"]},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python3", "recipes/profile_speed.py"] + sys.argv[1:]),
        "commits": {"new": args.commit or _commit(ROOT),
                    "reference": _commit(args.reference) if args.reference else None},
        "runs": runs, "ratios": ratios}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for model, ratio in ratios.items():
        print(f"{model}: the reference took {ratio:.2f}x this code's time")
    print(f"-> {args.out}", flush=True)


if __name__ == "__main__":
    main()
