"""GPU evidence for the native layer: the TF managed-memory ops and the probe.

Runs on the lent GPU machine, TensorFlow staged (../shared/gpu/README.md):

    source .gpu/env.sh && python3 recipes/gpu_managed_ops.py

It builds both libraries there (the pybind11 module for that Python, the op
library against the staged TensorFlow), checks cuda_driver.h against the
machine's cuda.h, then turns on TensorFlow's unified-memory allocator (a pool
of --pool-fraction of the GPU, refused if over half of the free memory) and:

(a) evicts a TF tensor with AutovmEvict in a tf.function and reads the range
    attribute (last prefetch location = host), prefetches it back with
    AutovmPrefetch (= device:0), and again through the backward trigger
    (prefetch_on_backward in a gradient); checks values survive and counters;
(b) `train_equivalence()`: a small Keras CNN trained twice, with and without
    evict/prefetch layers (written here; the AutoVM callback's managed mode
    can replace them later), compared weight by weight;
(c) step time of a Keras CNN training step without the ops, with the ops and
    no targets (dispatch cost), with evict only (backward faults pages in),
    and with evict + backward prefetch one block ahead (with and without
    making the compute stream wait): ratios to the baseline, interleaved
    rounds after warm-up;
(d) `link_probe`: pinned and managed bandwidth (GB/s).

Writes JSON to --out (default $OUT/gpu_managed_ops.json) with device, driver,
versions, date, command and all numbers, and prints a short table last.
Oversubscription is never attempted: every managed allocation stays well
inside free memory.
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
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MiB = 1 << 20


def _load_build():
    spec = importlib.util.spec_from_file_location(
        "_keras_autovm_build", os.path.join(ROOT, "keras_autovm", "native", "build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nvidia_smi():
    """Device facts without creating a CUDA context (before TF starts)."""
    query = "name,driver_version,memory.total,memory.free,memory.used"
    proc = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError("nvidia-smi failed: " + proc.stderr)
    name, driver, total, free, used = [
        s.strip() for s in proc.stdout.splitlines()[0].split(",")]
    return {"name": name, "driver": driver, "total_bytes": int(total) * MiB,
            "free_bytes": int(free) * MiB, "used_bytes": int(used) * MiB}


def check_cuda_header():
    """Compiles ops/common/check_cuda_h.cc against the machine's cuda.h."""
    include = "/usr/local/cuda/include"
    if not os.path.exists(os.path.join(include, "cuda.h")):
        return {"ok": None, "detail": "no cuda.h at " + include}
    proc = subprocess.run(
        ["g++", "-std=c++17", "-fsyntax-only", "-I" + include,
         os.path.join(ROOT, "ops", "common", "check_cuda_h.cc")],
        capture_output=True, text=True)
    version = subprocess.run(
        ["grep", "-m1", "define CUDA_VERSION", os.path.join(include, "cuda.h")],
        capture_output=True, text=True).stdout.strip()
    return {"ok": proc.returncode == 0, "cuda_h": version,
            "detail": proc.stderr[-2000:]}


# ---------------------------------------------------------------- (a)


