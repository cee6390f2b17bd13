"""AutoVM's cost with no memory pressure: in-core and AutoVM steps, interleaved.

    python3 recipes/gpu_overhead.py --backend torch --models resnet152,vgg19 \\
        --batch 64 --out $OUT/overhead_torch.json

One process per model builds two copies of it (same seed): one trained as
Keras trains it, one under `AutoVM()` with no budget (the whole device).
They take turns, `--rounds` times, each turn one `fit` of `--steps` steps;
the first turn of each (planning, compiling) and the first step of every
`fit` are not counted. With `--epochs E`, each `fit` runs E epochs and its
last is timed: AutoVM calibrates its times after each epoch and replans,
so its later epochs run the plan a long training would. Each step is timed to the device's end (the loss is
read back, which Keras does after every step anyway). A step-time spread
that moves with the machine (other processes on the host) hits both copies
alike, so the ratio of their median steps is the figure to read, with the
ratio of each round's medians beside it.

With `--factor F` (torch), AutoVM's budget is the in-core step's need over F
instead: the need is the in-core copy's peak in the first turn less the
other copy's weights (on the device, built; its optimizer state is not made
yet). The budget binds AutoVM's plan, not the allocator (no cap: the
in-core copy needs the memory), so the peak AutoVM's copy reached is
written beside it, less the in-core copy's variables.
"""

import argparse
import datetime
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import measure  # noqa: E402 -- recipes/, on the path above


def child(args):
    import gpu_swap
    import keras
    import numpy as np

    import keras_autovm

    models = {"incore": gpu_swap.build(args.model), "autovm": gpu_swap.build(args.model)}
    # No budget: the whole device. Without a GPU (a check of this script),
    # AutoVM is applied anyway, under a budget of 64 GiB.
    gpu = keras_autovm.mechanisms.get().gpu_available()
    budget = None if gpu else 64 * 2**30
    callback = None
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * args.steps, 224, 224, 3)).astype("float32")
    y = rng.integers(0, 1000, args.batch * args.steps)
    times = {name: [] for name in models}
    peaks = {name: [] for name in models}
    before = {name: [] for name in models}  # Allocated as each fit starts.
    for turn in range(args.rounds):
        for name, model in models.items():
            timer = measure.step_timer(keras)
            if name == "autovm" and callback is None:
                if args.factor and gpu:
                    need = gpu_swap.peak(args.backend) - variable_bytes(models["autovm"])
                    budget = int(need / args.factor)
                callback = keras_autovm.AutoVM(budget=budget, verbose=0,
                                               apply_without_gpu=True)
            extra = [callback] if name == "autovm" else []
            gpu_swap.reset_peak(args.backend)
            allocated = (gpu_swap.in_use(args.backend) or (None,))[0]
            model.fit(x, y, batch_size=args.batch, epochs=args.epochs, shuffle=False,
                      verbose=0, callbacks=extra + [timer])
            if turn:
                times[name].append(timer.times[1:])
                peaks[name].append(gpu_swap.peak(args.backend))
                before[name].append(allocated)
    out = {"model": args.model, "batch": args.batch, "steps_ms": {
        name: [[t * 1e3 for t in turn] for turn in runs] for name, runs in times.items()},
        # JAX's peak is the process's running peak (no reset).
        "peak_bytes": peaks, "allocated_before_bytes": before,
        "factor": args.factor, "budget_bytes": budget,
        "incore_variable_bytes": variable_bytes(models["incore"])}
    out.update(ratios(times))
    out.update(gpu_swap.plan_facts(callback))
    measure.report(out)


def variable_bytes(model):
    """The bytes of a model's variables and of its optimizer's, if built."""
    variables = list(model.variables)
    if model.optimizer is not None and model.optimizer.built:
        variables += list(model.optimizer.variables)
    return sum(int(v.numpy().nbytes) for v in variables)


def ratios(times):
    """In-core over AutoVM step time (AutoVM's throughput as a share of
    in-core's): of the medians over all counted steps, and per round."""
    flat = {name: [t for turn in runs for t in turn] for name, runs in times.items()}
    medians = {name: statistics.median(ts) for name, ts in flat.items()}
    per_round = [statistics.median(a) / statistics.median(b)
                 for a, b in zip(times["incore"], times["autovm"])]
    return {"median_step_ms": {k: v * 1e3 for k, v in medians.items()},
            "throughput_ratio": medians["incore"] / medians["autovm"],
            "throughput_ratio_per_round": per_round}


def peak_line(run):
    """AutoVM's budget, plan and peak: less the in-core copy's variables,
    and less all that was allocated before its fit but the plan's own
    persistent bytes (what the in-core copy still held)."""
    peaks = [p for p in run["peak_bytes"]["autovm"] if p is not None]
    if not run["budget_bytes"] or not peaks:
        return ""
    own = max(peaks) - run["incore_variable_bytes"]
    held = max(b - run["plan"]["persistent_bytes"]
               for b in run["allocated_before_bytes"]["autovm"])
    return (f"; budget {run['budget_bytes'] / 2**30:.2f} GiB, predicted "
            f"{run['predicted_peak_bytes'] / 2**30:.2f}, peak {own / 2**30:.2f} "
            f"({(max(peaks) - held) / 2**30:.2f} less all the in-core copy held)")


def spawn(args, model):
    command = [sys.executable, os.path.abspath(__file__), "--child", "--backend",
               args.backend, "--model", model, "--batch", str(args.batch),
               "--steps", str(args.steps), "--rounds", str(args.rounds),
               "--factor", str(args.factor), "--epochs", str(args.epochs)]
    env = dict(os.environ, KERAS_BACKEND=args.backend)
    return measure.run_child(command, args.timeout, env, model=model)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch", choices=("torch", "jax", "tensorflow"))
    parser.add_argument("--models", default="resnet152,vgg19")
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--factor", type=float, default=0.0,
                        help="AutoVM's budget: the in-core need over this; 0: none")
    parser.add_argument("--epochs", type=int, default=1,
                        help="epochs per fit; the last is timed (AutoVM calibrates "
                             "after each)")
    measure.child_arguments(parser, 240)
    args = parser.parse_args()
    if args.child:
        return child(args)
    os.environ["KERAS_BACKEND"] = args.backend  # For the versions' Keras.
    import gpu_swap
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "command": " ".join(["python3"] + sys.argv),
               "versions": gpu_swap.versions(args.backend),
               "runs": [spawn(args, m) for m in args.models.split(",")]}
    for run in results["runs"]:
        if run["status"] != "ok":
            print(run["model"], run["status"], run.get("log_tail", "")[-1500:], flush=True)
            continue
        print(f"{run['model']}: AutoVM {run['throughput_ratio']:.3f}x in-core "
              f"(rounds {', '.join(f'{r:.3f}' for r in run['throughput_ratio_per_round'])}); "
              f"median steps {run['median_step_ms']}; plan {run.get('chosen')} "
              f"{run['counts']}, unchanged steps {run['stats'].get('unchanged_steps')}"
              + peak_line(run), flush=True)
    measure.save(results, args.out)


if __name__ == "__main__":
    main()
