"""The memory-trace recipes' arithmetic and bookkeeping (plain Python: the
recipes run on a GPU, what they compute is checked here)."""

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess

_RECIPES = pathlib.Path(__file__).resolve().parents[1] / "recipes"
_PATH = _RECIPES / "gpu_torch_memory_trace.py"


def _recipe(path=_PATH):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _event(action, addr, size, t, where):
    return {"action": action, "addr": addr, "size": size, "time_us": t,
            "frames": [{"filename": f"/x/{where}.py", "line": 1, "name": where}]}


def test_peak_breakdown_finds_the_peak_in_the_window_and_what_is_live():
    recipe = _recipe()
    # 100 bytes allocated before the history began, 40 of them (addr 9)
    # freed during the step.
    trace = [{"kind": "step_begin", "op": "", "allocated": 100, "t_us": 0},
             {"kind": "bwd_start", "op": "a", "t_us": 10},
             {"kind": "bwd_start", "op": "b", "t_us": 20}]
    events = [_event("alloc", 1, 50, 5, "forward"),           # 150 (before the window)
              _event("free_completed", 9, 40, 11, "old"),     # 110
              _event("alloc", 2, 30, 12, "grad"),             # 140
              _event("alloc", 3, 20, 13, "workspace"),        # 160: the peak
              _event("free_completed", 3, 20, 14, "workspace"),
              _event("free_completed", 1, 50, 15, "forward"),  # 90
              _event("alloc", 4, 500, 25, "later")]           # after the window
    peak = recipe.peak_breakdown(events, trace, "bwd_start:a", "bwd_start:b")
    assert peak["allocated"] == 160 and peak["at_event"] == 3
    assert {g["where"].split(":")[0]: g["bytes"] for g in peak["live"]} == {
        "/x/forward.py": 50, "/x/grad.py": 30, "/x/workspace.py": 20}


def test_worst_window_is_where_the_measured_peak_exceeds_the_plan_most():
    recipe = _recipe()
    trace = [{"kind": "step_begin", "op": "", "peak_since_last": 5, "predicted": None},
             {"kind": "fwd_end", "op": "a", "peak_since_last": 10, "predicted": (9, 9)},
             {"kind": "fwd_end", "op": "b", "peak_since_last": 30, "predicted": (20, 25)},
             {"kind": "bwd_start", "op": "b", "peak_since_last": 12, "predicted": (12, 12)}]
    assert recipe.worst_window(trace) == ["fwd_end:a", "fwd_end:b"]


def test_tf_trace_keeps_a_result_written_before_its_process_hung(tmp_path, monkeypatch):
    # On an H200, a ResNet-152 run wrote its result, then did not exit: the
    # result was lost with the timeout. A run that wrote nothing is an error.
    # The recipe sets KERAS_BACKEND as it loads; the test's is restored.
    monkeypatch.setenv("KERAS_BACKEND", os.environ.get("KERAS_BACKEND", "tensorflow"))
    recipe = _recipe(_RECIPES / "gpu_tf_memory_trace.py")

    def hung(cmd, timeout, check):
        if "keras_xla" in cmd:
            raise OSError("cannot start")
        if "autovm:keep_all" in cmd:
            out = cmd[cmd.index("--out") + 1]
            pathlib.Path(out).write_text(json.dumps({"variant": "autovm:keep_all", "peak": 7}))
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(subprocess, "run", hung)
    out = tmp_path / "trace.json"
    args = argparse.Namespace(model="small", steps=2, cap_gib=0.0, budget_gib=0.0,
                              smoke=True, timeout=5, out=str(out))
    recipe.several(args, [("autovm:keep_all", 16), ("keras", 16), ("keras_xla", 16)])
    kept, lost, unstarted = json.loads(out.read_text())["runs"]
    assert kept["peak"] == 7 and "did not exit in 5 s" in kept["exit"]
    assert lost["variant"] == "keras" and lost["error"].startswith("TimeoutExpired")
    assert unstarted["error"] == "OSError: cannot start"


