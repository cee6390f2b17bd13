"""The private framework names keras-autovm relies on, all in one module.

If a pinned framework version moves, the first test fails: read
keras_autovm/internals.py (and its backend halves) again against the new version, then update
`CHECKED_VERSIONS`. The other tests exercise each reach.
"""

import contextlib
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from conftest import BACKEND, data, skip_model, small_cnn, tf_rewrite_options
from keras_autovm import internals
from keras_autovm.mechanisms.tensorflow import internals as tf_internals

ROOT = Path(__file__).resolve().parents[1]
# Names behind a framework's public API, allowed in internals.py only.
PRIVATE = re.compile(r"keras\.src|_keras_history|_inbound_nodes|_nodes_by_depth"
                     r"|_call_has_training_arg|_seed_generators|_flatten_layers"
                     r"|_getframe|_context_handle|\._functional\b|tensorflow\.python")


@pytest.mark.parametrize("package", sorted(internals.CHECKED_VERSIONS))
def test_installed_versions_are_the_checked_ones(package):
    try:
        installed = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{package} is not installed")
    installed = installed.split("+")[0]  # torch's local tag, e.g. +cpu
    assert installed in internals.CHECKED_VERSIONS[package], (
        f"{package} {installed} is installed, but keras_autovm/internals.py "
        f"was checked against {internals.CHECKED_VERSIONS[package]}: re-read "
        "every reach there against the new version, then update "
        "CHECKED_VERSIONS.")


def test_no_private_names_outside_internals():
    offenders = []
    for path in (ROOT / "keras_autovm").rglob("*.py"):
        if path.name == "internals.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_functional_of():
    seq, fn = small_cnn(), skip_model()
    assert internals.functional_of(seq) is seq._functional
    assert internals.functional_of(fn) is fn
    assert internals.functional_of(keras.Sequential([keras.layers.Dense(2)])) is None


def test_execution_nodes_run_in_keras_order():
    model = skip_model()
    ran = []
    model._run_through_graph(
        model.inputs, operation_fn=lambda op: ran.append(op.name) or op,
        call_fn=lambda op, *a, **k: [None] * len(keras.tree.flatten(op.output)))
    assert [n.operation.name for n in internals.execution_nodes(model)] == ran


def test_producer_and_num_outputs():
    inputs = keras.Input((4,), name="x")
    dense = keras.layers.Dense(2, name="d")
    y = dense(inputs)
    assert internals.producer(y) is dense
    assert internals.num_outputs(dense) == 1
    assert internals.num_outputs(keras.layers.Dense(2)) is None


def test_random_layers_and_training_argument():
    assert internals.draws_random_numbers(keras.layers.Dropout(0.5))
    assert not internals.draws_random_numbers(keras.layers.Dense(2))
    assert internals.call_takes_training(keras.layers.BatchNormalization())
    assert not internals.call_takes_training(keras.layers.Flatten())


def test_keras_call_training_is_read_and_restored():
    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            seen.append(internals.keras_call_training())
            return keras.layers.Dropout(0.999, seed=1)(x)

    probe = Probe()
    x = np.ones((4, 64), "float32")
    assert internals.keras_call_training() is None
    keras.Sequential([keras.Input((64,)), probe])(x, training=True)
    assert seen[-1] is True  # (The first call built the model: None.)
    # Outside any model call, a sublayer learns `training` only from the set.
    assert np.all(keras.ops.convert_to_numpy(probe(x)) == 1.0)
    with internals.keras_call_training_set(True):
        dropped = keras.ops.convert_to_numpy(probe(x))
    assert seen[-1] is True and np.mean(dropped == 0.0) > 0.9
    assert internals.keras_call_training() is None


def test_uncompiled_restores_the_flag():
    model = small_cnn()
    model.compile("sgd", "mse")
    with internals.uncompiled(model):
        assert model.compiled is False
    assert model.compiled is True


@pytest.mark.skipif(BACKEND != "jax", reason="the JAX trainer's loss function")
def test_jax_loss_function_exists():
    assert callable(getattr(type(small_cnn()), internals.JAX_LOSS_FUNCTION))


