"""GPU evidence for swap: predicted against measured, the largest batch under
a cap, and throughput, on one Keras backend.

    python3 recipes/gpu_swap.py --backend torch --out results/gpu_swap_torch.json

Parts (`--parts`), each for VGG-19 and ResNet-152 at 224x224 (`--models`;
DenseNet121 too, for `batches`):

- equivalence: a small CNN whose activations are over 1 MiB, trained with
  `AutoVM(policy="offload_all")` and without, deterministic kernels: are
  the weights identical?
- predict: keep_all, offload_all and greedy_offload (budget: a limit
  halfway between the two others' predicted peaks) at two batch sizes, no
  cap, each run in its own process:
  the plan's predicted peak and step time (after AutoVM's calibration)
  against the measured ones.
- largest: under a memory cap (`--cap-gib`), the largest batch that trains
  for in-core, `keras.RematScope(mode="full")`, AutoVM restricted to keep
  and recompute, and AutoVM with swap. AutoVM's own planner predicts its
  largest batch, which is then run (and stepped down 10% at a time while it
  runs out of memory, up while it trains); so is in-core's, from the
  keep-all plan; RematScope is searched by bisection above in-core's, and
  so is `incore_noxla` (TensorFlow, not in the default methods: Keras's
  own step compiled with `jit_compile=False`, as AutoVM runs plans it
  predicts not to fit under XLA), and `incore_views` (torch, not in the
  default methods): Keras's own
  step with its convolutions and max pooling on views of their inputs, as
  AutoVM runs them, without AutoVM.
  With `SWAP_IN_AUTO=1` in the environment, `autovm_swap`'s `auto` may
  swap on a backend whose `auto` does not swap (JAX; TensorFlow's before
  its `auto` swapped), to measure what it would do.
- throughput: each method at the largest batch all of them train, under the
  cap, against in-core without a cap, as ratios.
- batches: each method at each of `--batches` under the cap, no search (to
  run again the tries of a search that failed, in the time one device call
  has).

Each model and part runs in its own process (the cap is per process); every
result waits for the device (the loss is read back each step). Writes one
JSON file with device, versions, date, command and all measurements, and
prints tables last.
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import warnings

START = time.perf_counter()  # MARK lines say when, to find where a slow run spends its time.

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
GiB = 2**30
METHODS = ("incore", "remat", "autovm_recompute", "autovm_swap")
SWAP_IN_AUTO = os.environ.get("SWAP_IN_AUTO") == "1"  # See auto_choosing.
AUTOVM_KWARGS = {}  # The CPU smoke test passes apply_without_gpu=True.
HEADROOM = [None]  # `--headroom`: AutoVM's, for every AutoVM run (None: its default).
STEP_PEAKS = [False]  # `--step-peaks`: each step's own peak in the marks.


# ------------------------------------------------------------ in the child


def setup(backend, cap_gib):
    """Caps the backend's allocator (before anything touches the GPU)."""
    if backend == "jax" and cap_gib:
        total = _total_gib()
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{cap_gib / total:.4f}"
    import keras  # noqa: F401 -- the backend is fixed from here on
    if backend == "tensorflow" and cap_gib:
        import tensorflow as tf
        gpu = tf.config.list_physical_devices("GPU")[0]
        tf.config.set_logical_device_configuration(
            gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=int(cap_gib * 1024))])
    if backend == "torch":
        set_torch_cap(cap_gib)


def set_torch_cap(cap_gib):
    import torch
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GiB / total) if cap_gib else 1.0)


def _total_gib():
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True)
    return float(out.stdout.split()[0]) / 1024


def build(name, remat=False, jit_compile="auto"):
    import keras
    keras.utils.set_random_seed(0)
    make = {"vgg19": keras.applications.VGG19,
            "resnet152": keras.applications.ResNet152,
            "densenet121": keras.applications.DenseNet121}[name]
    if remat:
        with keras.RematScope(mode="full"):
            model = make(weights=None)
    else:
        model = make(weights=None)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  jit_compile=jit_compile)
    return model


