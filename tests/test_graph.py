"""Tests for `keras_autovm.model_graph`: Keras model -> planner `Graph`."""

import keras
import numpy as np
import pytest
from keras import layers

from keras_autovm import model_graph as graph_lib
from keras_autovm.model_graph import build_graph

BACKEND = keras.backend.backend()
F32 = 4


def _by_name(graph):
    return graph.tensor_map, {op.name: op for op in graph.ops}


def _keras_order(model):
    """Op names in the order Keras's own graph runner visits them."""
    fn = model._functional if isinstance(model, keras.Sequential) else model
    seen = []

    def record(op):
        seen.append(op.name)
        return op

    def no_compute(op, *args, **kwargs):
        return [None] * len(keras.tree.flatten(op.output))

    fn._run_through_graph(fn.inputs, operation_fn=record, call_fn=no_compute)
    return seen


def _assert_topological(graph):
    index = graph.op_index
    producer = {t.name: t.producer for t in graph.tensors}
    for i, op in enumerate(graph.ops):
        for name in op.inputs:
            assert index[producer[name]] < i, (op.name, name)
        for name in op.outputs:
            assert producer[name] == op.name


def _small_cnn():
    return keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            layers.Conv2D(4, 3, padding="same", activation="relu", name="conv"),
            layers.MaxPooling2D(2, name="pool"),
            layers.Flatten(name="flat"),
            layers.Dense(10, name="fc"),
        ],
        name="small_cnn",
    )


def test_sequential_cnn_sizes_readers_and_flops():
    graph = build_graph(_small_cnn(), batch_size=2)
    tensors, ops = _by_name(graph)
    assert [op.name for op in graph.ops] == ["conv", "pool", "flat", "fc"]
    assert graph.batch_size == 2
    # 2 x 8x8x4 float32, then pooled to 4x4x4, flattened to 64, then 10.
    assert tensors["conv"].nbytes == 2 * 8 * 8 * 4 * F32
    assert tensors["pool"].nbytes == 2 * 4 * 4 * 4 * F32
    assert tensors["flat"].nbytes == 2 * 64 * F32
    assert tensors["fc"].nbytes == 2 * 10 * F32
    assert tensors["conv"].fwd_readers == ("pool",)
    assert tensors["fc"].fwd_readers == ()  # model output
    # Fused relu reads conv's output; max pooling reads input and output;
    # flatten nothing; the linear Dense only its input.
    assert tensors["conv"].bwd_readers == ("conv", "pool")
    assert tensors["pool"].bwd_readers == ("pool",)
    assert tensors["flat"].bwd_readers == ("fc",)
    assert tensors["fc"].bwd_readers == ()
    assert ops["conv"].inputs == ()  # the model input is not tagged
    assert ops["pool"].inputs == ("conv",)
    assert ops["conv"].flops == 2 * (2 * 8 * 8 * 4) * (3 * 3 * 3)
    assert ops["fc"].flops == 2 * (2 * 10) * 64
    assert ops["pool"].flops == 0
    assert ops["pool"].mem_bytes == (2 * 8 * 8 * 4 + 2 * 4 * 4 * 4) * F32
    assert ops["conv"].kind == "Conv2D"
    weights = (3 * 3 * 3 * 4 + 4 + 64 * 10 + 10) * F32
    batch = 2 * 8 * 8 * 3 * F32
    targets = 2 * 10 * F32
    # Weights, gradients, two Adam slots (estimate: no optimizer given).
    assert graph.persistent_bytes == 4 * weights + batch + targets
    sgd = build_graph(_small_cnn(), batch_size=2, optimizer="sgd")
    assert sgd.persistent_bytes == 2 * weights + batch + targets


def _skip_concat_model():
    inputs = keras.Input((8, 8, 3), name="x")
    c1 = layers.Conv2D(4, 1, name="c1")(inputs)
    a = layers.ReLU(name="a")(c1)
    c2 = layers.Conv2D(4, 3, padding="same", name="c2")(a)
    add = layers.Add(name="add")([a, c2])
    cat = layers.Concatenate(name="cat")([add, a])
    mul = layers.Multiply(name="mul")([cat, cat])
    pooled = layers.GlobalAveragePooling2D(name="gap")(mul)
    outputs = layers.Dense(3, activation="softmax", name="fc")(pooled)
    return keras.Model(inputs, outputs, name="skip_concat")


