"""What XLA really allocates for each AutoVM plan (JAX), compile only.

For VGG-19 at one batch size, applies each plan's checkpoint policy the way
the AutoVM callback does, lowers and compiles Keras's training step without
running it, and reads XLA's `memory_analysis()` (argument, output, alias and
temp bytes) next to the planner's predicted peak. Compiling allocates no
activations, so no variant can run out of memory: this measures how far the
planner's device-memory model is from XLA's buffer assignment.

    python recipes/gpu_vgg19_memory.py --batch 128 --out results/gpu_vgg19_memory.json
"""

import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("KERAS_BACKEND", "jax")


def analyse(model_fn, batch, policy, budget, remat=False):
    import jax
    import keras
    import numpy as np

    import keras_autovm

    keras.utils.set_random_seed(0)
    if remat:
        with keras.RematScope(mode="full"):
            model = model_fn()
    else:
        model = model_fn()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x = np.zeros((batch,) + tuple(model.input_shape[1:]), "float32")
    y = np.zeros((batch,), "int32")
    model._symbolic_build(data_batch=(x, y))
    model.optimizer.build(model.trainable_variables)
    out = {"policy": policy, "remat_scope": remat}
    if policy is not None:
        callback = keras_autovm.AutoVM(budget=budget, policy=policy, verbose=0,
                                       apply_without_gpu=True, batch_size=batch)
        callback.set_model(model)
        callback.on_train_begin()
        callback.on_epoch_begin(0)  # Applies the plan to the model.
        plan = callback.plan
        out.update(predicted_peak=plan.result.peak_bytes, counts=plan.counts(),
                   chosen=plan.policy, predicted_step_s=plan.result.step_time)
    state = ([v.value for v in model.trainable_variables],
             [v.value for v in model.non_trainable_variables],
             [v.value for v in model.optimizer.variables],
             [v.value for v in model.metrics_variables])
    start = time.perf_counter()
    compiled = jax.jit(model.train_step, donate_argnums=0).lower(state, (x, y)).compile()
    out["compile_s"] = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    for key in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                "temp_size_in_bytes", "host_temp_size_in_bytes",
                "host_argument_size_in_bytes", "host_output_size_in_bytes"):
        out[key] = getattr(analysis, key, None)
    # Device bytes live at once, as XLA assigned them: arguments stay (donated
    # outputs alias them), plus temporaries.
    out["xla_device_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                               - out["alias_size_in_bytes"] + out["temp_size_in_bytes"])
    text = compiled.as_text()
    out["host_memory_space_mentions"] = text.count("S(5)")
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--budget", default="8.6GiB",
                        help="budget for the 'auto' and 'greedy_offload' rows")
    parser.add_argument("--small", action="store_true", help="tiny model (CPU check)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import jax
    import keras

    if args.small:
        def model_fn():
            return keras.applications.VGG19(weights=None, input_shape=(32, 32, 3),
                                            classes=10)
    else:
        def model_fn():
            return keras.applications.VGG19(weights=None)
    rows = [("keep_all", None, False), ("offload_all", None, False),
            ("sqrt_recompute", None, False), ("sqrt_offload", None, False),
            ("greedy_offload", args.budget, False), ("auto", args.budget, False),
            (None, None, False), (None, None, True)]
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "command": " ".join(["python"] + sys.argv), "batch": args.batch,
               "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
               "keras": keras.__version__, "rows": []}
    for policy, budget, remat in rows:
        try:
            row = analyse(model_fn, args.batch, policy, budget or "1TiB", remat)
        except Exception as error:  # noqa: BLE001 - record and go on
            row = {"policy": policy, "remat_scope": remat,
                   "error": f"{type(error).__name__}: {error}"[:1000]}
        results["rows"].append(row)
        print(json.dumps({k: row.get(k) for k in ("policy", "remat_scope", "chosen",
              "predicted_peak", "xla_device_bytes", "temp_size_in_bytes",
              "host_temp_size_in_bytes", "error")}), flush=True)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    gib = 2 ** 30
    print(f"\nVGG-19 batch {args.batch} on {results['device']}: GiB")
    print(f"{'plan':26} {'predicted':>9} {'XLA device':>10} {'XLA temp':>9} {'host temp':>9}")
    for row in results["rows"]:
        name = row.get("chosen") or row.get("policy") or (
            "RematScope(full)" if row.get("remat_scope") else "no AutoVM")
        if "error" in row:
            print(f"{name:26} error: {row['error'][:60]}")
            continue
        pred = row.get("predicted_peak")
        print(f"{name:26} {(pred or 0) / gib:9.2f} {row['xla_device_bytes'] / gib:10.2f} "
              f"{row['temp_size_in_bytes'] / gib:9.2f} "
              f"{(row.get('host_temp_size_in_bytes') or 0) / gib:9.2f}")


if __name__ == "__main__":
    main()