def test_running_fit_finds_the_iterator_and_callbacks():
    found = {}

    class Look(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            found.update(internals.running_fit())

    model = small_cnn()
    model.compile("sgd", "mse")
    model.fit(*data(16), batch_size=4, epochs=1, verbose=0, callbacks=[Look()])
    assert internals.batch_size_of(found["epoch_iterator"]) == 4
    assert any(isinstance(c, Look) for c in found["callbacks"].callbacks)
    assert internals.running_fit() == {}


def _generator():
    x, y = data(32)
    while True:
        for i in range(0, 32, 8):
            yield x[i:i + 8], y[i:i + 8]


def _tf_dataset():
    import tensorflow as tf
    # `.batch(8)` may leave a partial batch: no static batch size.
    return tf.data.Dataset.from_tensor_slices(data(30)).batch(8)


@pytest.mark.parametrize("make_data", [
    _generator,
    pytest.param(_tf_dataset, marks=pytest.mark.skipif(
        BACKEND != "tensorflow", reason="tf.data on its own backend")),
])
def test_batch_size_of_data_without_a_static_size(make_data, monkeypatch):
    import keras_autovm

    # What fit's data says before training; on JAX and torch the traced
    # batch would tell the runtime anyway, so check this read itself.
    found, read = [], internals.batch_size_of
    monkeypatch.setattr(internals, "batch_size_of",
                        lambda iterator: found.append(read(iterator)) or found[-1])
    model = small_cnn()
    model.compile("sgd", "mse")
    callback = keras_autovm.AutoVM(budget="64MiB", apply_without_gpu=True,
                                   verbose=0)
    model.fit(make_data(), steps_per_epoch=3, epochs=1, verbose=0,
              callbacks=[callback])
    assert found == [8] and callback.plan.graph.batch_size == 8


def test_ends_epoch():
    class OutOfRangeError(Exception):  # tf.errors.OutOfRangeError by name.
        pass

    assert internals.ends_epoch(StopIteration())
    assert internals.ends_epoch(OutOfRangeError())
    assert not internals.ends_epoch(ValueError())


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's context")
def test_tf_pending_config_merges_before_start_only():
    code = ("import tensorflow as tf\n"
            "from keras_autovm.mechanisms.tensorflow import internals as tf_internals\n"
            "c = tf.compat.v1.ConfigProto()\n"
            "c.gpu_options.per_process_gpu_memory_fraction = 0.25\n"
            "print(tf_internals.tf_merge_pending_config(c))\n"
            "tf.constant(1.0) + 1\n"
            "print(tf_internals.tf_merge_pending_config(c))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "False"]


@pytest.mark.skipif(BACKEND == "tensorflow", reason="checks the other backends")
def test_no_tensorflow_import_on_jax_and_torch():
    """AutoVM's whole path (plan, fit, report) imports no TensorFlow."""
    code = ("import sys, numpy as np, keras, keras_autovm, tempfile\n"
            "from conftest import small_cnn, data\n"
            "m = small_cnn(); m.compile('adam', 'mse')\n"
            "keras_autovm.plan(m, 8, budget='1GiB').summary(print_fn=lambda s: None)\n"
            "cb = keras_autovm.AutoVM(budget='1GiB', verbose=0, apply_without_gpu=True,"
            " policy='sqrt_recompute', report_dir=tempfile.mkdtemp(),"
            " log_dir=tempfile.mkdtemp())\n"
            "m.fit(*data(16), batch_size=8, epochs=1, verbose=0, callbacks=[cb])\n"
            "print('TF', 'tensorflow' in sys.modules)\n")
    env = dict(os.environ, KERAS_BACKEND=BACKEND,
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "TF False" in proc.stdout


def test_clone_for_routing_leaves_compile_state_alone():
    model = small_cnn()
    model.compile(optimizer="adam", loss="mse")
    optimizer = model.optimizer
    with internals.uncompiled(model):
        clone = keras.models.clone_model(model)
    assert not clone.compiled and model.compiled and model.optimizer is optimizer
    np.testing.assert_array_equal(model.predict(data(2)[0], verbose=0).shape, (2, 4))


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's tape and graphs")
def test_tf_tape_reaches():
    import tensorflow as tf

    x, v = tf.constant(3.0), tf.Variable(2.0)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        with tf_internals.tf_stop_recording():
            unrecorded = x * 5.0
        with tf_internals.tf_variable_watcher() as watcher:
            y = tf.identity(x * v)
        marked = tf.identity(x)
        tf_internals.tf_record_operation("Doubles", [marked], [x], lambda g: [2.0 * g])
    assert tape.gradient(unrecorded, x) is None
    assert [w.name for w in watcher.watched_variables()] == [v.name]
    assert float(tape.gradient(y, v)) == 3.0
    assert float(tape.gradient(marked, x)) == 2.0


@pytest.mark.skipif(BACKEND != "tensorflow", reason="Keras's TensorFlow losses")
def test_tf_logits_are_where_keras_losses_find_them():
    import tensorflow as tf

    # Saturated: from the probabilities the loss clips, from the logits not.
    logits = tf.constant([[60.0, 0.0, -60.0]])
    target = tf.constant([[0.0, 0.0, 1.0]])
    from_logits = {
        "categorical": tf.nn.softmax_cross_entropy_with_logits(target, logits),
        "binary": tf.nn.sigmoid_cross_entropy_with_logits(target, logits)}

    @tf.function
    def found():
        l = tf.identity(logits)
        attached, softmax, sigmoid = (keras.activations.softmax(l), tf.nn.softmax(l),
                                      tf.math.sigmoid(l))
        assert tf_internals.tf_logits(attached) is l
        assert tf_internals.tf_op_logits(attached) == (None, None)
        assert tf_internals.tf_logits(softmax) is None
        assert tf_internals.tf_op_logits(softmax) == ("Softmax", l)
        assert tf_internals.tf_op_logits(sigmoid) == ("Sigmoid", l)
        other = tf.identity(softmax)
        tf_internals.tf_set_logits(other, l)
        assert tf_internals.tf_logits(other) is l
        assert tf_internals.tf_op_logits(l) == (None, None)
        probabilities = tf.identity(softmax)  # No longer made by the op.
        return {"categorical": keras.ops.categorical_crossentropy(target, softmax),
                "categorical_of_probabilities": keras.ops.categorical_crossentropy(
                    target, probabilities),
                "binary": keras.ops.binary_crossentropy(target, sigmoid),
                "binary_of_softmax": keras.ops.binary_crossentropy(target, softmax),
                "binary_of_probabilities": keras.ops.binary_crossentropy(
                    target, probabilities)}

    losses = found()
    np.testing.assert_array_equal(losses["categorical"], from_logits["categorical"])
    np.testing.assert_array_equal(losses["binary"], from_logits["binary"])
    assert not np.allclose(losses["categorical_of_probabilities"], losses["categorical"])
    # Each loss reads only its own op's logits: binary cross-entropy reads a
    # softmax's probabilities.
    np.testing.assert_array_equal(losses["binary_of_softmax"],
                                  losses["binary_of_probabilities"])
    assert tf_internals.tf_op_logits(tf.nn.softmax(logits)) == (None, None)  # Eager.


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's graphs")
def test_tf_replace_input_and_function_graphs():
    import tensorflow as tf

    @tf.function
    def f(a, b):
        total = tf.add(a, a, name="total")
        tf_internals.tf_replace_input(total.op, 1, b)
        return total

    # Graphs of the functions TensorFlow instantiates during the call.
    graphs = tf_internals.tf_function_graphs(f, tf.constant(1.0), tf.constant(10.0))
    assert float(f(tf.constant(1.0), tf.constant(10.0))) == 11.0
    assert graphs and all(g.pre_optimization_graph.node and g.partition_graphs
                          for g in graphs)
    assert any(n.op == "AddV2" for g in graphs for n in g.post_optimization_graph.node)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's function options")
def test_tf_grappler_swapping_off_keeps_the_rest_of_the_config():
    import tensorflow as tf
    from tensorflow.core.protobuf import rewriter_config_pb2

    before = tf_rewrite_options()
    with pytest.raises(RuntimeError):
        with tf_internals.tf_grappler_swapping_off():
            inside = tf_rewrite_options()
            value = float(tf.function(lambda a: a * 2)(tf.constant(3.0)))
            raise RuntimeError("the options come back on errors too")
    assert inside.memory_optimization == rewriter_config_pb2.RewriterConfig.SCHEDULING_HEURISTICS
    inside.memory_optimization = before.memory_optimization
    assert inside == before  # Nothing else changed.
    assert value == 6.0
    assert tf_rewrite_options() == before


def test_uncast_value_is_the_variables_own_tensor():
    seen = []

    class Probe(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(2,), initializer="ones")

        def call(self, x):
            seen.append([keras.backend.standardize_dtype(t.dtype)
                         for t in (self.w.value, internals.uncast_value(self.w))])
            return x

    Probe(dtype="mixed_bfloat16")(np.ones((1, 2), "float32"))
    assert seen == [["bfloat16", "float32"]]


def test_output_specs_sizes_every_call_and_adds_no_node():
    x = keras.Input((None, 3))
    dense = keras.layers.Dense(4)
    y = keras.layers.ReLU()(dense(x))
    model = keras.Model(x, y)
    calls = len(dense._inbound_nodes)
    specs = internals.output_specs(model, [keras.KerasTensor((2, 5, 3))])
    assert tuple(specs[id(y)].shape) == (2, 5, 4)
    assert len(dense._inbound_nodes) == calls


def test_has_keras_mask_sees_what_a_masking_layer_sets():
    from keras_autovm import internals
    masked = keras.layers.Embedding(5, 2, mask_zero=True)(np.array([[1, 0]]))
    assert internals.has_keras_mask(([masked], {}))
    assert not internals.has_keras_mask((keras.ops.ones((1, 2)), 3))


def test_float64_results_keeps_float64_and_restores():
    # Keras maps float64 results to float32 on JAX and torch, not on
    # TensorFlow (keras/src/backend/common/dtypes.py).
    before = "float64" if BACKEND == "tensorflow" else "float32"
    assert keras.backend.result_type("float64", "float32") == before
    with internals.float64_results():
        assert keras.backend.result_type("float64", "float32") == "float64"
        assert keras.backend.result_type("float64", "int32") == "float64"
    assert keras.backend.result_type("float64", "float32") == before
    with pytest.raises(RuntimeError):
        with internals.float64_results():
            raise RuntimeError
    assert keras.backend.result_type("float64", "float32") == before


def test_torch_allocator_settings_are_reachable():
    if keras.backend.backend() != "torch":
        pytest.skip("torch's allocator")
    import torch
    assert callable(torch.cuda.memory._set_allocator_settings)


def _conv_run(layer, x, views):
    """A conv or pooling layer's output, its gradients, the bytes autograd
    saves outside the input's own storage, and the layouts (strides) of the
    output and the input's gradient, with or without the views."""
    import torch
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    inputs = torch.tensor(x, requires_grad=True)
    context = (internals.torch_inputs_on_views() if views
               else contextlib.nullcontext())
    with context, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(inputs)
    grads = torch.autograd.grad((y * y).sum(), [inputs] + [v.value for v in layer.weights])
    own = inputs.untyped_storage().data_ptr()
    other = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    other.pop(own, None)
    other.pop(y.untyped_storage().data_ptr(), None)  # What the activation saves.
    layouts = (y.stride(), grads[0].stride())
    return y.detach().numpy(), [g.numpy() for g in grads], sum(other.values()), layouts


@pytest.mark.skipif(BACKEND != "torch", reason="Keras's torch convolution")
@pytest.mark.parametrize("layer,shape,padded", [
    (lambda: keras.layers.Conv2D(6, 3, padding="same", activation="relu"), (2, 12, 12, 4), 0),
    (lambda: keras.layers.Conv2D(6, 3, strides=2), (2, 12, 12, 4), 0),
    (lambda: keras.layers.Conv2D(6, 3, padding="same", groups=2), (2, 12, 12, 4), 0),
    (lambda: keras.layers.Conv3D(3, 3, padding="same"), (2, 6, 6, 6, 2), 0),
    (lambda: keras.layers.MaxPooling2D(), (2, 12, 12, 4), 0),
    (lambda: keras.layers.MaxPooling2D(3, 2, padding="same"), (2, 13, 13, 4), 0),
    # Padding (0, 1): Keras pads the input itself (replicate), a 13 x 13
    # copy saved both ways.
    (lambda: keras.layers.MaxPooling2D(3, 2, padding="same"), (2, 12, 12, 4), 2 * 13 * 13 * 4),
    (lambda: keras.layers.MaxPooling3D(), (2, 6, 6, 6, 2), 0),
], ids=["2d_same_relu", "2d_strided", "2d_groups", "3d", "pool", "pool_3_2_same",
        "pool_3_2_same_uneven", "pool_3d"])
def test_torch_inputs_on_views_computes_the_same_without_a_copy(layer, shape, padded):
    from keras.src.backend.torch import nn
    keras_own = (nn.conv, nn.max_pool, nn._transpose_spatial_inputs,
                 nn._transpose_spatial_outputs)
    layer = layer()
    layer.build(shape)
    x = np.random.default_rng(0).normal(size=shape).astype("float32")
    y0, grads0, copied0, layouts0 = _conv_run(layer, x, views=False)
    y1, grads1, copied1, layouts1 = _conv_run(layer, x, views=True)
    np.testing.assert_array_equal(y1, y0)
    assert layouts1 == layouts0  # What reads them next sums in Keras's order.
    for g1, g0 in zip(grads1, grads0):
        np.testing.assert_array_equal(g1, g0)
    # Keras's own saves a copy of the input (4 bytes a value) beside the
    # kernel's or the pooling's indices; the views leave only those
    # (smaller than the input) and, where Keras pads, the padded copy.
    assert copied0 - copied1 >= x.size * 4
    assert copied1 < (x.size + padded) * 4
    assert (nn.conv, nn.max_pool, nn._transpose_spatial_inputs,
            nn._transpose_spatial_outputs) == keras_own  # Put back.


@pytest.mark.skipif(BACKEND != "torch", reason="Keras's torch convolution")
def test_torch_inputs_on_views_leaves_the_layouts_downstream_as_keras_has_them():
    """Reductions after a convolution (batch norm, pooling, a bias's
    gradient) sum in the order of their input's layout: the views must hand
    them Keras's layouts, forward and backward, or the numbers move."""
    import torch
    model = keras.Sequential([
        keras.Input((14, 14, 3)),
        keras.layers.Conv2D(6, 3, padding="same", activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.MaxPooling2D(),
        keras.layers.BatchNormalization(),
        keras.layers.ZeroPadding2D(),  # ResNet's first pooling.
        keras.layers.MaxPooling2D(3, 2),
        keras.layers.BatchNormalization(),
        keras.layers.Conv2D(6, 3, strides=2, padding="same"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(3)])
    x = np.random.default_rng(1).normal(size=(4, 14, 14, 3)).astype("float32")

    def grads(views):
        inputs = torch.tensor(x, requires_grad=True)
        context = (internals.torch_inputs_on_views() if views
               else contextlib.nullcontext())
        with context:
            y = model(inputs, training=True)
        weights = [v.value for v in model.trainable_variables]
        return [t.numpy() for t in torch.autograd.grad((y * y).sum(), [inputs] + weights)]

    for with_views, without in zip(grads(True), grads(False)):
        np.testing.assert_array_equal(with_views, without)


@pytest.mark.skipif(BACKEND != "torch", reason="Keras's torch convolution")
def test_torch_inputs_on_views_nests_and_keeps_keras_own():
    from keras.src.backend.torch import nn
    own = (nn.conv, nn.max_pool, nn._transpose_spatial_inputs, nn._transpose_spatial_outputs)
    with internals.torch_inputs_on_views():
        wrapped = (nn.conv, nn.max_pool)
        with internals.torch_inputs_on_views():
            assert (nn.conv, nn.max_pool) == wrapped  # Entering again changes nothing.
        assert (nn.conv, nn.max_pool) == wrapped
    assert (nn.conv, nn.max_pool, nn._transpose_spatial_inputs,
            nn._transpose_spatial_outputs) == own


@pytest.mark.skipif(BACKEND != "torch", reason="Keras's torch convolution")
def test_torch_inputs_on_views_puts_keras_own_back_while_another_thread_convolves():
    """A fit that ends while another thread is inside a wrapped `conv`, and
    a fit that starts then: Keras's own transpose comes back, not the view."""
    import threading

    from keras.src.backend.torch import nn
    transpose = nn._transpose_spatial_inputs
    inside, leave = threading.Event(), threading.Event()

    def kernel_then_wait(kernel):  # Runs inside the wrapped `conv`.
        inside.set()
        leave.wait(10)
        return kernel

    layer = keras.layers.Conv2D(2, 3)
    layer.build((1, 5, 5, 1))
    first = internals.torch_inputs_on_views()
    first.__enter__()
    keras_kernel = nn._transpose_conv_kernel
    nn._transpose_conv_kernel = lambda k: keras_kernel(kernel_then_wait(k))
    thread = threading.Thread(target=layer, args=(np.ones((1, 5, 5, 1), "float32"),))
    try:
        thread.start()
        assert inside.wait(10)
        first.__exit__(None, None, None)
        nn._transpose_conv_kernel = keras_kernel
        with internals.torch_inputs_on_views():  # Entered mid-call.
            leave.set()
            thread.join(10)
            layer(np.ones((1, 5, 5, 1), "float32"))  # Puts back what it took as Keras's.
    finally:
        nn._transpose_conv_kernel = keras_kernel
        leave.set()
        thread.join(10)
    assert nn._transpose_spatial_inputs is transpose


@pytest.mark.skipif(BACKEND != "torch", reason="Keras's torch convolution")
def test_torch_max_pool_on_views_compiles_without_a_graph_break():
    import torch
    layer = keras.layers.MaxPooling2D()
    x = torch.randn(2, 8, 8, 3, requires_grad=True)
    with internals.torch_inputs_on_views():
        compiled = torch.compile(lambda t: layer(t), backend="aot_eager", fullgraph=True)
        y = compiled(x)
    np.testing.assert_array_equal(y.detach().numpy(), layer(x).detach().numpy())