@contextlib.contextmanager
def auto_choosing(method):
    """Makes AutoVM's `auto` choose among keep and recompute only for
    `autovm_recompute`, and among every action the mechanism can carry out
    for `autovm_swap` when SWAP_IN_AUTO is set (a backend whose `auto` does
    not swap yet, to measure what it would do)."""
    import keras_autovm
    get = keras_autovm.mechanisms.get

    def restricted():
        mechanism = get()
        if method == "autovm_recompute":
            actions = tuple(a for a in mechanism.auto_actions() if a != "swap")
        else:
            actions = tuple(mechanism.actions())
        mechanism.auto_actions = lambda: actions
        return mechanism

    if method == "autovm_recompute" or (method == "autovm_swap" and SWAP_IN_AUTO):
        keras_autovm.mechanisms.get = restricted
    try:
        yield
    finally:
        keras_autovm.mechanisms.get = get


def train(model_name, method, batch, steps, epochs=2, policy="auto", budget=None):
    """Trains `steps` steps per epoch; returns measurements or the failure."""
    import keras
    import numpy as np

    backend = keras.backend.backend()
    reset_peak(backend)
    out = {"method": method, "batch": batch, "policy": policy}
    try:
        model = build(model_name, remat=method == "remat",
                      jit_compile=False if method == "incore_noxla" else "auto")
        callbacks = [timer(backend)]
        if method.startswith("autovm"):
            import keras_autovm
            callbacks.insert(0, keras_autovm.AutoVM(budget=budget, policy=policy,
                                                    headroom=HEADROOM[0], verbose=0,
                                                    **AUTOVM_KWARGS))
        rng = np.random.default_rng(0)
        x = rng.normal(size=(batch * steps, 224, 224, 3)).astype("float32")
        y = rng.integers(0, 1000, batch * steps)
        said = []
        with auto_choosing(method), inputs_on_views(method), warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, *_, **__: heard(said, message)
            try:
                model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False,
                          callbacks=callbacks, verbose=0)
            finally:  # What AutoVM said (replans after running out of memory).
                out["warnings"] = [str(w)[:1200] for w in said if "AutoVM" in str(w)][-8:]
        times = callbacks[-1].times[1:] or callbacks[-1].times
        out.update(status="ok", step_s=float(np.median(times)),
                   images_per_s=batch / float(np.median(times)),
                   steady_peak_bytes=callbacks[-1].peak,
                   peak_marks=callbacks[-1].marks)
        if method.startswith("autovm"):
            out.update(plan_facts(callbacks[0]))
    except Exception as error:  # noqa: BLE001 -- every failure is a result
        text = f"{type(error).__name__}: {error}"
        oom = any(k in text for k in ("out of memory", "OutOfMemory", "RESOURCE_EXHAUSTED", "OOM"))
        out.update(status="oom" if oom else "error", error=text[-1500:])
    out["peak_bytes"] = peak(backend)
    if backend == "torch" and _gpu():  # The cap limits reserved memory.
        import torch
        out["reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
    free(backend)
    return out


def heard(said, message):
    """Keeps a warning, and prints AutoVM's as they come (a run that times
    out still shows how far it got)."""
    said.append(message)
    if "AutoVM" in str(message):
        print(f"AutoVM said: {str(message)[:600]}", file=sys.stderr, flush=True)


def inputs_on_views(method):
    """Keras's torch convolutions and max pooling on views for
    `incore_views` (AutoVM turns them on for its own fits)."""
    if method != "incore_views":
        return contextlib.nullcontext()
    from keras_autovm import internals
    return internals.torch_inputs_on_views()


def plan_facts(callback):
    plan, epochs = callback.plan, callback.report.epochs
    return {"counts": plan.counts(), "chosen": plan.policy,
            "predicted_peak_bytes": plan.result.peak_bytes,
            # The step time the last epoch's plan predicted (calibrated by
            # the epochs before it).
            "predicted_step_s": epochs[-1]["predicted_step_time"],
            "stats": callback.report.stats,
            # What each tensor's action, prefetch point and predicted stall
            # were, and the layer times planned with: to find where a
            # measured step departs from the plan.
            "plan": plan.to_dict(),
            "op_times": [(op.name, op.fwd_time, op.bwd_time) for op in plan.graph.ops]}


def timer(backend):
    import keras

    class StepTimer(keras.callbacks.Callback):
        """Step times of the last epoch, and its peak memory (the first
        epoch also holds the first step's one-off allocations)."""

        peak = None

        def on_epoch_begin(self, epoch, logs=None):
            print(f"MARK epoch{epoch} at {time.perf_counter() - START:.1f} s", flush=True)
            self.times = []
            # The running peak at each step's ends: where it rises is where
            # the peak was (in a step, or between steps).
            self.marks = []
            if epoch:
                reset_peak(backend)

        def on_epoch_end(self, epoch, logs=None):
            print(f"MARK epoch{epoch} ends at {time.perf_counter() - START:.1f} s", flush=True)
            self.peak = peak(backend)
            self.marks.append(("epoch_end", self.peak))

        def on_train_batch_begin(self, batch, logs=None):
            self.marks.append((f"begin{batch}", peak(backend)))
            if STEP_PEAKS[0]:  # The step before it has waited for the device.
                reset_peak(backend)
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # Waits for the device.
            self.times.append(time.perf_counter() - self.start)
            self.marks.append((f"end{batch}", peak(backend)))
            # As it goes: a run that fails later still shows how far it got.
            print(f"MARK end{batch} peak {self.marks[-1][1]} {in_use(backend)} "
                  f"step {self.times[-1]:.2f} s at {time.perf_counter() - START:.1f} s",
                  flush=True)

    return StepTimer()


def in_use(backend):
    """torch's allocated and reserved bytes now (None elsewhere)."""
    if backend != "torch" or not _gpu():
        return None
    import torch
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def reset_peak(backend):
    if not _gpu():
        return
    if backend == "torch":
        import torch
        torch.cuda.reset_peak_memory_stats()
    elif backend == "tensorflow":
        import tensorflow as tf
        tf.config.experimental.reset_memory_stats("GPU:0")


def peak(backend):
    if not _gpu():
        return None
    if backend == "torch":
        import torch
        return torch.cuda.max_memory_allocated()
    if backend == "tensorflow":
        import tensorflow as tf
        return tf.config.experimental.get_memory_info("GPU:0")["peak"]
    import jax
    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def _gpu():
    import keras_autovm
    return keras_autovm.mechanisms.get().gpu_available()


def free(backend):
    import gc
    import keras
    keras.backend.clear_session()
    gc.collect()
    if backend == "torch" and _gpu():
        import torch
        torch.cuda.empty_cache()


def predicted_largest(model_name, method, cap_bytes, hi=2048):
    """The largest batch AutoVM's planner says fits the cap."""
    import keras_autovm
    model = build(model_name)
    with auto_choosing(method):
        mechanism = keras_autovm.mechanisms.get()
    policy = "keep_all" if method == "incore" else "auto"

    def fits(batch):
        try:
            graph = keras_autovm.budget.graph_for(model, batch, mechanism)
            keras_autovm.budget.plan_within(
                graph, cap_bytes, keras_autovm.budget.headroom_for(HEADROOM[0], mechanism),
                policy,
                keras_autovm.calibration.measured_cost(mechanism), mechanism)
            return True
        except keras_autovm.PlanError:
            return False

    lo, top = 0, hi
    while lo < top:
        mid = (lo + top + 1) // 2
        lo, top = (mid, top) if fits(mid) else (lo, mid - 1)
    return lo


def part_equivalence(args):
    import keras
    import numpy as np
    import keras_autovm

    def run(callbacks):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((64, 64, 3))
        x = inputs
        for f in (64, 64, 64):
            x = keras.layers.Conv2D(f, 3, padding="same", activation="relu")(x)
            x = keras.layers.BatchNormalization()(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        model = keras.Model(inputs, keras.layers.Dense(10)(x))
        model.compile(keras.optimizers.SGD(0.05), "mse")
        rng = np.random.default_rng(0)
        data = rng.normal(size=(256, 64, 64, 3)).astype("float32")
        target = rng.normal(size=(256, 10)).astype("float32")
        model.fit(data, target, batch_size=64, epochs=2, shuffle=False,
                  callbacks=callbacks, verbose=0)
        return model.get_weights()

    deterministic(args.backend)
    callback = keras_autovm.AutoVM(budget=None, policy="offload_all", verbose=0)
    swapped, plain, again = run([callback]), run([]), run([])
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(swapped, plain)]
    noise = [float(np.max(np.abs(a - b))) for a, b in zip(again, plain)]
    return {"identical": all(d == 0 for d in diffs), "max_abs_weight_diff": max(diffs),
            "run_to_run_max_abs_diff": max(noise),
            "counts": callback.plan.counts(), "stats": callback.report.stats}


def deterministic(backend):
    """Deterministic kernels, so that any difference is AutoVM's."""
    if backend == "torch":
        import torch
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True)
    elif backend == "tensorflow":
        import tensorflow as tf
        tf.config.experimental.enable_op_determinism()


