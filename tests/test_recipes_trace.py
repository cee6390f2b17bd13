"""The memory-trace recipe's replay of torch's allocator history (plain
Python: the recipe runs on a GPU, its arithmetic is checked here)."""

import importlib.util
import pathlib

_PATH = pathlib.Path(__file__).resolve().parents[1] / "recipes" / "gpu_torch_memory_trace.py"


def _recipe():
    spec = importlib.util.spec_from_file_location("gpu_torch_memory_trace", _PATH)
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