def test_functional_skip_and_concat_readers():
    graph = build_graph(_skip_concat_model(), batch_size=4)
    tensors, ops = _by_name(graph)
    assert tensors["a"].fwd_readers == ("c2", "add", "cat")
    assert tensors["c2"].fwd_readers == ("add",)
    assert tensors["add"].fwd_readers == ("cat",)
    assert ops["add"].inputs == ("a", "c2")
    assert ops["cat"].inputs == ("add", "a")
    assert ops["mul"].inputs == ("cat",)  # the same tensor twice, once
    assert tensors["cat"].nbytes == 4 * 8 * 8 * 8 * F32
    # Add and Concatenate read nothing in backward; Multiply reads its inputs;
    # GlobalAveragePooling nothing; a softmax Dense its input and its output.
    assert tensors["c2"].bwd_readers == ()
    assert tensors["add"].bwd_readers == ()
    assert tensors["cat"].bwd_readers == ("mul",)
    assert tensors["mul"].bwd_readers == ()
    assert tensors["gap"].bwd_readers == ("fc",)
    assert tensors["fc"].bwd_readers == ("fc",)
    # relu: JAX differentiates from the input, TF and torch from the output.
    if BACKEND == "jax":
        assert tensors["c1"].bwd_readers == ("a",)
        assert tensors["a"].bwd_readers == ("c2",)
    else:
        assert tensors["c1"].bwd_readers == ()
        assert tensors["a"].bwd_readers == ("a", "c2")
    assert graph_lib.backward_reads(layers.ReLU(), backend="jax") == (True, False)
    assert graph_lib.backward_reads(layers.ReLU(), backend="torch") == (False, True)


def test_execution_order_matches_an_eager_run():
    model = _skip_concat_model()
    ran = []
    for layer in model.layers:
        if isinstance(layer, layers.InputLayer):
            continue

        def call(*args, _layer=layer, _call=layer.call, **kwargs):
            ran.append(_layer.name)
            return _call(*args, **kwargs)

        layer.call = call
    model(np.zeros((2, 8, 8, 3), "float32"))
    graph = build_graph(model, batch_size=2)
    assert [op.name for op in graph.ops] == ran
    assert [layer.name for layer, _ in graph_lib.layer_calls(model)] == ran


@pytest.fixture(scope="module")
def resnet50():
    return keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3))


@pytest.fixture(scope="module")
def densenet121():
    return keras.applications.DenseNet121(weights=None, input_shape=(64, 64, 3))


def _check_application(model, merge_cls):
    graph = build_graph(model, batch_size=2)
    tensors, ops = _by_name(graph)
    non_input = [l for l in model.layers if not isinstance(l, layers.InputLayer)]
    assert len(graph.ops) == len(non_input)
    assert len(graph.tensors) == len(non_input)
    assert {op.name for op in graph.ops} == {l.name for l in non_input}
    assert [op.name for op in graph.ops] == _keras_order(model)
    _assert_topological(graph)
    merges = [op for op in graph.ops if op.kind == merge_cls.__name__]
    assert merges
    for op in merges:
        assert len(op.inputs) == 2
        for name in op.inputs:
            assert op.name in tensors[name].fwd_readers
    merge_names = {op.name for op in merges}
    for t in graph.tensors:
        assert not merge_names & set(t.bwd_readers), t.name
        output = t.producer == graph.ops[-1].name
        assert t.can_swap is not output and t.can_recompute, t.name
        assert t.nbytes > 0
    for op in graph.ops:
        if op.kind == "Conv2D":
            for name in op.inputs:
                assert op.name in tensors[name].bwd_readers
            assert op.flops > 0
    # Activation bytes and flops are linear in the batch size.
    one, three = build_graph(model, 1), build_graph(model, 3)
    assert sum(t.nbytes for t in three.tensors) == 3 * sum(t.nbytes for t in one.tensors)
    assert sum(o.flops for o in three.ops) == 3 * sum(o.flops for o in one.ops)
    return graph, merges


def test_resnet50(resnet50):
    graph, adds = _check_application(resnet50, layers.Add)
    tensors = graph.tensor_map
    assert len(adds) == 16
    # 12 identity blocks add their input (read by the branch's first conv
    # too); the 4 projection blocks add a BatchNormalization output.
    skips = [
        name for op in adds for name in op.inputs
        if set(tensors[name].fwd_readers) - {op.name}
    ]
    assert len(skips) == 12
    for name in skips:
        assert len(tensors[name].fwd_readers) == 2
    # The first conv of ResNet50 at 64x64: 2 x 32x32x64 float32.
    assert tensors["conv1_conv"].nbytes == 2 * 32 * 32 * 64 * F32