def predict(args, model):
    """keep_all, offload_all and greedy_offload at each batch, no cap, each
    in its own process: run one after another in one process, VGG-19's
    later runs measured 1.6 to 2.3 GiB above the same plans traced in a
    process of their own (what an earlier run leaves behind counts)."""
    runs = []
    for batch in [int(b) for b in args.predict_batches[model].split(",")]:
        keep = one(args, model, "autovm_keep", batch, args.steps, 2, capped=False,
                   policy="keep_all")
        runs.append(keep)
        offload = one(args, model, "autovm_offload", batch, args.steps, 2,
                      capped=False, policy="offload_all")
        runs.append(offload)
        budget = greedy_budget(keep, offload)
        runs.append(one(args, model, "autovm_greedy", batch, args.steps, 2,
                        capped=False, policy="greedy_offload", budget=budget))
    return runs


def greedy_budget(keep, offload):
    """A budget whose plan limit lies halfway between the offload-all and
    keep-all predictions, so the greedy policy swaps some, not all."""
    import keras_autovm
    peaks = [r.get("predicted_peak_bytes") for r in (keep, offload)]
    if not all(peaks):
        return None
    return int(sum(peaks) / 2 / (1 - keras_autovm.mechanisms.get().default_headroom))


def part_one(args):
    """One training run (its own process: nothing of an earlier run stays)."""
    return train(args.model, args.method, args.batch, args.steps, epochs=args.epochs,
                 policy=args.policy, budget=args.budget_bytes or None)


