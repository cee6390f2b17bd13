"""TensorFlow runs' plans simulated again on a CPU: where the predicted step
time goes, and what the layers' fixed times add.

Takes runs of `recipes/gpu_swap.py` (each result's plan: actions, prefetch
points, cost model) and the profile each planned with (the profile cache's
JSON), builds the model's graph as the TensorFlow mechanism plans it, and
simulates each plan's step twice: with the profile's layer times as
AutoVM plans with them, and with each call's fixed time (the intercept of
its time against the batch, `LayerTime.fwd_fixed_s`: launch and Python
overhead of a call timed alone) taken off. Both at the time scale the
plan was made with (where a first epoch's calibration changed it) and at
1 (the prediction before calibration), against the step the run measured.
Where the plan recorded is the one that ran, its first row reproduces the
prediction the run recorded (`plan_ran`); where the last epoch's
calibration replanned after the last step, the plan recorded did not run,
and its rows are of that plan. Predictions of the simulator; nothing runs on a GPU.

    python recipes/tf_step_resimulated.py \\
        --run results/tensorflow/timing_batch/3233051_resnet152_280_h05.json:280:results/tensorflow/timing_batch/3233051_profile_resnet152_b280.json \\
        --out results/tensorflow/timing_batch/resimulated.json
"""

import argparse
import dataclasses
import datetime
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402

from keras_autovm import mechanisms  # noqa: E402
from keras_autovm.budget import graph_for  # noqa: E402
from keras_autovm.planner import CostModel  # noqa: E402
from keras_autovm.planner.simulate import simulate  # noqa: E402
from keras_autovm.profiling import Profile  # noqa: E402

MODELS = {"resnet152": keras.applications.ResNet152, "vgg19": keras.applications.VGG19}


def without_fixed(profile):
    """`profile` with each call's fixed time taken off its times."""
    return dataclasses.replace(profile, layers=tuple(dataclasses.replace(
        t, fwd_s=t.fwd_s - t.fwd_fixed_s, bwd_s=t.bwd_s - t.bwd_fixed_s,
        fwd_fixed_s=0.0, bwd_fixed_s=0.0) for t in profile.layers))


def result_of(run_file, batch):
    """The model name and the `autovm_swap` result at `batch` of a run."""
    with open(run_file) as f:
        parts = json.load(f)["parts"]
    for name, part in parts.items():
        for result in part["batches"]["result"]["autovm_swap"]:
            if result["batch"] == batch and result.get("plan"):
                return name, result
    raise ValueError(f"No planned result at batch {batch} in {run_file}")


def simulated(graph, plan, time_scale):
    cost = CostModel(**dict(plan["cost"], time_scale=time_scale))
    actions = {t["name"]: t["action"] for t in plan["tensors"]}
    prefetch = {t["name"]: t["prefetch"] for t in plan["tensors"] if t["prefetch"]}
    sim = simulate(graph, actions, prefetch, cost)
    return {"step_s": sim.step_time, "compute_s": sim.compute_time,
            "recompute_s": sim.recompute_time, "stall_s": sim.stall_time}


def one(spec):
    """One `run.json:batch:profile.json`: each simulation against the step."""
    run_file, batch, profile_file = spec.split(":")
    name, result = result_of(run_file, int(batch))
    keras.utils.set_random_seed(0)
    model = MODELS[name](weights=None)
    profile = Profile.load(profile_file)
    plan, measured = result["plan"], result["step_s"]
    rows = []
    for times, p in (("as planned", profile), ("fixed times off", without_fixed(profile))):
        graph = graph_for(model, plan["batch_size"], mechanisms.get(), p)
        scale_made = plan["cost"]["time_scale"]
        for scale in [1.0] + ([scale_made] if scale_made != 1.0 else []):
            row = dict(simulated(graph, plan, scale), layer_times=times, time_scale=scale)
            row["over_measured"] = row["step_s"] / measured
            rows.append(row)
    fixed = sum(t.fwd_fixed_s + t.bwd_fixed_s for t in profile.layers)
    # The plan recorded is the one in force at the end: where the last
    # epoch's calibration replanned after the last step, it did not run,
    # and does not give the first prediction the run recorded.
    first = result["predicted_step_s"]
    ran = abs(rows[0]["step_s"] - first) <= 1e-6 * first
    return {"run": run_file, "plan_ran": ran, "first_prediction_s": first, "model": name, "batch": int(batch), "profile": profile_file,
            "profile_batch": profile.batch_size, "fixed_s_in_profile": fixed,
            "measured_step_s": measured, "stored_prediction_s": plan["predicted"]["step_time"],
            "counts": plan["counts"], "simulated": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True,
                        help="run.json:batch:profile.json (repeatable)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    runs = [one(spec) for spec in args.run]
    for r in runs:
        print(f"{r['model']} {r['batch']}: measured {r['measured_step_s']:.4f} s")
        for row in r["simulated"]:
            print(f"  {row['layer_times']:16s} scale {row['time_scale']:.3f}: "
                  f"{row['step_s']:.4f} s ({row['over_measured']:.3f}x)")
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "command": " ".join(["python"] + sys.argv), "simulated": True,
           "keras": keras.__version__, "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
