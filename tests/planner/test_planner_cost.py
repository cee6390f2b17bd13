import pathlib
import subprocess
import sys

import pytest

import keras_autovm.planner
from keras_autovm.planner import CostModel
from keras_autovm.planner import OpSpec
from keras_autovm.planner import format_bytes

PACKAGE = pathlib.Path(keras_autovm.planner.__file__).parents[1]


def test_roofline_and_overhead():
    cost = CostModel(flops_per_s=1e12, mem_bytes_per_s=1e11, op_overhead_s=1e-6)
    compute_bound = OpSpec("c", flops=2e9, mem_bytes=1e6)
    memory_bound = OpSpec("m", flops=1e6, mem_bytes=1e9)
    assert cost.fwd_time(compute_bound) == pytest.approx(2e-3 + 1e-6)
    assert cost.fwd_time(memory_bound) == pytest.approx(1e-2 + 1e-6)
    assert cost.bwd_time(memory_bound) == pytest.approx(2 * (1e-2 + 1e-6))


def test_given_times_win_and_scale():
    op = OpSpec("x", flops=1e15, fwd_time=0.5, bwd_time=0.7)
    half = OpSpec("y", fwd_time=0.5)
    cost = CostModel(bwd_factor=3.0)
    assert (cost.fwd_time(op), cost.bwd_time(op)) == (0.5, 0.7)
    assert cost.bwd_time(half) == 1.5
    slow = cost.scaled(2.0)
    assert (slow.fwd_time(op), slow.bwd_time(op)) == (1.0, 1.4)
    assert slow.scaled(0.5).fwd_time(op) == 0.5
    # Copies are measured separately and do not scale.
    assert slow.copy_time(100e9, "d2h") == cost.copy_time(100e9, "d2h") == 2.0


def test_a_forward_scale_scales_forwards_and_recompute_not_backwards():
    timed = OpSpec("x", fwd_time=0.5, bwd_time=0.7)
    estimated = OpSpec("e", flops=2e12)
    cost = CostModel(flops_per_s=1e12, op_overhead_s=0.0, bwd_factor=2.0)
    slow = cost.scaled_forward(3.0)
    assert (slow.fwd_time(timed), slow.bwd_time(timed)) == (1.5, 0.7)
    # An estimated backward is a multiple of the layer's own forward, not
    # of the forward as an eager step runs it.
    assert slow.fwd_time(estimated) == 6.0 and slow.bwd_time(estimated) == 4.0
    both = slow.scaled(2.0)
    assert (both.fwd_time(timed), both.bwd_time(timed)) == (3.0, 1.4)
    with pytest.raises(ValueError, match="factor"):
        cost.scaled_forward(0.0)


def test_copy_time_directions():
    cost = CostModel(d2h_bytes_per_s=10, h2d_bytes_per_s=20)
    assert cost.copy_time(100, "d2h") == 10
    assert cost.copy_time(100, "h2d") == 5
    with pytest.raises(ValueError, match="direction='up'"):
        cost.copy_time(100, "up")


@pytest.mark.parametrize("kwargs, name", [
    ({"flops_per_s": 0}, "flops_per_s=0"),
    ({"h2d_bytes_per_s": -5}, "h2d_bytes_per_s=-5"),
    ({"bwd_factor": -1.0}, "bwd_factor=-1.0"),
    ({"d2h_bytes_per_s": "fast"}, "d2h_bytes_per_s='fast'"),
    ({"time_scale": float("nan")}, "time_scale=nan"),
    ({"fwd_scale": 0.0}, "fwd_scale=0.0"),
])
def test_cost_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CostModel(**kwargs)
    with pytest.raises(ValueError, match="factor=0"):
        CostModel().scaled(0)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(12 * 2**20) == "12.00 MiB"
    assert format_bytes(1320702443) == "1.23 GiB"


def test_planner_imports_no_framework():
    # Load the planner in a fresh interpreter without keras_autovm/__init__
    # (which imports keras) and check nothing heavy came with it.
    code = (
        "import sys, types\n"
        "pkg = types.ModuleType('keras_autovm')\n"
        f"pkg.__path__ = [{str(PACKAGE)!r}]\n"
        "sys.modules['keras_autovm'] = pkg\n"
        "import keras_autovm.planner\n"
        "heavy = {'keras', 'tensorflow', 'jax', 'torch', 'numpy'}\n"
        "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"