def part_plan(args):
    """The largest batch AutoVM's planner predicts for each method."""
    return {m: predicted_largest(args.model, m, args.cap_gib * GiB)
            for m in args.methods.split(",") if m.startswith("autovm") or m == "incore"}


def largest(args, model, found=None, save=lambda: None):
    """The largest batch each method trains under the cap, one process a
    try, into `found` (method -> result); `save()` after each try, so a
    run cut off keeps the tries it finished."""
    predicted = spawn(args, "plan", model).get("result", {})
    found = {} if found is None else found
    for method in args.methods.split(","):
        tries = []
        found[method] = {"largest": None, "tries": tries}  # Saved as it goes.
        if method in predicted:
            found[method] = dict(step_from(args, model, method, predicted[method], tries,
                                           save), predicted=predicted[method])
        else:  # RematScope: bisect above what in-core trains.
            low = (found.get("incore") or {}).get("largest") or 8
            high = low * 4
            while high - low > max(2, low // 16):
                mid = (low + high) // 2
                tries.append(one(args, model, method, mid))
                save()
                low, high = (mid, high) if tries[-1].get("status") == "ok" else (low, mid)
            found[method] = {"largest": low, "tries": tries}
        print(f"[largest] {model} {method}: {found[method]['largest']}", flush=True)
        save()
    return found


def step_from(args, model, method, batch, tries, save=lambda: None):
    """From a predicted batch: down 10% at a time while it runs out of
    memory; up 10% at a time while it trains (at most 3 steps up)."""
    tries.append(one(args, model, method, batch))
    save()
    ok = tries[-1].get("status") == "ok"
    best = batch if ok else None
    for _ in range(3 if ok else 8):
        batch = int(batch * 1.1) + 1 if ok else int(batch * 0.9)
        if batch < 1:
            break
        tries.append(one(args, model, method, batch))
        save()
        if (tries[-1].get("status") == "ok") != ok:
            break
        best = batch if ok else best
    if not ok and tries[-1].get("status") == "ok":
        best = batch
    return {"largest": best, "tries": tries}


def one(args, model, method, batch, steps=3, epochs=1, capped=True, policy="auto",
        budget=None):
    extra = ["--method", method, "--batch", str(batch), "--epochs", str(epochs),
             "--steps", str(steps), "--policy", policy, "--budget-bytes", str(budget or 0)]
    if not capped:
        extra.append("--uncapped")
    result = spawn(args, "one", model, extra, quiet=True)
    run = result.get("result") or {"status": result.get("status"), "batch": batch}
    run["wall_s"] = result.get("wall_s")
    if run.get("status") in ("crashed", "timeout"):
        run["log_tail"] = result.get("log_tail")
    print(f"  {method} b{batch}: {run.get('status')}", flush=True)
    return run


def throughput(args, model, batch):
    """Each method at `batch` under the cap, and in-core without it."""
    runs = {"incore_uncapped": one(args, model, "incore", batch, args.steps, 2, capped=False)}
    for method in args.methods.split(","):
        runs[method] = one(args, model, method, batch, args.steps, 2)
    return runs


def child(args):
    capped = args.part in ("one", "plan") and not args.uncapped
    setup(args.backend, args.cap_gib if capped else None)
    result = {"part": args.part, "model": args.model}
    try:
        result["result"] = globals()[f"part_{args.part}"](args)
        result["status"] = "ok"
    except Exception:  # noqa: BLE001 -- the failure is the result
        import traceback
        result.update(status="error", error=traceback.format_exc()[-3000:])
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------ the parent


def spawn(args, part, model, extra=(), quiet=False):
    env = dict(os.environ, KERAS_BACKEND=args.backend, PYTHONUNBUFFERED="1",
               CUBLAS_WORKSPACE_CONFIG=":4096:8")
    if args.backend == "jax" and part == "equivalence":
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true"
    cmd = [sys.executable, __file__, "--child", "--backend", args.backend,
           "--part", part, "--model", model, "--cap-gib", str(args.cap_gib),
           "--methods", args.methods] + list(extra)
    if args.headroom is not None:
        cmd += ["--headroom", str(args.headroom)]
    if args.step_peaks:
        cmd.append("--step-peaks")
    if "--steps" not in extra:
        cmd += ["--steps", str(args.steps)]
    start = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        text = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as error:
        text = "".join(out.decode(errors="replace") if isinstance(out, bytes) else out
                       for out in (error.stdout or "", error.stderr or ""))
        save_log(args, part, model, extra, text)  # How far it got, with times.
        return {"part": part, "model": model, "status": "timeout",
                "wall_s": time.time() - start, "log_tail": text[-2000:]}
    save_log(args, part, model, extra, text)
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    result = json.loads(lines[-1][7:]) if lines else {"status": "crashed", "part": part}
    result.update(wall_s=time.time() - start, log_tail=text[-2000:])
    if not quiet:
        print(f"{part} {model}: {result['status']} ({result['wall_s']:.0f} s)", flush=True)
    return result


def save_log(args, part, model, extra, text):
    """The child's whole output under `--logs` (an out-of-memory report
    lists what was live; the JSON keeps only the tail)."""
    if not args.logs:
        return
    os.makedirs(args.logs, exist_ok=True)
    name = "_".join([part, model] + [str(x).lstrip("-") for x in extra[:4]])
    with open(os.path.join(args.logs, name + ".log"), "w") as f:
        f.write(text)


def environment():
    """The variables set on the command line that change what runs."""
    return {k: os.environ[k] for k in (
        "SWAP_IN_AUTO", "TF_CUDNN_WORKSPACE_LIMIT_IN_MB", "TF_GPU_ALLOCATOR",
        "TF_CUDNN_USE_AUTOTUNE", "TF_XLA_FLAGS", "XLA_FLAGS", "KERAS_AUTOVM_CACHE_DIR")
        if k in os.environ}


def versions(backend):
    import keras
    out = {"keras": keras.__version__, "python": platform.python_version()}
    module = {"torch": "torch", "jax": "jax", "tensorflow": "tensorflow"}[backend]
    out[module] = __import__(module).__version__
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True)
    out["gpu"] = smi.stdout.strip()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch", choices=("torch", "tensorflow", "jax"))
    parser.add_argument("--models", default="vgg19,resnet152")
    parser.add_argument("--parts", default="equivalence,predict,largest,throughput")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--cap-gib", type=float, default=8.0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--shared-batch", type=int, default=None,
                        help="the batch for the throughput part (default: the "
                        "smallest largest batch found)")
    parser.add_argument("--batches", default="32,64",
                        help="the batches of the `batches` part")
    parser.add_argument("--headroom", type=float, default=None,
                        help="AutoVM's headroom for every AutoVM run (default: its own)")
    parser.add_argument("--step-peaks", action="store_true",
                        help="reset the allocator's peak before each step, so each "
                        "`end` mark is that step's own peak (AutoVM's measured "
                        "steps reset it too)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--logs", default=None,
                        help="a folder for each run's whole output")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--method", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--uncapped", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--policy", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--budget-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.predict_batches = {"vgg19": "32,64", "resnet152": "32,64"}
    HEADROOM[0] = args.headroom
    STEP_PEAKS[0] = args.step_peaks
    if args.child:
        return child(args)
    os.environ["KERAS_BACKEND"] = args.backend
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "command": " ".join(["python3"] + sys.argv), "cap_gib": args.cap_gib,
               "environment": environment(),
               "versions": versions(args.backend), "parts": {}}

    def save():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            # Whole or not at all: a run cut off by the device's time limit
            # leaves the last complete file.
            with open(args.out + ".part", "w") as f:
                json.dump(results, f, indent=1)
            os.replace(args.out + ".part", args.out)

    parts = args.parts.split(",")
    if "equivalence" in parts:
        results["parts"]["equivalence"] = spawn(args, "equivalence", "small")
        save()
    for model in args.models.split(","):
        got = results["parts"].setdefault(model, {})
        if "predict" in parts:
            got["predict"] = {"result": predict(args, model)}
            save()
        if "largest" in parts:
            got["largest"] = {"result": {}}
            largest(args, model, got["largest"]["result"], save)
            save()
        if "batches" in parts:
            got["batches"] = {"result": {
                method: [one(args, model, method, int(b), epochs=2)
                         for b in args.batches.split(",")]
                for method in args.methods.split(",")}}
            save()
        if "throughput" in parts:
            found = got.get("largest", {}).get("result", {})
            shared = args.shared_batch or min(
                [v["largest"] for v in found.values() if v.get("largest")] or [32])
            got["throughput"] = {"result": throughput(args, model, shared)}
            save()
    save()
    tables(results)


