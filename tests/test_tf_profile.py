"""TensorFlow: each layer call's transient memory, measured
(keras_autovm/mechanisms/tensorflow/profile.py). Measured on the CPU's
allocator here, which counts what it hands out as a GPU's does."""

import keras
import numpy as np
import pytest

import keras_autovm
from conftest import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's allocator")


@keras.saving.register_keras_serializable(package="test_tf_profile")
class Scratch(keras.layers.Layer):
    """Its forward makes `copies` temporaries the size of its input, all
    live at once, that it does not keep (a sum of distinct products)."""

    def __init__(self, copies, **kwargs):
        super().__init__(**kwargs)
        self.copies = copies

    def call(self, x):
        import tensorflow as tf
        parts = [x * float(i + 2) for i in range(self.copies)]
        with tf.control_dependencies(parts):  # All made before any is summed.
            return tf.add_n([tf.reduce_sum(p, axis=-1, keepdims=True) for p in parts])


def model(copies=(4, 1)):
    inputs = keras.Input((64, 64, 8))
    x = Scratch(copies[0], name="wide")(inputs)
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv")(x)
    x = Scratch(copies[1], name="narrow")(x)
    return keras.Model(inputs, keras.layers.Flatten(name="flat")(x))


def test_temporaries_are_measured_per_call_at_the_batch_planned():
    from keras_autovm.mechanisms.tensorflow import profile
    measured = profile.measure(model(), 4, where="CPU:0")
    assert measured.batch_size == 4
    per_sample = {name: measured.at(name, 1) for name in measured.by_op}
    one = 64 * 64 * 8 * 4  # Bytes of one sample of `wide`'s input.
    # At least the forward's four temporaries of the input's size at once
    # (the backward may hold more, as the executor orders its ops), and one
    # for `narrow`, whose input is the same size.
    assert 3.5 * one <= per_sample["wide"] <= 9 * one
    assert 0.5 * one <= per_sample["narrow"] <= 3 * one
    assert per_sample["narrow"] < per_sample["wide"]


def test_measured_transients_become_workspace(monkeypatch):
    from keras_autovm.mechanisms.tensorflow import mechanism as tf_mechanism
    from keras_autovm.mechanisms.tensorflow import profile
    net = model()
    monkeypatch.setattr(profile, "device", lambda: "CPU:0")
    mech = tf_mechanism.TensorFlowMechanism()
    graph = keras_autovm.budget.graph_for(net, 16, mech)
    ops = {op.name: op for op in graph.ops}
    plain = {op.name: op for op in keras_autovm.budget.build_graph(net, 16).ops}
    assert ops["wide"].workspace_bytes > 3 * 16 * 64 * 64 * 8 * 4
    assert plain["wide"].workspace_bytes == 0
    # Measured once per model, at the first batch size; other batch sizes
    # in proportion.
    monkeypatch.setattr(profile, "_run", lambda *a: pytest.fail("measured twice"))
    assert keras_autovm.budget.graph_for(net, 16, mech).ops == graph.ops
    doubled = {op.name: op for op in keras_autovm.budget.graph_for(net, 32, mech).ops}
    assert abs(doubled["wide"].workspace_bytes - 2 * ops["wide"].workspace_bytes) <= 1


def test_a_batch_that_runs_out_of_memory_is_measured_at_half(monkeypatch):
    import tensorflow as tf

    from keras_autovm.mechanisms.tensorflow import profile
    tried = []

    def run(model, batch_size, shapes, where):
        tried.append(batch_size)
        if batch_size > 8:
            raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating")
        return {"wide": 100 * batch_size}

    monkeypatch.setattr(profile, "_run", run)
    measured = profile.measure(model(), 40, where="CPU:0")
    assert tried == [40, 20, 10, 5] and measured.at("wide", 40) == 4000


def test_without_a_gpu_nothing_is_measured(monkeypatch):
    from keras_autovm.mechanisms.tensorflow import profile
    monkeypatch.setattr(profile, "_run", lambda *a: pytest.fail("measured without a GPU"))
    assert profile.measure(model(), 4) is None
    graph = keras_autovm.budget.build_graph(model(), 4)
    assert profile.adjust(graph, None) is graph


def test_measuring_changes_no_state():
    from keras_autovm.mechanisms.tensorflow import profile
    net = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="d"),
                            keras.layers.BatchNormalization(name="bn")])
    before = [keras.ops.convert_to_numpy(v) for v in net.variables]
    profile.measure(net, 4, where="CPU:0")
    for old, new in zip(before, net.variables):
        np.testing.assert_array_equal(old, keras.ops.convert_to_numpy(new))
