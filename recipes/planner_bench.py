"""How long planning takes: `make_plan` on ResNet-152 (and others) on a CPU.

Builds each Keras Application once with the active backend (the build and
the graph read are timed apart, not counted as planning), then times
`planner.make_plan` for `auto` and `hybrid` at budgets given as fractions
of the keep-all peak, each the best of `--repeats` runs. Writes JSON with
the machine it ran on.

    KERAS_BACKEND=tensorflow python recipes/planner_bench.py \\
        --out results/planner/planner_bench_tensorflow.json
"""

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planner_common import write_json  # noqa: E402

MODELS = {"ResNet152": 256, "DenseNet121": 64, "VGG19": 128}
POLICIES = ("auto", "hybrid")
FRACTIONS = (None, 0.8, 0.5, 0.3)


def machine():
    """What the timings were taken on."""
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name")]
        info["cpu_model"] = names[0] if names else None
        info["load_average_at_start"] = list(os.getloadavg())
    except OSError:
        pass
    return info


def bench_model(name, batch, repeats):
    import keras

    from keras_autovm import budget as budget_lib
    from keras_autovm import mechanisms
    from keras_autovm import planner

    mechanism = mechanisms.get()
    start = time.perf_counter()
    kwargs = {"input_shape": (224, 224, 3)} if name.startswith("NASNet") else {}
    model = getattr(keras.applications, name)(weights=None, **kwargs)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    graph = budget_lib.graph_for(model, batch, mechanism)
    graph_s = time.perf_counter() - start
    cost = mechanism.swap_cost(planner.CostModel())
    keep = planner.simulate(graph, {}, None, cost).peak_bytes
    rows = []
    for allowed in (mechanism.auto_actions(), ("keep", "swap", "recompute")):
        for policy in POLICIES:
            for frac in FRACTIONS:
                budget = None if frac is None else int(keep * frac)
                times, plan, least = [], None, None
                for _ in range(repeats):
                    start = time.perf_counter()
                    try:
                        plan = planner.make_plan(graph, budget, policy, cost, allowed,
                                                 bounds=mechanism.in_flight_bounds(cost))
                    except planner.PlanError as error:  # A refusal is timed too.
                        plan, least = None, error.min_budget
                    times.append(time.perf_counter() - start)
                rows.append({
                    "policy": policy, "allowed": list(allowed),
                    "budget_fraction_of_keep_all": frac, "budget_bytes": budget,
                    "plan_s": min(times), "plan_s_all": times,
                    "fits": plan is not None,
                    "chosen": plan.policy if plan else None,
                    "predicted_step_s": plan.result.step_time if plan else None,
                    "predicted_peak_bytes": plan.result.peak_bytes if plan else None,
                    "least_budget_bytes": least})
                print(f"{name} b{batch} {policy:6} {''.join(a[0] for a in allowed):3} "
                      f"budget {frac}: {min(times):.3f} s "
                      f"({rows[-1]['chosen']})", flush=True)
    return {"model": name, "batch_size": batch, "ops": len(graph.ops),
            "tensors": len(graph.tensors), "keep_all_peak_bytes": keep,
            "model_build_s": build_s, "graph_read_s": graph_s, "runs": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help="comma-separated Keras Applications")
    parser.add_argument("--batch", type=int, default=None,
                        help="one batch size for every model (default: per model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON file to write")
    args = parser.parse_args()
    import keras

    out = {"what": "planner wall time (make_plan), CPU only; model build timed apart",
           "machine": machine(), "backend": keras.backend.backend(),
           "keras": keras.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "models": []}
    for name in args.models.split(","):
        out["models"].append(bench_model(name, args.batch or MODELS.get(name, 64),
                                         args.repeats))
    write_json(args.out, out)


if __name__ == "__main__":
    main()