def tables(results):
    print(f"\n{results['versions']}, cap {results['cap_gib']} GiB")
    eq = results["parts"].get("equivalence", {}).get("result")
    if eq:
        print(f"equivalence: identical={eq['identical']} max|dw|={eq['max_abs_weight_diff']:.3g} "
              f"counts={eq['counts']}")
    for model, parts in results["parts"].items():
        if model == "equivalence":
            continue
        for run in parts.get("predict", {}).get("result", []) or []:
            if run.get("status") != "ok":
                print(f"{model} b{run['batch']} {run['policy']}: {run['status']}")
                continue
            print(f"{model} b{run['batch']} {run['policy']:15} peak {run['steady_peak_bytes'] / GiB:6.2f} "
                  f"measured (first epoch {run['peak_bytes'] / GiB:6.2f}) / "
                  f"{run['predicted_peak_bytes'] / GiB:6.2f} predicted "
                  f"({run['steady_peak_bytes'] / run['predicted_peak_bytes']:.3f}); step "
                  f"{run['step_s'] * 1e3:7.1f} / {run['predicted_step_s'] * 1e3:7.1f} ms "
                  f"({run['step_s'] / run['predicted_step_s']:.3f})")
        largest = parts.get("largest", {}).get("result", {})
        base = (largest.get("incore") or {}).get("largest")
        for method, found in largest.items():
            ratio = f"{found['largest'] / base:.2f}x" if base and found.get("largest") else "-"
            print(f"{model} largest batch {method:17} {found.get('largest')} "
                  f"(predicted {found.get('predicted', '-')}) {ratio} in-core")
        for method, runs in parts.get("batches", {}).get("result", {}).items():
            for run in runs:
                print(f"{model} b{run.get('batch')} {method:17} {run.get('status')} "
                      f"peak {(run.get('peak_bytes') or 0) / GiB:.2f} GiB "
                      f"{(run.get('images_per_s') or 0):7.1f} img/s")
        runs = parts.get("throughput", {}).get("result", {})
        ref = (runs.get("incore_uncapped") or {}).get("images_per_s")
        for method, run in runs.items():
            ips = run.get("images_per_s")
            print(f"{model} b{run.get('batch')} {method:17} {run.get('status')} "
                  f"{(ips or 0):7.1f} img/s " + (f"{ips / ref:.2f}x" if ips and ref else ""))


if __name__ == "__main__":
    main()
