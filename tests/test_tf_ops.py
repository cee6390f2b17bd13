"""The TensorFlow op library (ops/tf/, keras_autovm/mechanisms/tensorflow/ops.py) on the CPU.

CPU kernels are identities, so these tests check what must hold everywhere:
shapes, dtypes and values pass through (the same buffer), in eager and graph
mode; gradients are unchanged; a Keras model trains to the same weights; the
loader's version warning and error messages. The library is built first if
absent (a precondition, not a skip). The GPU side is checked by
recipes/gpu_managed_ops.py on a GPU machine.
"""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_autovm.mechanisms.tensorflow import ops as tf_ops
from keras_autovm.native import build as native_build

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ops():
    # Builds (or finds up to date) the library in the package directory.
    native_build.build_tf_ops()
    return tf_ops.load_library()


def _subprocess(code, **env):
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, cwd=ROOT, timeout=240,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env},
    )
    return proc


DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64,
          tf.bool]
SHAPES = [(), (0,), (7,), (2, 3), (2, 3, 4, 5)]


def _value(dtype, shape):
    n = int(np.prod(shape)) if shape else 1
    base = np.arange(n).reshape(shape) % 5
    return tf.cast(tf.constant(base), dtype)


def _apply(kind, x, targets):
    if kind == "evict":
        return tf_ops.evict(x, targets)
    if kind == "prefetch":
        return tf_ops.prefetch(x, targets, pre_access=True)
    return tf_ops.prefetch_on_backward(x, targets)


