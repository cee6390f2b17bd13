"""TensorBoard summaries, read back with TensorFlow's own reader.

The reader runs in a child process: on JAX and torch the test process keeps
TensorFlow out, as AutoVM does.
"""

import json
import os
import subprocess
import sys

import keras
import pytest

import keras_autovm
from keras_autovm import summaries
from conftest import BACKEND, data, small_cnn

_READ = """
import json, sys, glob
import tensorflow as tf
out = []
for path in sorted(glob.glob(sys.argv[1] + "/**/events.out.tfevents.*", recursive=True)):
    for event in tf.compat.v1.train.summary_iterator(path):
        for v in event.summary.value:
            if v.metadata.plugin_data.plugin_name == "text":
                out.append([path, event.step, v.tag, "text",
                            v.metadata.plugin_data.plugin_name,
                            v.tensor.string_val[0].decode()])
            elif v.HasField("tensor"):  # Keras's TensorBoard callback.
                out.append([path, event.step, v.tag, "tensor"])
            else:
                out.append([path, event.step, v.tag, "scalar", v.simple_value])
print(json.dumps(out))
"""


def _read_events(log_dir):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _READ, str(log_dir)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fit(callbacks):
    keras.utils.set_random_seed(2)
    model = small_cnn()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(*data(16), batch_size=8, epochs=2, callbacks=callbacks, verbose=0)


def test_crc32c_known_value():
    # The check value of CRC-32C (RFC 3720, B.4).
    assert summaries.crc32c(b"123456789") == 0xE3069283


def _autovm(**kwargs):
    return keras_autovm.AutoVM(budget="8MiB", policy="sqrt_recompute",
                               apply_without_gpu=True, verbose=0, **kwargs)


def test_log_dir_gets_epoch_scalars_and_the_plan(tmp_path):
    callback = _autovm(log_dir=str(tmp_path))
    _fit([callback])
    events = _read_events(tmp_path)
    assert {os.path.basename(os.path.dirname(e[0])) for e in events} == {"autovm"}
    scalars = {(e[1], e[2]): e[4] for e in events if e[3] == "scalar"}
    for epoch, record in enumerate(callback.report.epochs):
        assert scalars[(epoch, "autovm/predicted_peak_bytes")] == pytest.approx(
            record["predicted_peak_bytes"], rel=1e-6)
        assert scalars[(epoch, "autovm/step_time_s")] == pytest.approx(
            record["step_time"], rel=1e-6)
        assert (epoch, "autovm/predicted_step_time_s") in scalars
        assert (epoch, "autovm/planned_host_bytes_per_epoch") in scalars
        assert (epoch, "autovm/replans") in scalars
    # No GPU: no measured peak to write.
    assert not any(tag == "autovm/measured_peak_bytes" for _, tag in scalars)
    texts = [e for e in events if e[3] == "text"]
    assert texts and texts[0][1:5] == [0, "autovm/plan", "text", "text"]
    assert "Policy: sqrt_recompute" in texts[0][5]


def test_tensorboard_callback_log_dir_is_used(tmp_path):
    board = keras.callbacks.TensorBoard(log_dir=str(tmp_path), write_graph=False,
                                        profile_batch=0)
    _fit([_autovm(), board])
    runs = {os.path.basename(os.path.dirname(e[0])) for e in _read_events(tmp_path)}
    assert "autovm" in runs and "train" in runs, runs


def test_measured_peak_and_host_traffic_are_written(tmp_path):
    # What a GPU measures, written as an epoch record carries it.
    plan = keras_autovm.plan(small_cnn(), 8, budget="8MiB", policy="keep_all")
    record = {"predicted_peak_bytes": plan.result.peak_bytes, "peak_bytes": 3 * 2**20,
              "step_time": 0.01, "predicted_step_time": 0.02,
              "planned_host_bytes_per_epoch": 0}
    summaries.EpochSummaries(str(tmp_path)).epoch(
        0, record, plan, {"to_host": 1000, "to_device": 24, "skipped_tensors": 5})
    scalars = {e[2]: e[4] for e in _read_events(tmp_path) if e[3] == "scalar"}
    assert scalars["autovm/measured_peak_bytes"] == 3 * 2**20
    assert scalars["autovm/measured_host_bytes"] == 1024  # Tensor counts left out.


def test_host_traffic_of_a_swap_plan_is_written(tmp_path, swap_small_tensors):
    callback = keras_autovm.AutoVM(budget="8MiB", policy="offload_all",
                                   apply_without_gpu=True, verbose=0, log_dir=str(tmp_path))
    _fit([callback])
    scalars = {(e[1], e[2]): e[4] for e in _read_events(tmp_path) if e[3] == "scalar"}
    stats = callback.report.stats
    if BACKEND == "tensorflow":  # Explicit copies: TensorFlow does not count them.
        assert not any(tag == "autovm/measured_host_bytes" for _, tag in scalars)
        return
    moved = stats["measured_bytes_to_host"] + stats["measured_bytes_to_device"]
    assert moved > 0
    assert scalars[(1, "autovm/measured_host_bytes")] == moved  # Both epochs, so far.
    assert 0 < scalars[(0, "autovm/measured_host_bytes")] < moved