def test_densenet121(densenet121):
    graph, cats = _check_application(densenet121, layers.Concatenate)
    tensors = graph.tensor_map
    assert len(cats) == 6 + 12 + 24 + 16
    for op in cats:
        # The running concatenation is read by the block's BatchNorm and by
        # the concatenation that extends it.
        first = tensors[op.inputs[0]]
        assert len(first.fwd_readers) == 2 and op.name in first.fwd_readers


def test_unbuilt_model_raises():
    model = keras.Sequential([layers.Dense(3)], name="not_built_yet")
    with pytest.raises(ValueError, match="not_built_yet.*not built"):
        build_graph(model, 8)
    with pytest.raises(ValueError, match="not_built_yet"):
        graph_lib.layer_calls(model)
    model(np.zeros((2, 5), "float32"))  # calling it builds it
    assert [op.name for op in build_graph(model, 8).ops] == [model.layers[0].name]


class _Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3)

    def call(self, x):
        return self.dense(x)


def test_subclassed_model_raises():
    model = _Subclassed(name="my_subclassed")
    model(np.zeros((2, 5), "float32"))
    with pytest.raises(ValueError, match="my_subclassed.*subclassed model.*not supported"):
        build_graph(model, 8)


def test_shared_layer_is_kept_with_a_note():
    a, b = keras.Input((5,)), keras.Input((5,))
    shared = layers.Dense(4, name="shared")
    out = layers.Add(name="add")([shared(a), shared(b)])
    graph = build_graph(keras.Model([a, b], out), batch_size=2)
    tensors, ops = _by_name(graph)
    assert [op.name for op in graph.ops] == ["shared", "shared@1", "add"]
    assert graph_lib.tag_names(shared, call=1) == ["shared@1"]
    for name in ("shared", "shared@1"):
        assert not tensors[name].can_swap and not tensors[name].can_recompute
        assert "shared layer called 2 times" in tensors[name].note
        assert ops[name].note == "shared layer called 2 times, its outputs kept"
        assert tensors[name].fwd_readers == ("add",)
    assert tensors["add"].can_recompute and tensors["add"].note == (
        "model output: kept for the loss")


def test_model_outputs_are_not_swapped():
    inputs = keras.Input((5,))
    x = layers.Dense(4, name="hidden")(inputs)
    heads = [layers.Dense(2, name="a")(x), layers.Dense(3, name="b")(x)]
    tensors, _ = _by_name(build_graph(keras.Model(inputs, heads), batch_size=2))
    assert tensors["hidden"].can_swap
    for name in ("a", "b"):
        assert not tensors[name].can_swap
        assert "model output" in tensors[name].note


class _TwoOutputs(layers.Layer):
    def call(self, x):
        return x * 2.0, x - 1.0

    def compute_output_spec(self, x):
        return tuple(keras.KerasTensor(x.shape, x.dtype) for _ in range(2))


def test_random_nested_and_multi_output_layers():
    inner_in = keras.Input((6,))
    inner = keras.Model(
        inner_in,
        layers.Dense(6, name="inner_fc2")(layers.Dense(8, name="inner_fc1")(inner_in)),
        name="inner",
    )
    x = keras.Input((6,))
    h = layers.Dropout(0.5, name="drop")(x)
    h = inner(h)
    split = _TwoOutputs(name="split")
    s0, s1 = split(h)
    out = layers.Add(name="add")([s0, s1])
    graph = build_graph(keras.Model(x, out), batch_size=2)
    tensors, ops = _by_name(graph)
    assert [op.name for op in graph.ops] == ["drop", "inner", "split", "add"]
    assert tensors["drop"].can_swap and not tensors["drop"].can_recompute
    assert "random" in tensors["drop"].note
    assert tensors["drop"].bwd_readers == ("inner",)  # Dropout reads nothing
    # The nested model is one op; its own activations are kept as one tensor.
    assert tensors["inner"].can_swap and not tensors["inner"].can_recompute
    assert "nested model" in tensors["inner"].note
    internal = tensors["inner:internal"]
    assert internal.nbytes == 2 * 8 * F32  # inner_fc1's output, read by inner_fc2
    assert internal.bwd_readers == ("inner",) and not internal.can_swap
    assert ops["inner"].flops == 2 * 2 * 8 * 6 + 2 * 2 * 6 * 8
    assert "nested model" in ops["inner"].note and "64 B of activations" in ops["inner"].note
    # Several outputs: tagged name:i, kept, unknown class reads everything.
    assert ops["split"].outputs == ("split:0", "split:1")
    assert graph_lib.tag_names(split) == ["split:0", "split:1"]
    for name in ops["split"].outputs:
        assert not tensors[name].can_swap and not tensors[name].can_recompute
        assert tensors[name].bwd_readers == ("split",)
        assert tensors[name].fwd_readers == ("add",)
    assert tensors["inner"].bwd_readers == ("inner", "split")