KINDS = ["evict", "prefetch", "backward_prefetch"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_identity_eager(ops, kind, dtype, shape):
    x = _value(dtype, shape)
    others = [tf.ones([3, 2]), tf.zeros([5], tf.int32), x]
    for targets in ([], [x], others):
        y = _apply(kind, x, targets)
        assert y.dtype == x.dtype
        assert y.shape == x.shape
        np.testing.assert_array_equal(y.numpy(), x.numpy())


@pytest.mark.parametrize("kind", KINDS)
def test_output_is_the_same_buffer(ops, kind):
    x = tf.random.normal([64, 32])
    y = _apply(kind, x, [x])
    assert int(tf_ops.pointer(y)) == int(tf_ops.pointer(x)) != 0


def test_single_and_nested_targets(ops):
    x = tf.ones([4])
    a, b = tf.zeros([2]), tf.zeros([3, 3], tf.float64)
    for targets in (a, (a, b), {"k": [a, b]}, None):
        np.testing.assert_array_equal(tf_ops.evict(x, targets), x)


@pytest.mark.parametrize("kind", KINDS)
def test_identity_in_tf_function(ops, kind):
    @tf.function
    def f(x, w):
        h = tf.matmul(x, w)
        h = _apply(kind, h, [x, w])
        return tf.nn.relu(h)

    x = tf.random.normal([8, 5], seed=1)
    w = tf.random.normal([5, 3], seed=2)
    expected = tf.nn.relu(tf.matmul(x, w))
    np.testing.assert_array_equal(f(x, w), expected)
    # Stateful ops survive graph optimisation (not folded away).
    graph_ops = {op.type for op in f.get_concrete_function(x, w).graph.get_operations()}
    name = {"evict": "AutovmEvict", "prefetch": "AutovmPrefetch",
            "backward_prefetch": "AutovmBackwardPrefetch"}[kind]
    assert name in graph_ops


def test_constant_inputs_in_tf_function(ops):
    # Constant folding would replace a stateless identity of constants.
    @tf.function
    def f():
        c = tf.constant([1.0, 2.0, 3.0])
        return tf_ops.evict(c * 2.0, [c])

    np.testing.assert_array_equal(f(), [2.0, 4.0, 6.0])


def _loss(x, w1, w2, kind):
    h = tf.tanh(tf.matmul(x, w1))
    if kind is not None:
        h = _apply(kind, h, [x])
        h = tf_ops.evict(h, [h, x])
    return tf.reduce_sum(tf.sin(tf.matmul(h, w2)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_gradients_unchanged(ops, kind, graph):
    x = tf.random.normal([6, 4], seed=3)
    w1 = tf.Variable(tf.random.normal([4, 5], seed=4))
    w2 = tf.Variable(tf.random.normal([5, 2], seed=5))

    def grads(k):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = _loss(x, w1, w2, k)
        return tape.gradient(loss, [x, w1, w2])

    if graph:
        grads = tf.function(grads)
    for got, want in zip(grads(kind), grads(None)):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_gradient_of_targets_is_none(ops):
    x = tf.ones([3])
    t = tf.ones([2])
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, t])
        y = tf.reduce_sum(tf_ops.prefetch_on_backward(tf_ops.evict(x, [t]), [t]))
    assert tape.gradient(y, t) is None
    np.testing.assert_array_equal(tape.gradient(y, x), [1.0, 1.0, 1.0])


def test_backward_prefetch_issues_a_prefetch_in_the_gradient(ops):
    @tf.function
    def step(x, w):
        with tf.GradientTape() as tape:
            tape.watch(w)
            h = tf.matmul(x, w)
            h = tf_ops.prefetch_on_backward(h, [x], pre_access=True)
            loss = tf.reduce_sum(h * h)
        return tape.gradient(loss, w)

    x, w = tf.ones([2, 3]), tf.ones([3, 4])
    graph = step.get_concrete_function(x, w).graph
    prefetches = [op for op in graph.get_operations() if op.type == "AutovmPrefetch"]
    assert len(prefetches) == 1
    assert prefetches[0].get_attr("pre_access") is True
    np.testing.assert_array_equal(step(x, w), np.full([3, 4], 12.0))


def test_stats_untouched_by_cpu_kernels(ops):
    tf_ops.reset_stats()
    x = tf.ones([16])
    tf_ops.evict(x, [x])
    tf_ops.prefetch(x, [x])
    stats = tf_ops.stats()
    assert set(stats) == set(tf_ops.STATS_KEYS)
    assert all(v == 0 for v in stats.values())

    @tf.function
    def in_graph():
        return tf_ops.stats()["errors"]

    assert int(in_graph()) == 0


class _AutovmOps(keras.layers.Layer):
    """Evict, then prefetch-on-backward, its input: an identity in numbers."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_jit = False  # XLA cannot compile the custom ops.

    def call(self, x):
        y = tf_ops.evict(x, [x])
        y = tf_ops.prefetch(y, [x])
        return tf_ops.prefetch_on_backward(y, [x])

    def compute_output_shape(self, input_shape):
        return input_shape


def _cnn(with_ops):
    keras.utils.set_random_seed(7)

    def ops_layer():
        return [_AutovmOps()] if with_ops else []

    layers = [
        keras.Input((8, 8, 3)),
        keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
        *ops_layer(),
        keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
        *ops_layer(),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(2),
    ]
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse",
                  jit_compile=False)
    return model


@pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                    reason="the ops are TensorFlow ops: TF backend only")
def test_keras_training_gives_identical_weights(ops):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8, 8, 3)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    weights = []
    for with_ops in (False, True):
        model = _cnn(with_ops)
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    assert len(weights[0]) == len(weights[1])
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)


def test_version_check_warns_on_mismatch(tmp_path):
    (tmp_path / tf_ops.VERSION_FILE).write_text("0.0.1\nsources=x\n")
    with pytest.warns(RuntimeWarning, match="built for TensorFlow 0.0.1 but TensorFlow 9.9"):
        assert tf_ops.check_version(tmp_path, tf_version="9.9") == "0.0.1"
    (tmp_path / tf_ops.VERSION_FILE).write_text("9.9\n")
    assert tf_ops.check_version(tmp_path, tf_version="9.9") == "9.9"  # silent
    (tmp_path / tf_ops.VERSION_FILE).unlink()
    with pytest.warns(RuntimeWarning, match="is missing"):
        assert tf_ops.check_version(tmp_path, tf_version="9.9") is None


def test_version_mismatch_warning_on_load(ops, tmp_path):
    # A copy whose recorded version was edited, loaded in a fresh process
    # (TensorFlow registers op names once per process).
    shutil.copy(tf_ops.library_path(), tmp_path)
    (tmp_path / tf_ops.VERSION_FILE).write_text("1.0.0\n")
    proc = _subprocess(f"""
        import warnings
        warnings.simplefilter("always")
        import tensorflow as tf
        from keras_autovm.mechanisms.tensorflow import ops as tf_ops
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mod = tf_ops.load_library({str(tmp_path)!r})
        print("WARN", [str(w.message) for w in caught if "keras-autovm" in str(w.message)])
        print("OUT", mod.autovm_evict(tf.ones([2]), []).numpy().tolist())
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "built for TensorFlow 1.0.0 but TensorFlow " + tf.__version__ in proc.stdout
    assert "OUT [1.0, 1.0]" in proc.stdout


def test_missing_library_message(tmp_path):
    with pytest.raises(ImportError, match=r"was not found\. Build it with "
                       r"`python -m keras_autovm\.native\.build`"):
        tf_ops.load_library(tmp_path)


def test_missing_tensorflow_message():
    proc = _subprocess("""
        import sys
        sys.modules["tensorflow"] = None  # as if not installed
        from keras_autovm.mechanisms.tensorflow import ops as tf_ops
        try:
            tf_ops.evict(1, [])
        except ImportError as e:
            print("ERR", e)
    """, KERAS_BACKEND="jax")  # Keras itself would import TensorFlow.
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERR keras_autovm.mechanisms.tensorflow.ops needs TensorFlow, which is not installed" in proc.stdout
    assert "python -m keras_autovm.native.build" in proc.stdout


def test_failed_op_build_is_an_error(tmp_path, monkeypatch):
    shutil.copytree(ROOT / "ops", tmp_path / "ops")
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(native_build.BuildError, match="command failed"):
        native_build.build_all(out_dir=tmp_path / "out", sources=tmp_path / "ops")
    assert not (tmp_path / "out" / "_autovm_ops.so").exists()


@pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                    reason="the build does not depend on the Keras backend; "
                    "it runs once, under the TensorFlow backend")
def test_build_from_a_fresh_copy(tmp_path):
    # The sources and the build script alone, outside the checkout.
    shutil.copytree(ROOT / "ops", tmp_path / "ops")
    shutil.copy(ROOT / "keras_autovm" / "native" / "build.py", tmp_path / "build.py")
    out = tmp_path / "out"
    build = [sys.executable, str(tmp_path / "build.py"), "--out", str(out),
             "--sources", str(tmp_path / "ops"), "--only", "tf"]
    proc = subprocess.run(build, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "_autovm_ops.so").is_file()
    recorded = (out / "_autovm_ops.tf_version").read_text().splitlines()
    assert recorded[0] == tf.__version__
    # Up to date: a second run does not rebuild.
    mtime = (out / "_autovm_ops.so").stat().st_mtime_ns
    proc = subprocess.run(build, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert (out / "_autovm_ops.so").stat().st_mtime_ns == mtime
    # It loads and runs in a fresh process.
    proc = _subprocess(f"""
        import tensorflow as tf
        m = tf.load_op_library({str(out / "_autovm_ops.so")!r})
        x = tf.constant([1, 2, 3])
        print("OUT", m.autovm_prefetch(x, [x], pre_access=True).numpy().tolist(),
              m.autovm_stats().numpy().tolist())
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OUT [1, 2, 3] [0, 0, 0, 0, 0]" in proc.stdout
