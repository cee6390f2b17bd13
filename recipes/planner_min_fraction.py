"""How far below keep-all the planner can go on branched Keras Applications.

For each model, reads its planner graph with the active backend (as
`keras_autovm.plan()` does) and finds the lowest predicted peak any plan
reaches, as a fraction of the keep-all peak: before (the policies `auto`
compared before the hybrid policy existed) and after (`auto` today, hybrid
included), both with the actions `auto` may use on this backend and with
every action. Planner predictions only, no GPU.

    KERAS_BACKEND=jax python recipes/planner_min_fraction.py \\
        --out results/planner/min_fraction_jax.json
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planner_common import application_graph  # noqa: E402
from planner_common import write_json  # noqa: E402

MODELS = ("DenseNet121", "InceptionV3", "NASNetMobile", "EfficientNetB0", "ResNet50")
BEFORE = ("keep_all", "greedy_offload", "sqrt_recompute", "offload_all", "sqrt_offload")


def lowest(graph, cost, names, allowed, bounds=()):
    """(lowest peak, policy reaching it, bound on copies in flight) among
    `names` allowed here, under the cost's own bound and each of `bounds`
    (what `auto` tries where nothing fits)."""
    from keras_autovm.planner import choose

    best = None
    for bounded in choose.bounded_costs(cost, allowed, bounds):
        for name in names:
            if not set(choose.REQUIRES[name]) <= set(allowed):
                continue
            plan = choose._run(name, graph, bounded, 1, allowed)
            if best is None or plan.result.peak_bytes < best[0]:
                best = (plan.result.peak_bytes, name, bounded.max_in_flight_bytes)
    return best


def measure(name, batch):
    import keras

    from keras_autovm import planner
    from keras_autovm.planner.choose import CANDIDATES

    graph, mechanism = application_graph(name, batch)
    cost = mechanism.swap_cost(planner.CostModel())
    keep = planner.simulate(graph, {}, None, cost).peak_bytes
    row = {"model": name, "batch_size": batch, "ops": len(graph.ops),
           "keep_all_peak_bytes": keep, "by_actions": []}
    for allowed in (mechanism.auto_actions(), ("keep", "swap", "recompute")):
        entry = {"allowed": list(allowed)}
        # "before": the policies before hybrid, at the backend's own bound;
        # "after": `auto` today, with the tighter bounds it may try.
        for label, names, bounds in (("before", BEFORE, ()),
                                     ("after", CANDIDATES, mechanism.in_flight_bounds(cost))):
            start = time.perf_counter()
            peak, policy, bound = lowest(graph, cost, names, allowed, bounds)
            entry[label] = {"min_peak_bytes": peak, "fraction_of_keep_all": peak / keep,
                            "policy": policy, "max_in_flight_bytes": bound,
                            "search_s": time.perf_counter() - start}
        row["by_actions"].append(entry)
        print(f"{name} b{batch} {'/'.join(allowed)}: before "
              f"{entry['before']['fraction_of_keep_all']:.2f} "
              f"({entry['before']['policy']}), after "
              f"{entry['after']['fraction_of_keep_all']:.2f} "
              f"({entry['after']['policy']})", flush=True)
    keras.backend.clear_session()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", default=None, help="JSON file to write")
    args = parser.parse_args()
    import keras

    out = {"what": "lowest predicted peak of any plan / keep-all peak (planner "
                   "predictions, default CostModel as the backend adjusts it)",
           "backend": keras.backend.backend(), "keras": keras.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "models": [measure(m, args.batch) for m in args.models.split(",")]}
    write_json(args.out, out)


if __name__ == "__main__":
    main()
