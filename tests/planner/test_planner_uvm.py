import pytest

from keras_autovm.planner.uvm import PAGE
from keras_autovm.planner.uvm import Device
from keras_autovm.planner.uvm import UvmLayer
from keras_autovm.planner.uvm import UvmLink
from keras_autovm.planner.uvm import UvmResult
from keras_autovm.planner.uvm import footprint
from keras_autovm.planner.uvm import simulate_uvm
from keras_autovm.planner.uvm import speedup

GB = 1e9
# The H100 figures of results/gpu_managed_ops.json, rounded.
LINK = UvmLink(fault=6.6 * GB, prefetch_h2d=48.4 * GB, prefetch_d2h=9.9 * GB,
               evict=11.5 * GB)


def vgg_like(n=24, base=16 * PAGE):
    """Early outputs biggest, as in a VGG; one layer's working set is small
    enough to fit at 3x oversubscription."""
    return [UvmLayer(f"l{i}", 2e-3, 4e-3, base // (1 + i // 8)) for i in range(n)]


def test_no_oversubscription_no_faults_and_speedup_one():
    layers = vgg_like()
    ratio, default, hinted = speedup(layers, footprint(layers), LINK)
    assert default.fault_bytes == default.evicted_bytes == 0
    assert hinted.hint_bytes == 0 and hinted.stall_time == 0
    assert ratio == pytest.approx(1.0)
    assert default.step_time == pytest.approx(sum(l.fwd_s + l.bwd_s for l in layers))


def test_more_oversubscription_moves_more():
    layers = vgg_like()
    need = footprint(layers)
    moved = [simulate_uvm(layers, int(need / f), LINK).fault_bytes
             for f in (1.25, 1.5, 2.0, 3.0)]
    assert moved[0] > 0
    assert moved == sorted(moved) and moved[-1] > moved[0]


def test_hints_beat_default_paging_under_oversubscription():
    layers = vgg_like()
    need = footprint(layers)
    for f in (1.5, 2.0, 3.0):
        ratio, default, hinted = speedup(layers, int(need / f), LINK)
        assert ratio > 1.1
        assert hinted.fault_bytes < default.fault_bytes
        assert hinted.hint_bytes > 0


def test_lru_evicts_the_least_recently_used():
    dev = Device(2, LINK, UvmResult())
    now = dev.allocate("a", PAGE, 0.0, {"a"})
    now = dev.allocate("b", PAGE, now, {"b"})
    now = dev.touch("a", now, {"a"})  # b is now the least recently used.
    now = dev.allocate("c", PAGE, now, {"c"})
    assert dev.count["a"] == 1 and dev.count["c"] == 1 and dev.count["b"] == 0
    assert dev.result.evicted_bytes == PAGE
    assert now == pytest.approx(PAGE / LINK.evict)
    # Touching b again faults it in and evicts a, now the oldest.
    now2 = dev.touch("b", now, {"b"})
    assert dev.count["a"] == 0 and dev.result.fault_bytes == PAGE
    assert now2 == pytest.approx(now + PAGE / LINK.evict + PAGE / LINK.fault)


def test_bad_capacity():
    with pytest.raises(ValueError, match="capacity"):
        simulate_uvm(vgg_like(), 0, LINK)


def test_recipe_reads_a_calibration_file(tmp_path):
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    calibration = {
        "device": "test", "backend": "none", "batch_size": 8,
        "layers": [{"name": l.name, "fwd_s": l.fwd_s, "bwd_s": l.bwd_s,
                    "output_bytes": l.output_bytes} for l in vgg_like()],
        "link": {"managed_fault_h2d": 6.6, "managed_prefetch_h2d": 48.4,
                 "managed_prefetch_d2h": 9.9, "managed_first_eviction": 11.5}}
    path, out = tmp_path / "cal.json", tmp_path / "out.json"
    path.write_text(json.dumps(calibration))
    subprocess.run([sys.executable, os.path.join(root, "recipes", "uvm_sim.py"),
                    "--calibration", str(path), "--out", str(out)],
                   check=True, cwd=root, capture_output=True)
    result = json.loads(out.read_text())
    assert result["SIMULATED"] is True and result["uncalibrated"] is False
    assert [r["oversubscription"] for r in result["results"]] == [1.25, 1.5, 2.0, 3.0]
    assert all(r["speedup"] > 1.0 for r in result["results"])
    assert result["link_gbps"]["fault"] == 6.6
