"""JAX swap by host copies on a GPU: predicted against measured, and exact.

    python3 recipes/gpu_jax_swap.py --out results/gpu_jax_swap.json
    python3 recipes/gpu_jax_swap.py --smoke --out /tmp/smoke.json   # CPU, tiny

VGG-19 (224x224) at two batch sizes (`--batches`, default 64,128). For each
batch: a reference in-core run without a cap, without jit (`reference`)
or with it (`incore`; the first of them run gives the reference weights),
then under an allocator cap (`--cap-gib`, through
XLA_PYTHON_CLIENT_MEM_FRACTION) AutoVM with `keep_all`, `offload_all` and
`greedy_offload` (budget: the cap). Each run is its own process (JAX's peak
cannot be reset: a process's `peak_bytes_in_use` is its run's), with a
timeout; the JSON file is rewritten after every run, so a machine cut off
keeps what was done. Per run: the plan's predicted peak and step time, the
measured peak and median step time (the clock stops after the step's
weights are ready on the device), bytes moved each way per step, and max
|dw| against the reference's weights after the same steps.
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
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)  # gpu_swap: versions and the GPU's memory.
GiB = 2**30
POLICIES = ("keep_all", "offload_all", "greedy_offload")
# Plain Keras, jitted: under the same cap (what a user gets without AutoVM),
# and without a cap (the in-core reference for step times).
PEERS = ("keras_jit", "incore")
UNCAPPED = ("reference", "incore")


# ------------------------------------------------------------ in the child


def build(smoke, jit=False):
    import keras
    keras.utils.set_random_seed(0)
    if smoke:
        model = keras.Sequential([
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10)])
    else:
        model = keras.applications.VGG19(weights=None)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss="sparse_categorical_crossentropy", jit_compile=jit)
    return model


def child(args):
    import jax
    import keras
    import numpy as np

    out = {"batch": args.batch, "policy": args.policy}
    samples = sample_memory() if args.trace_memory else None
    if args.run_ahead != "default":
        from keras_autovm.mechanisms.jax import mechanism
        mechanism.JaxMechanism.run_ahead = None if args.run_ahead == "none" else int(args.run_ahead)
    model = build(args.smoke, jit=args.policy in ("keras_jit", "incore"))
    size, classes = (32, 10) if args.smoke else (224, 1000)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * args.steps, size, size, 3)).astype("float32")
    y = rng.integers(0, classes, args.batch * args.steps)
    callbacks = [timer()]
    if args.policy not in ("reference",) + PEERS:
        import keras_autovm
        budget = int(args.cap_gib * GiB) if args.policy == "greedy_offload" else None
        if args.smoke and budget is None:
            budget = "1GiB"  # No GPU: an absolute budget.
        callbacks.insert(0, keras_autovm.AutoVM(
            budget=budget, policy=args.policy, verbose=0, apply_without_gpu=args.smoke))
    try:
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False,
                  callbacks=callbacks, verbose=0)
    except Exception as error:  # noqa: BLE001 -- every failure is a result
        text = f"{type(error).__name__}: {error}"
        oom = any(k in text for k in ("RESOURCE_EXHAUSTED", "out of memory", "OOM"))
        out.update(status="oom" if oom else "error", error=text[-1500:])
        return out
    times = callbacks[-1].times[1:] or callbacks[-1].times
    stats = (jax.devices()[0].memory_stats() or {})
    out.update(status="ok", step_s=float(np.median(times)), step_times_s=times,
               measured_peak_bytes=stats.get("peak_bytes_in_use"),
               bytes_limit=stats.get("bytes_limit"))
    weights = model.get_weights()
    reference = os.path.join(args.workdir, f"reference_b{args.batch}.npz")
    if args.policy in UNCAPPED and not os.path.exists(reference):
        np.savez(reference, *weights)
    elif os.path.exists(reference):
        saved = np.load(reference)
        out["max_abs_dw"] = max(float(np.max(np.abs(w - saved[f"arr_{i}"])))
                                for i, w in enumerate(weights))
    if len(callbacks) > 1:
        report, plan = callbacks[0].report, callbacks[0].plan
        steps = args.steps
        out.update(counts=plan.counts(), predicted_peak_bytes=plan.result.peak_bytes,
                   predicted_step_s=report.epochs[-1]["predicted_step_time"],
                   bytes_to_host_per_step=report.stats.get("bytes_to_host", 0) / steps,
                   bytes_to_device_per_step=report.stats.get("bytes_to_device", 0) / steps,
                   stats=report.stats)
    if samples is not None:
        # Per step: the most in use after a call, and the process's peak
        # when the step began; the first step's samples in full.
        out["step_peak_bytes_in_use"] = [max(n for n, _ in s) for s in samples[1:]]
        out["peak_at_step_begin"] = [s[0][1] for s in samples[1:]]
        out["first_step_samples"] = samples[1] if len(samples) > 1 else None
    return out


def sample_memory():
    """Device bytes in use after each compiled call of AutoVM's eager step
    is enqueued (PjRt allocates a program's buffers when it is enqueued),
    one list per step; `peak_bytes_in_use` cannot be reset, and the first
    step's includes compiling (autotuning) the programs."""
    import jax
    from keras_autovm.mechanisms.jax import calls, mechanism

    samples = [[(0, 0)]]  # Before the first step (profiling, building).
    init, eager_loss = calls.CompiledCall.__init__, mechanism.JaxMechanism._eager_loss

    def sampled(function):
        def call(*args):
            result = function(*args)
            stats = jax.devices()[0].memory_stats() or {}
            samples[-1].append((stats.get("bytes_in_use", 0), stats.get("peak_bytes_in_use", 0)))
            return result
        return call

    def init_sampled(self, *args):
        init(self, *args)
        self.forward, self.backward = sampled(self.forward), sampled(self.backward)

    def eager_loss_sampled(self, *args):
        stats = jax.devices()[0].memory_stats() or {}
        samples.append([(stats.get("bytes_in_use", 0), stats.get("peak_bytes_in_use", 0))])
        return eager_loss(self, *args)

    calls.CompiledCall.__init__ = init_sampled
    mechanism.JaxMechanism._eager_loss = eager_loss_sampled
    return samples


def timer():
    import jax
    import keras

    class StepTimer(keras.callbacks.Callback):
        """Step times; the clock stops once every array on the device is
        ready (the new weights included: during `fit` Keras keeps them
        outside the variables)."""

        times = []

        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])
            jax.block_until_ready(jax.live_arrays())
            self.times.append(time.perf_counter() - self.start)

    return StepTimer()