def _tf_recipe(monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", os.environ.get("KERAS_BACKEND", "tensorflow"))
    return _recipe(_RECIPES / "gpu_tf_memory_trace.py")


def test_tf_trace_names_the_op_at_the_peak(monkeypatch):
    recipe = _tf_recipe(monkeypatch)

    def event(kind, addr, size, in_use, op):
        return (0, kind, {"addr": addr, "allocation_bytes": size, "bytes_allocated": in_use,
                          "tf_op": op})

    events = [event("MemoryAllocation", 1, 10, 110, "model/a/Conv2D"),
              event("MemoryAllocation", 2, 30, 140, "gradient_tape/model/b/Mul"),
              event("MemoryDeallocation", 1, 10, 130, "gradient_tape/model/a/Relu")]
    found = recipe.live_at_peak(events)
    assert found["peak_bytes"] == 140 and found["peak_op"] == "gradient_tape/model/b/Mul"
    assert recipe._layer(found["peak_op"], {"a", "b"}) == "b"


def test_tf_trace_reads_what_the_plan_has_in_use_while_an_op_runs(monkeypatch):
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).parent / "planner"))
    from planner_graphs import chain
    from keras_autovm.planner import simulate

    recipe = _tf_recipe(monkeypatch)
    # o0 -> t0 (100) -> o1 -> t1 (10) -> o2 -> t2 (1), all kept: o1's
    # backward has t0 and the gradients of t1 and t0 (t1 died with o2's
    # backward); o2's forward has t0, t1 and t2.
    result = simulate(chain([100, 10, 1]))
    assert recipe.predicted_during(result, "o1", "bwd") == 100 + 10 + 100
    assert recipe.predicted_during(result, "o2", "fwd") == 111
    # Swapped, t0 is off the device in o2's forward. Both copies back are
    # enqueued as o3's backward starts: t1's starts with it, t0's (100)
    # after t1's, while o3's backward runs, and counts there.
    swapped = simulate(chain([100, 10, 1, 1]), actions={"t0": "swap", "t1": "swap"},
                       prefetch={"t0": "o3", "t1": "o3"})
    assert recipe.predicted_during(swapped, "o2", "fwd") < 111
    assert recipe.predicted_during(swapped, "o3", "bwd") == 113
    assert recipe.predicted_during(result, "o9", "bwd") is None


def test_tf_trace_sets_no_prediction_against_an_optimizer_peak(monkeypatch):
    """The simulator has no item for the optimizer's update: a peak there
    is not compared with what a forward of the same layer has in use."""
    recipe = _tf_recipe(monkeypatch)
    assert recipe.peak_phase("model/a/Conv2D") == "fwd"
    assert recipe.peak_phase("gradient_tape/model/a/Conv2DBackpropInput") == "bwd"
    assert recipe.peak_phase("Adam/update_3/ResourceApplyAdam") is None


def test_workspace_rule_recipe_counts_what_a_step_holds(monkeypatch):
    """`recipes/tf_workspace_rule.py`: under the rule AutoVM has now, a
    convolution's and a pooling's workspaces are dropped, a Dense layer's
    loses its kernel's bytes, a batch normalization's stays."""
    import keras
    import pytest

    if keras.backend.backend() != "tensorflow":
        pytest.skip("TensorFlow's workspaces")
    from keras_autovm import profiling

    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")  # The recipe sets it as it loads.
    recipe = _recipe(_RECIPES / "tf_workspace_rule.py")
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, name="conv")(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.MaxPooling2D(name="pool")(x)
    x = keras.layers.Flatten(name="flat")(x)
    model = keras.Model(inputs, keras.layers.Dense(2, name="dense")(x))
    kernel = 36 * 2 * 4 + 2 * 4
    names = [layer.name for layer in model.layers[1:]]
    layers = tuple(profiling.LayerTime(n, 1e-3, 2e-3, 64, workspace_bytes=1000 + kernel)
                   for n in names)
    profile = profiling.Profile("test", "tensorflow", 4, "", layers)
    ruled = {name: {t.name: t.workspace_bytes for t in p.layers}
             for name, p in recipe.rules(model, profile).items()}
    assert ruled["now"] == {"conv": 0, "bn": 1000 + kernel - 4 * 4 * 2, "pool": 0,
                            "flat": 1000 + kernel, "dense": 1000}
    assert set(ruled["none"].values()) == {0}
    assert set(ruled["every_call"].values()) == {1000 + kernel}
    row = recipe.predict(model, 4, recipe.rules(model, profile)["now"], ["bn"], 1.0, [0.05])
    assert row["during_bwd_gib"]["bn"] > 0 and "auto_budget_1gib_headroom_0.05" in row


def test_resimulation_recipe_takes_each_calls_fixed_time_off(monkeypatch):
    """`recipes/tf_step_resimulated.py`: with the fixed times off, a call's
    time is its part that grows with the batch, at any batch."""
    import pytest

    from keras_autovm import profiling

    monkeypatch.setenv("KERAS_BACKEND", keras_backend())  # The recipe sets it as it loads.
    recipe = _recipe(_RECIPES / "tf_step_resimulated.py")
    layers = (profiling.LayerTime("a", 3e-3, 5e-3, 64, fwd_fixed_s=1e-3, bwd_fixed_s=1e-3),
              profiling.LayerTime("b", 2e-3, 4e-3, 64))
    profile = profiling.Profile("test", "tensorflow", 8, "", layers)
    off = recipe.without_fixed(profile)
    assert [x for t in off.layers for x in t.at(2.0)] == pytest.approx([4e-3, 8e-3] * 2)
    assert [x for t in profile.layers for x in t.at(2.0)] == pytest.approx(
        [5e-3, 9e-3, 4e-3, 8e-3])


def keras_backend():
    import keras
    return keras.backend.backend()