def managed_evidence(nat, tf_ops, tf, mib):
    """Evict/prefetch of one TF tensor, read back through range attributes."""
    out = {"nbytes": mib * MiB}
    nbytes = mib * MiB
    with tf.device("/GPU:0"):
        x = tf.random.stateless_normal([nbytes // 4], seed=[1, 2])
        ptr = int(tf_ops.pointer(x))
    expected = (x.numpy() * 2.0)
    out["pointer"] = hex(ptr)
    out["initial"] = nat.pointer_info(ptr, nbytes)
    if not out["initial"]["is_managed"]:
        out["error"] = ("the TF tensor is not managed memory: the unified-"
                        "memory allocator is not in effect")
        return out

    @tf.function
    def evict_fn(x):
        y = x * 2.0  # The reader; the evict is ordered after it.
        return tf_ops.evict(y, [x])

    @tf.function
    def prefetch_fn(x, pre_access):
        return tf_ops.prefetch(tf.zeros([1]), [x], pre_access=pre_access)

    w = tf.Variable(1.5)

    @tf.function
    def backward_fn(x):
        with tf.GradientTape() as tape:
            h = x * w
            h = tf_ops.prefetch_on_backward(h, [x])
            loss = tf.reduce_sum(h)
        return tape.gradient(loss, w)

    with tf.device("/GPU:0"):
        # Trace once (untimed), then measure with fresh counters.
        evict_fn(x)
        prefetch_fn(x, True)
        backward_fn(x)
        nat.synchronize(0)
        tf_ops.reset_stats()

        t0 = time.perf_counter()
        y = evict_fn(x)
        t_call = time.perf_counter() - t0
        nat.synchronize(0)
        t_done = time.perf_counter() - t0
        out["after_evict"] = nat.pointer_info(ptr, nbytes)["last_prefetch_location"]
        out["evict_call_s"], out["evict_done_s"] = t_call, t_done
        out["values_after_evict_equal"] = bool((y.numpy() == expected).all())

        prefetch_fn(x, True)
        nat.synchronize(0)
        out["after_prefetch"] = nat.pointer_info(ptr, nbytes)["last_prefetch_location"]

        evict_fn(x)
        nat.synchronize(0)
        out["before_backward"] = nat.pointer_info(ptr, nbytes)["last_prefetch_location"]
        g = backward_fn(x)
        nat.synchronize(0)
        out["after_backward"] = nat.pointer_info(ptr, nbytes)["last_prefetch_location"]
        out["backward_grad_ok"] = bool(
            abs(float(g) - float(tf.reduce_sum(x))) <= 1e-3 * abs(float(g)) + 1e-3)
        out["stats"] = tf_ops.stats()

        # The native module on the same TF buffer.
        nat.prefetch(ptr, nbytes, to="host")
        out["native_to_host"] = nat.pointer_info(ptr, nbytes)["last_prefetch_location"]
        nat.prefetch(ptr, nbytes, to=0)
        out["native_to_device"] = nat.pointer_info(ptr, nbytes)["last_prefetch_location"]
        out["values_final_equal"] = bool(((x * 2.0).numpy() == expected).all())
    want = {"after_evict": "host", "after_prefetch": "device:0",
            "before_backward": "host", "after_backward": "device:0",
            "native_to_host": "host", "native_to_device": "device:0"}
    stats = out["stats"]
    out["ok"] = (all(out[k] == v for k, v in want.items())
                 and out["values_after_evict_equal"] and out["values_final_equal"]
                 and out["backward_grad_ok"] and stats["errors"] == 0
                 and stats["ops_issued"] == 4
                 and stats["bytes_evicted"] == 2 * nbytes
                 and stats["bytes_prefetched"] == 2 * nbytes)
    return out


# ------------------------------------------------------- model and layers


def make_layers(keras, tf_ops):
    class _OpsLayer(keras.layers.Layer):
        def __init__(self, empty=False, **kwargs):
            super().__init__(**kwargs)
            self.empty = empty  # No targets: the ops' dispatch cost alone.
            self.supports_jit = False  # XLA cannot compile the custom ops.

        def compute_output_shape(self, input_shape):
            return input_shape[0]

    class Evict(_OpsLayer):
        """Passes inputs[0]; evicts inputs[1] (already read to make inputs[0])."""

        def call(self, inputs):
            y, x = inputs
            return tf_ops.evict(y, [] if self.empty else [x])

    class BackwardPrefetch(_OpsLayer):
        """Passes inputs[0]; its gradient prefetches inputs[1] to the GPU."""

        def __init__(self, pre_access=False, **kwargs):
            super().__init__(**kwargs)
            self.pre_access = pre_access

        def call(self, inputs):
            y, x = inputs
            return tf_ops.prefetch_on_backward(
                y, [] if self.empty else [x], pre_access=self.pre_access)

    return Evict, BackwardPrefetch


MODES = ("none", "dispatch", "evict_fault", "evict_prefetch", "evict_prefetch_wait")


def build_cnn(keras, tf_ops, mode, size, channels, blocks, classes=10, seed=0):
    """Conv blocks; in the managed modes each block's input is evicted after
    the block read it, and prefetched when backward reaches the next block.
    The ops layers have no weights, so every mode has the same initial ones."""
    Evict, BackwardPrefetch = make_layers(keras, tf_ops)
    keras.utils.set_random_seed(seed)
    evict = mode != "none"
    prefetch = mode in ("dispatch", "evict_prefetch", "evict_prefetch_wait")
    empty = mode == "dispatch"
    wait = mode == "evict_prefetch_wait"
    inputs = keras.Input((size, size, 3))
    x, prev = inputs, None
    for i in range(blocks):
        y = keras.layers.Conv2D(channels, 3, padding="same", activation="relu",
                                name=f"conv{i}")(x)
        if evict:
            y = Evict(empty=empty)([y, x])
        if prefetch and prev is not None:
            y = BackwardPrefetch(pre_access=wait, empty=empty)([y, prev])
        prev, x = x, y
    y = keras.layers.GlobalAveragePooling2D()(x)
    if prefetch:
        y = BackwardPrefetch(pre_access=wait, empty=empty)([y, prev])
    outputs = keras.layers.Dense(classes)(y)
    model = keras.Model(inputs, outputs, name=f"cnn_{mode}")
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    return model


# ---------------------------------------------------------------- (b)


def train_equivalence(size=16, channels=8, blocks=4, n=64, epochs=2):
    """Same weights with and without evict/prefetch layers, trained on the GPU.

    Hook for the AutoVM callback's managed mode: today the ops are inserted
    by the layers of this file; replace `build_cnn(..., "evict_prefetch")` by
    a plain model plus the callback to check the callback the same way.
    """
    import keras
    import numpy as np
    import tensorflow as tf

    from keras_autovm.mechanisms.tensorflow import ops as tf_ops

    tf.config.experimental.enable_op_determinism()  # Same cuDNN algorithms.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, size, size, 3)).astype("float32")
    y = rng.integers(0, 10, n)
    weights = {}
    tf_ops.reset_stats()
    for mode in ("none", "evict_prefetch"):
        model = build_cnn(keras, tf_ops, mode, size, channels, blocks)
        model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
        weights[mode] = model.get_weights()
    a, b = weights["none"], weights["evict_prefetch"]
    diffs = [float(np.max(np.abs(p - q))) if p.size else 0.0 for p, q in zip(a, b)]
    return {"identical": len(a) == len(b) and all(np.array_equal(p, q) for p, q in zip(a, b)),
            "max_abs_diff": max(diffs) if diffs else None, "n_weights": len(a),
            "stats": tf_ops.stats(), "epochs": epochs, "samples": n}


def autovm_equivalence(size=32, n=256, epochs=2, batch=32, optimizer_passes=True):
    """Same weights with and without the AutoVM callback swapping everything.

    The callback plans `offload_all` for a plain Keras CNN and inserts the
    evict/prefetch ops itself (TensorFlow managed mode); the weights must be
    identical to training without it, and the ops' counters show pages moved.
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_autovm
    from keras_autovm.mechanisms.tensorflow import ops as tf_ops

    tf.config.experimental.enable_op_determinism()
    if not optimizer_passes:
        # Does the difference come from grappler fusing kernels differently
        # around the inserted pass-through ops?
        tf.config.optimizer.set_experimental_options(
            {"remapping": False, "layout_optimizer": False,
             "arithmetic_optimization": False})
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, size, size, 3)).astype("float32")
    y = rng.normal(size=(n, 10)).astype("float32")

    def train(callbacks):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((size, size, 3))
        h = inputs
        for filters in (32, 64, 64):
            h = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
            h = keras.layers.BatchNormalization()(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        model = keras.Model(inputs, keras.layers.Dense(10)(h))
        model.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=False)
        model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False,
                  callbacks=callbacks, verbose=0)
        return model.get_weights()

    tf_ops.reset_stats()
    callback = keras_autovm.AutoVM(policy="offload_all", verbose=0)
    with_autovm = train([callback])
    counters = tf_ops.stats()
    without = train([])
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(with_autovm, without)]
    return {"identical": all(d == 0.0 for d in diffs), "max_abs_diff": max(diffs),
            "counts": callback.report.plan.counts(), "stats": callback.report.stats,
            "op_counters": counters,
            "planned_bytes_per_step": callback.report.plan.result.d2h_bytes,
            "steps": epochs * (n // batch)}


# ---------------------------------------------------------------- (c)


def step_times(batch, size, channels, blocks, warmup, rounds, steps):
    import keras
    import numpy as np

    from keras_autovm.mechanisms.tensorflow import ops as tf_ops

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, size, size, 3)).astype("float32")
    y = rng.integers(0, 10, batch)
    models = {m: build_cnn(keras, tf_ops, m, size, channels, blocks) for m in MODES}
    for model in models.values():
        for _ in range(warmup):
            model.train_on_batch(x, y)
    times = {m: [] for m in MODES}
    moved = {m: {"bytes_evicted": 0, "bytes_prefetched": 0, "ops_issued": 0,
                 "tensors_skipped": 0, "errors": 0} for m in MODES}
    for _ in range(rounds):  # Interleaved: the machine is shared and noisy.
        for mode, model in models.items():
            tf_ops.reset_stats()
            for _ in range(steps):
                t0 = time.perf_counter()
                model.train_on_batch(x, y)  # Returns numpy: synchronised.
                times[mode].append(time.perf_counter() - t0)
            for k, v in tf_ops.stats().items():
                moved[mode][k] += v
    base = float(np.median(times["none"]))
    out = {"batch": batch, "size": size, "channels": channels, "blocks": blocks,
           "activation_bytes_per_block": batch * size * size * channels * 4,
           "warmup": warmup, "rounds": rounds, "steps_per_round": steps,
           "variants": {}}
    n_steps = rounds * steps
    for mode in MODES:
        med = float(np.median(times[mode]))
        out["variants"][mode] = {
            "median_step_s": med, "min_step_s": float(np.min(times[mode])),
            "ratio_to_none": med / base,
            "bytes_evicted_per_step": moved[mode]["bytes_evicted"] / n_steps,
            "bytes_prefetched_per_step": moved[mode]["bytes_prefetched"] / n_steps,
            "ops_issued_per_step": moved[mode]["ops_issued"] / n_steps,
            "errors": moved[mode]["errors"], "all_step_s": times[mode]}
    return out


# ---------------------------------------------------------------- main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_out = os.path.join(os.environ.get("OUT", os.path.join(ROOT, "results")),
                               "gpu_managed_ops.json")
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--pool-fraction", type=float, default=0.1,
                        help="TF unified-memory pool as a fraction of the GPU")
    parser.add_argument("--tensor-mib", type=int, default=64)
    parser.add_argument("--probe-mib", type=int, default=256)
    parser.add_argument("--probe-repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    res = {"command": " ".join([sys.executable] + sys.argv),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "host": platform.node(), "python": platform.python_version(),
           "args": vars(args), "parts": {}}

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)

    def part(name, fn):
        t0 = time.perf_counter()
        try:
            res["parts"][name] = {"status": "ok", "result": fn()}
        except Exception as e:  # Record and go on to the next part.
            res["parts"][name] = {"status": "error", "error": repr(e),
                                  "traceback": traceback.format_exc()[-4000:]}
            print(f"[{name}] ERROR {e!r}", flush=True)
        res["parts"][name]["wall_s"] = time.perf_counter() - t0
        print(f"[{name}] {res['parts'][name]['status']} "
              f"({res['parts'][name]['wall_s']:.1f} s)", flush=True)
        save()

    # Builds, before anything imports the package's libraries.
    build = _load_build()
    part("build", lambda: {k: str(v) for k, v in build.build_all(force=True).items()})
    part("cuda_h_check", check_cuda_header)

    # SAFETY: the managed pool must sit well inside free memory.
    smi = nvidia_smi()
    res["gpu"] = smi
    pool = args.pool_fraction * smi["total_bytes"]
    res["pool_bytes"] = pool
    if pool > 0.5 * smi["free_bytes"]:
        res["aborted"] = (f"pool {pool / 2**30:.1f} GiB > half of the free "
                          f"{smi['free_bytes'] / 2**30:.1f} GiB")
        save()
        print("ABORT:", res["aborted"])
        return 2
    import tensorflow as tf  # Before keras: the config must come first.

    import keras_autovm  # Leaves TensorFlow's devices uninitialised.

    keras_autovm.enable_managed_memory(memory_fraction=args.pool_fraction)
    res["unified_memory_via"] = "keras_autovm.enable_managed_memory"
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        res["aborted"] = "TensorFlow sees no GPU"
        save()
        print("ABORT:", res["aborted"])
        return 2
    import keras

    from keras_autovm import native
    from keras_autovm.mechanisms.tensorflow import ops as tf_ops

    res["versions"] = {"tensorflow": tf.__version__, "keras": keras.__version__,
                       "keras_backend": keras.backend.backend()}
    try:
        tf_ops.load_library()
        with tf.device("/GPU:0"):
            tf.zeros([1]).numpy()  # TF now owns the primary context.
        nat = native.require()
        res["driver"] = nat.driver_info()
        res["device"] = nat.device_info(0)
        res["mem_info_after_tf"] = nat.mem_info(0)
    except Exception as e:
        res["aborted"] = f"set-up failed: {e!r}"
        save()
        print("ABORT:", res["aborted"])
        return 2

    part("a_managed_evidence",
         lambda: managed_evidence(nat, tf_ops, tf, args.tensor_mib))
    part("c_step_times", lambda: step_times(args.batch, args.size, args.channels,
                                            args.blocks, args.warmup, args.rounds,
                                            args.steps))
    part("b_train_equivalence", train_equivalence)
    part("b_autovm_equivalence", autovm_equivalence)
    part("b_autovm_equivalence_no_fusion",
         lambda: autovm_equivalence(optimizer_passes=False))
    part("d_link_probe", lambda: nat.link_probe(args.probe_mib * MiB,
                                                args.probe_repeats, 0))
    res["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
    save()
    table(res)
    return 0


def table(res):
    p = res["parts"]
    print(f"\n{res['gpu']['name']}, driver {res['gpu']['driver']} "
          f"(CUDA {res['driver']['version']}, {res['driver']['prefetch_entry']}), "
          f"TF {res['versions']['tensorflow']}, {res['date'][:19]}")
    for name in ("build", "cuda_h_check"):
        print(f"{name:22} {p[name]['status']}"
              + (f" ok={p[name]['result'].get('ok')}" if name == "cuda_h_check"
                 and p[name]["status"] == "ok" else ""))
    a = p["a_managed_evidence"]
    if a["status"] == "ok":
        r = a["result"]
        print(f"(a) managed evidence   ok={r.get('ok')} managed={r['initial']['is_managed']} "
              f"evict->{r.get('after_evict')} prefetch->{r.get('after_prefetch')} "
              f"backward->{r.get('after_backward')} native {r.get('native_to_host')}/"
              f"{r.get('native_to_device')} evict call/done "
              f"{r.get('evict_call_s', 0) * 1e3:.2f}/{r.get('evict_done_s', 0) * 1e3:.2f} ms")
    else:
        print("(a) managed evidence  ", a["status"], a.get("error"))
    e = p.get("b_autovm_equivalence", {})
    if e.get("status") == "ok":
        r = e["result"]
        print(f"(b) AutoVM managed     identical={r['identical']} "
              f"max|diff|={r['max_abs_diff']} counts={r['counts']} "
              f"evicted={r['op_counters']['bytes_evicted']} "
              f"prefetched={r['op_counters']['bytes_prefetched']}")
    else:
        print("(b) AutoVM managed    ", e.get("status"), e.get("error"))
    e = p.get("b_autovm_equivalence_no_fusion", {})
    if e.get("status") == "ok":
        r = e["result"]
        print(f"(b) same, grappler remap/layout/arith off: identical={r['identical']} "
              f"max|diff|={r['max_abs_diff']}")
    b = p["b_train_equivalence"]
    if b["status"] == "ok":
        print(f"(b) train equivalence  identical={b['result']['identical']} "
              f"max|diff|={b['result']['max_abs_diff']} "
              f"bytes evicted={b['result']['stats']['bytes_evicted']}")
    else:
        print("(b) train equivalence ", b["status"], b.get("error"))
    c = p["c_step_times"]
    if c["status"] == "ok":
        r = c["result"]
        print(f"(c) CNN step, batch {r['batch']}, {r['size']}x{r['size']}x{r['channels']}, "
              f"{r['blocks']} blocks ({r['activation_bytes_per_block'] / MiB:.0f} MiB each)")
        print(f"    {'variant':22} {'ms/step':>8} {'ratio':>6} {'MiB out/in per step':>20}")
        for mode, v in r["variants"].items():
            print(f"    {mode:22} {v['median_step_s'] * 1e3:8.2f} {v['ratio_to_none']:6.2f} "
                  f"{v['bytes_evicted_per_step'] / MiB:9.0f}/{v['bytes_prefetched_per_step'] / MiB:<9.0f}")
    else:
        print("(c) step times        ", c["status"], c.get("error"))
    d = p["d_link_probe"]
    if d["status"] == "ok":
        r = d["result"]
        print(f"(d) link probe, {r['nbytes'] / MiB:.0f} MiB x {r['repeats']} (GB/s median / max)")
        for key in ("pinned_d2h", "pinned_h2d", "managed_prefetch_h2d",
                    "managed_prefetch_d2h", "managed_fault_h2d"):
            print(f"    {key:22} {r[key]['median']:7.1f} / {r[key]['max']:.1f}")
        print(f"    {'managed_first_eviction':22} {r['managed_first_eviction']:7.1f}")
    else:
        print("(d) link probe        ", d["status"], d.get("error"))


if __name__ == "__main__":
    sys.exit(main())
