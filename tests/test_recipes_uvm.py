"""The UVM simulation recipe's link from copies measured at each layer's
size (plain Python: the copies are measured on a GPU, the weighting is
checked here)."""

import importlib.util
import json
import pathlib
import sys

import pytest

_RECIPES = pathlib.Path(__file__).resolve().parents[1] / "recipes"


def _recipe():
    sys.path.insert(0, str(_RECIPES))
    try:
        spec = importlib.util.spec_from_file_location("uvm_sim", _RECIPES / "uvm_sim.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(_RECIPES))
    return module


def test_copy_time_link_is_the_layers_bytes_over_their_copy_times(tmp_path):
    recipe = _recipe()
    mib = 2**20
    # 4 MiB copies at 8 GB/s, 2 MiB ones at 2 GB/s; one layer under the floor.
    probe = {4 * mib: 8.0, 2 * mib: 2.0}
    sizes = [{"nbytes": n, "probe": {key: {"median": g} for key in recipe.LINK_KEYS.values()}}
             for n, g in probe.items()] + [{"nbytes": 1000, "skipped": "under 1 MiB"}]
    path = tmp_path / "copies.json"
    path.write_text(json.dumps({"sizes": sizes}))
    layers = [recipe.uvm.UvmLayer(name, 0.0, 0.0, n) for name, n in
              (("a", 4 * mib), ("b", 4 * mib), ("c", 2 * mib), ("d", 1000))]
    link, gbps = recipe.copy_time_link(str(path), layers)
    # 10 MiB moved in 2 * 4 MiB / 8 GB/s + 2 MiB / 2 GB/s.
    expected = 10 * mib / (2 * 4 * mib / 8.0 + 2 * mib / 2.0)
    assert gbps["fault"] == pytest.approx(expected)
    assert link.prefetch_h2d == pytest.approx(expected * 1e9)
    assert set(gbps) == {"fault", "prefetch_h2d", "prefetch_d2h", "evict"}
