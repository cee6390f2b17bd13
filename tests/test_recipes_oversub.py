"""The oversubscription recipe's merge of several runs into one file and
plot (plain Python, on the TensorFlow runs committed under results/)."""

import importlib.util
import json
import pathlib
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_RUNS = _ROOT / "results" / "tensorflow" / "oversub"


def _recipe():
    sys.path.insert(0, str(_ROOT / "recipes"))
    try:
        spec = importlib.util.spec_from_file_location(
            "gpu_oversub", _ROOT / "recipes" / "gpu_oversub.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(_ROOT / "recipes"))
    return module


def _load(name):
    return json.loads((_RUNS / name).read_text())


def test_a_later_run_replaces_an_earlier_one_and_each_ratio_stays_its_runs():
    names = ["oversub_tf_vgg19_x1_x2.json", "oversub_tf_vgg19_least_x1.5_x4.json"]
    early, late = (_load(n) for n in names)
    result = _recipe().merged([early, late], names)
    assert [f["factor"] for f in result["factors"]] == [1.0, 1.5, 2.0, 3.0, 4.0]
    at = {f["factor"]: f for f in result["factors"]}
    # 1.5x: AutoVM from the later run, the peers from the earlier one.
    assert at[1.5]["from"] == {"autovm": names[1], "offload_all": names[0],
                               "remat": names[0]}
    assert at[1.5]["summary"]["autovm"] == dict(late["factors"][0]["summary"]["autovm"],
                                                budget_gib=late["factors"][0]["budget_gib"])
    assert at[1.0]["summary"]["offload_all"]["throughput_ratio"] == \
        early["factors"][0]["summary"]["offload_all"]["throughput_ratio"]
    assert at[4.0]["summary"]["remat"] == {"status": "not run"}
    assert [m["from"] for m in result["merged"]] == names


def test_runs_of_another_model_are_not_merged():
    with pytest.raises(ValueError, match="one backend, model and batch"):
        _recipe().merged([_load("oversub_tf_vgg19_x1_x2.json"),
                          _load("oversub_tf_resnet152_x3_x1.json")], ["a", "b"])


def test_merge_writes_the_file(tmp_path):
    out = tmp_path / "merged.json"
    _recipe().merge([str(_RUNS / "oversub_tf_resnet152_x3_x1.json"),
                     str(_RUNS / "oversub_tf_resnet152_x3_peers.json")], str(out))
    result = json.loads(out.read_text())
    assert [f["factor"] for f in result["factors"]] == [1.0, 3.0]
    assert result["factors"][1]["summary"]["autovm"]["status"] == "ok"
    assert result["factors"][1]["summary"]["offload_all"]["status"] == "error"


def test_a_run_is_given_against_kerass_step_without_xla_where_that_trained():
    summary = _recipe().summary
    run = {"status": "ok", "images_per_s": 200.0, "steady_peak_bytes": 2**30}
    reference = {"status": "ok", "images_per_s": 800.0}
    noxla = {"status": "ok", "images_per_s": 400.0}
    row = summary(run, reference, 4.0, noxla)
    assert row["throughput_ratio"] == 0.25
    assert row["throughput_vs_noxla"] == 0.5
    assert "throughput_vs_noxla" not in summary(run, reference, 4.0)
    assert "throughput_vs_noxla" not in summary(run, reference, 4.0, {"status": "oom"})


def test_each_run_records_the_variables_that_change_what_runs(monkeypatch):
    monkeypatch.setenv("TF_XLA_FLAGS", "--tf_xla_auto_jit=2")
    monkeypatch.setenv("AUTOVM_UNRELATED_VARIABLE", "1")
    monkeypatch.delenv("TF_CUDNN_WORKSPACE_LIMIT_IN_MB", raising=False)
    recipe = _recipe()  # Imports gpu_swap, whose list it is.
    recorded = sys.modules["gpu_swap"].environment()
    assert recorded["TF_XLA_FLAGS"] == "--tf_xla_auto_jit=2"
    assert "AUTOVM_UNRELATED_VARIABLE" not in recorded
    assert "TF_CUDNN_WORKSPACE_LIMIT_IN_MB" not in recorded
    assert recipe.gpu_swap.environment is sys.modules["gpu_swap"].environment