# ------------------------------------------------------------ the parent


def spawn(args, batch, policy, capped, steps=None):
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONUNBUFFERED="1")
    if capped and not args.smoke:
        import gpu_swap
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{args.cap_gib / gpu_swap._total_gib():.4f}"
    cmd = [sys.executable, __file__, "--child", "--batch", str(batch), "--policy", policy,
           "--steps", str(steps or args.steps), "--cap-gib", str(args.cap_gib),
           "--workdir", args.workdir] + (["--smoke"] if args.smoke else []) + (
               ["--trace-memory"] if args.trace_memory else []) + [
               "--run-ahead", args.run_ahead]
    start = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        text = proc.stdout + proc.stderr
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        run = json.loads(lines[-1][7:]) if lines else {"status": "crashed"}
    except subprocess.TimeoutExpired as error:
        text = error.stdout.decode() if isinstance(error.stdout, bytes) else str(error.stdout)
        run = {"status": "timeout"}
    run.update(batch=batch, policy=policy, capped=capped, wall_s=time.time() - start,
               log_tail=text[-1500:])
    return run


def versions(smoke):
    os.environ["KERAS_BACKEND"] = "jax"
    if not smoke:
        import gpu_swap
        return gpu_swap.versions("jax")
    import keras
    return {"keras": keras.__version__, "python": platform.python_version()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default=None, help="default 64,128 (smoke: 8,16)")
    parser.add_argument("--cap-gib", type=float, default=12.0)
    parser.add_argument("--policies", default=",".join(("reference",) + POLICIES),
                        help=f"of reference, {', '.join(POLICIES + PEERS)}")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout", type=int, default=75, help="seconds per run")
    parser.add_argument("--smoke", action="store_true", help="tiny CNN on the CPU")
    parser.add_argument("--out", default=None)
    parser.add_argument("--workdir", default="/tmp/gpu_jax_swap")
    parser.add_argument("--trace-memory", action="store_true",
                        help="bytes in use after each compiled call, per step")
    parser.add_argument("--run-ahead", default="default",
                        help="compiled calls AutoVM's eager step may enqueue ahead (none: unbounded)")
    parser.add_argument("--uncapped", action="store_true", help="AutoVM runs without a cap")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    os.makedirs(args.workdir, exist_ok=True)
    batches = [int(b) for b in (args.batches or ("8,16" if args.smoke else "64,128")).split(",")]
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "command": " ".join(["python3"] + sys.argv), "cap_gib": args.cap_gib,
               "versions": versions(args.smoke), "runs": []}
    for batch in batches:
        if not args.smoke:
            # AutoVM measures the layers in its first fit and caches them:
            # a fit of its own here, so that the runs below read the cache
            # and their peaks (JAX cannot reset one) are their training's.
            results["profiling"] = results.get("profiling", []) + [
                spawn(args, batch, "keep_all", capped=False, steps=1)]
        for policy in args.policies.split(","):
            capped = policy not in UNCAPPED and not (args.uncapped and policy in POLICIES)
            run = spawn(args, batch, policy, capped=capped)
            results["runs"].append(run)
            print(line(run), flush=True)
            if args.out:
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)


def line(run):
    if run.get("status") != "ok":
        return f"b{run['batch']} {run['policy']:15} {run.get('status')} ({run['wall_s']:.0f} s)"
    gib = lambda n: f"{n / GiB:6.2f}" if n else "     -"  # noqa: E731
    pred_step = run.get("predicted_step_s")
    return (f"b{run['batch']} {run['policy']:15} peak {gib(run.get('measured_peak_bytes'))} / "
            f"{gib(run.get('predicted_peak_bytes'))} GiB predicted; step "
            f"{run['step_s'] * 1e3:7.1f} / "
            f"{(pred_step or 0) * 1e3:7.1f} ms; to host "
            f"{gib(run.get('bytes_to_host_per_step'))} GiB/step; "
            f"max|dw| {run.get('max_abs_dw', '-')} ({run['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