def test_unknown_dimension_needs_input_shapes_and_is_sized_from_them():
    x = keras.Input((None, 3), name="steps")
    model = keras.Model(x, layers.Dense(2, name="per_step")(layers.Dense(4, name="d0")(x)))
    with pytest.raises(ValueError, match=r"'steps'.*unknown.*input_shape="):
        build_graph(model, 4)
    tensors, _ = _by_name(build_graph(model, 4, input_shapes=(5, 3)))
    assert tensors["d0"].nbytes == 4 * 5 * 4 * F32
    assert tensors["per_step"].nbytes == 4 * 5 * 2 * F32
    x = keras.Input((7, 3))
    y = layers.Reshape((-1, 3), name="reshape_ok")(x)
    assert build_graph(keras.Model(x, y), 4).tensors[0].nbytes == 4 * 7 * 3 * F32


def test_optimizer_state_bytes():
    model = _small_cnn()
    weights = sum(int(np.prod(w.shape)) * F32 for w in model.trainable_weights)
    state = graph_lib.optimizer_state_bytes
    assert state(None, model.trainable_weights) == 2 * weights
    assert state(keras.optimizers.SGD(momentum=0.9), model.trainable_weights) == weights
    assert state(keras.optimizers.RMSprop(centered=True), model.trainable_weights) == 2 * weights
    assert state(keras.optimizers.Lion(), model.trainable_weights) == weights
    # Built or not, the same figure: a budget stated before `fit` builds the
    # optimizer must hold during it.
    before = build_graph(model, 2, optimizer=keras.optimizers.Adam()).persistent_bytes
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    assert state(model.optimizer, model.trainable_weights) == 2 * weights
    assert build_graph(model, 2).persistent_bytes == before
    base = build_graph(_small_cnn(), 2, optimizer="sgd").persistent_bytes
    assert before == base + 2 * weights


class _CustomDense(layers.Dense):
    def call(self, x):
        return super().call(x) * 2.0


class _QuietDense(layers.Dense):
    pass


def test_backward_reads_table():
    reads = graph_lib.backward_reads
    assert reads(layers.Dense(2)) == (True, False)
    assert reads(layers.Dense(2, activation="relu")) == (True, True)
    assert reads(layers.Conv2D(2, 3, activation="swish")) == (True, True)
    assert reads(_QuietDense(2)) == (True, False)
    assert reads(_CustomDense(2)) == (True, True)  # rewrote call: unknown
    assert reads(_TwoOutputs()) == (True, True)
    assert reads(layers.Activation("sigmoid")) == (False, True)
    assert reads(layers.Activation("gelu")) == (True, False)
    assert reads(layers.Softmax()) == (False, True)
    assert reads(layers.BatchNormalization()) == (True, False)
    assert reads(layers.Embedding(10, 2)) == (True, False)
    assert reads(layers.MaxPooling2D()) == (True, True)
    assert reads(layers.GlobalMaxPooling2D()) == (True, True)
    assert reads(layers.AveragePooling2D(2)) == (False, False)
    assert reads(layers.GlobalAveragePooling2D()) == (False, False)
    for layer in (layers.Add(), layers.Concatenate(), layers.Flatten(),
                  layers.Reshape((4,)), layers.ZeroPadding2D(),
                  layers.Cropping2D(), layers.Dropout(0.1), layers.Identity()):
        assert reads(layer) == (False, False), layer
    assert reads(layers.Multiply()) == (True, False)


def test_bad_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        build_graph(_small_cnn(), 0)
    with pytest.raises(ValueError, match="keras.Model"):
        build_graph(layers.Dense(3), 8)
