"""TensorFlow's explicit swap (keras_autovm/mechanisms/tensorflow/swap.py).

On the CPU a host copy is host to host, which still shows the program and
the numbers: swap plans train to bit-identical weights, and the traced and
optimized training step holds the host copies and the gated copies back,
with the backward reading the copies. A subprocess with two logical CPU
devices stands in for a GPU and its host, so that TensorFlow partitions the
step and moves tensors between devices as it would on a GPU.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_autovm
from conftest import BACKEND, data, skip_model, small_cnn, tf_rewrite_options
from keras_autovm.mechanisms.tensorflow import managed

pytestmark = pytest.mark.skipif(BACKEND != "tensorflow",
                                reason="TensorFlow's explicit swap")

ROOT = Path(__file__).resolve().parents[1]


def train(model_fn, callbacks=(), steps=4, batch_size=8, size=16, epochs=1):
    keras.utils.set_random_seed(7)
    model = model_fn()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    x, y = data(steps * batch_size, size=size)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False,
              callbacks=list(callbacks), verbose=0)
    return model


def autovm(model_fn, policy):
    budget = "1GiB"
    if policy == "greedy_offload":  # Tight: greedy swaps only when it must.
        model = model_fn()
        model.compile(optimizer="sgd", loss="mse")
        keep = keras_autovm.plan(model, 8, budget=2**40, policy="keep_all")
        budget = int(keep.result.peak_bytes * 0.9)
    return keras_autovm.AutoVM(budget=budget, policy=policy, verbose=0,
                               apply_without_gpu=True, headroom=0)


def assert_identical(a, b):
    for wa, wb in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_array_equal(wa, wb)


def gelu_model():
    """Activations whose internals the backward reads (GELU's erfc,
    hard-swish's relu6): recomputing them changed the forward's numbers."""
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", name="c1")(inputs)
    x = keras.layers.Activation("gelu", name="gelu")(x)
    x = keras.layers.Conv2D(8, 3, padding="same", name="c2")(x)
    x = keras.layers.Activation("hard_swish", name="hswish")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(x))


def mobilenet():
    return keras.applications.MobileNet(weights=None, input_shape=(32, 32, 3),
                                        classes=4, alpha=0.25)


@pytest.mark.parametrize("model_fn", [small_cnn, skip_model])
def test_greedy_swap_under_a_tight_budget_trains_to_the_same_weights(model_fn):
    callback = autovm(model_fn, "greedy_offload")
    model = train(model_fn, [callback])
    assert callback.report.plan.counts()["swap"] > 0
    assert callback.report.stats["reads_rewired"] > 0
    assert_identical(train(model_fn), model)


def test_activation_internals_keep_their_numbers():
    callback = autovm(gelu_model, "offload_all")
    model = train(gelu_model, [callback])
    assert callback.report.plan.actions["gelu"] == "swap"
    assert callback.report.stats["reads_rewired"] > 0
    assert_identical(train(gelu_model), model)


@pytest.fixture(scope="module")
def mobilenet_reference():
    return train(mobilenet, steps=3, size=32)


@pytest.mark.parametrize("policy", ["offload_all", "greedy_offload", "sqrt_offload"])
def test_mobile_application_trains_to_the_same_weights(mobilenet_reference, policy):
    callback = autovm(mobilenet, policy)
    model = train(mobilenet, [callback], steps=3, size=32)
    stats = callback.report.stats
    assert callback.report.plan.counts()["swap"] > 0
    assert stats["host_copies"] > 0 and stats["reads_rewired"] > 0, stats
    assert_identical(mobilenet_reference, model)


def test_prefetch_gate_falls_back_to_the_first_backward_use(monkeypatch):
    # Triggers at each tensor's producer: where its output gradient is made
    # after the tensor's first backward read, it cannot gate the copy back.
    from keras_autovm.planner import policies

    monkeypatch.setattr(policies, "prefetch_ahead", lambda graph, actions, k: {
        t: graph.tensor_map[t].producer for t, a in actions.items() if a == "swap"})
    callback = autovm(small_cnn, "offload_all")
    model = train(small_cnn, [callback])
    stats = callback.report.stats
    assert stats["copy_backs_at_use"] > 0 and stats["copy_backs_ungated"] == 0, stats
    assert_identical(train(small_cnn), model)


def test_eager_training_runs_the_plan_without_copies():
    def eager(callbacks):
        keras.utils.set_random_seed(7)
        model = small_cnn()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", run_eagerly=True)
        model.fit(*data(16), batch_size=8, shuffle=False, callbacks=callbacks, verbose=0)
        return model

    callback = autovm(small_cnn, "offload_all")
    model = eager([callback])
    assert callback.report.plan.counts()["swap"] > 0
    assert callback.report.stats["host_copies"] == 0
    assert_identical(eager([]), model)


def test_managed_mode_still_moves_pages(monkeypatch):
    monkeypatch.setitem(managed._state, "enabled", True)
    callback = autovm(small_cnn, "offload_all")
    model = train(small_cnn, [callback])
    stats = callback.report.stats
    swaps = callback.report.plan.counts()["swap"]
    assert "host_copies" not in stats
    assert stats["evicts_inserted"] >= swaps and stats["prefetches_inserted"] >= swaps
    assert_identical(train(small_cnn), model)


# ------------------------------------------------------------ the program


@pytest.fixture(scope="module")
def traced():
    """small_cnn under offload_all: the callback and the graphs it ran."""
    from keras_autovm.mechanisms.tensorflow import internals as tf_internals

    keras.utils.set_random_seed(7)
    model = small_cnn()
    model.name = "traced_cnn"  # Earlier tests' small_cnn steps can be listed too.
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    callback = autovm(small_cnn, "offload_all")
    graphs = tf_internals.tf_function_graphs(lambda: model.fit(
        *data(16), batch_size=8, callbacks=[callback], verbose=0))
    optimized = [g.post_optimization_graph for g in graphs
                 if any("traced_cnn" in n.name for n in g.post_optimization_graph.node)]
    return callback, max(optimized, key=lambda g: len(g.node))


def _consumers(graph_def):
    """Node name -> the nodes reading it as data, and as control."""
    data, control = {}, {}
    for node in graph_def.node:
        for name in node.input:
            if name.startswith("^"):
                control.setdefault(name[1:], []).append(node)
            else:
                data.setdefault(name.split(":")[0], []).append(node)
    return data, control


def _backward(node):
    return "gradient_tape" in node.name and node.op not in ("Shape", "ShapeN", "Size", "Rank")


def test_optimized_step_reads_copies_back(traced):
    callback, graph = traced
    swapped = callback.report.plan.counts()["swap"]
    nodes = {n.name: n for n in graph.node}
    data, _ = _consumers(graph)
    hosts = [n for n in graph.node if n.name.endswith("autovm_swap_out/host_copy")]
    gates = [n for n in graph.node if n.name.endswith("/gate")]
    # Grappler kept every copy: one host copy per swapped tensor, one gated
    # copy back per tensor the backward reads.
    assert len(hosts) == swapped
    assert len(gates) == callback.report.stats["copy_backs"] > 0
    for host in hosts:
        assert host.op == "Snapshot" and host.device.endswith("CPU:0")
        forward = host.input[0].split(":")[0]
        # No backward op reads the forward tensor: it can be freed.
        assert not [n.name for n in data.get(forward, []) if _backward(n)]
    for gate in gates:
        assert gate.op == "Snapshot" and nodes[gate.input[0]] in hosts
        # Gated on a gradient: the copy back waits for the backward pass.
        triggers = [i[1:] for i in gate.input if i.startswith("^")]
        assert triggers and all("gradient_tape" in t for t in triggers), gate.input
        assert [n for n in data[gate.name] if _backward(n)], gate.name


def test_copies_back_wait_for_the_plans_trigger(traced):
    callback, _ = traced
    explicit = callback._mechanism._explicit
    prefetch = callback.report.plan.prefetch
    assert callback.report.stats["copy_backs_at_use"] == 0
    gated = 0
    for op in explicit.graph.get_operations():
        if op.name.endswith("/gate"):
            tag = next(t for t, h in explicit.host.items() if op.inputs[0] is h)
            trigger = explicit.grads["trigger"][tag]
            assert prefetch[tag] and {g.op for g in trigger} <= set(op.control_inputs)
            gated += 1
    assert gated == callback.report.stats["copy_backs"]


# ------------------------------------------------- copies in flight bounded


def chain_plan(bound):
    """offload_all on a chain of 100-byte outputs whose copies (1 s each at
    100 B/s) never finish before the next forward op (0.1 s)."""
    from keras_autovm.planner import CostModel, Graph, OpSpec, TensorSpec, make_plan

    n = 6
    ops = tuple(OpSpec(f"o{i}", fwd_time=0.1, bwd_time=0.2) for i in range(n))
    readers = [(f"o{i + 1}",) if i + 1 < n else () for i in range(n)]
    tensors = tuple(TensorSpec(f"t{i}", 100 if i + 1 < n else 1, f"o{i}", readers[i], readers[i])
                    for i in range(n))
    cost = CostModel(d2h_bytes_per_s=100, h2d_bytes_per_s=100, max_in_flight_bytes=bound)
    return make_plan(Graph(ops, tensors), None, policy="offload_all", cost=cost)


@pytest.mark.parametrize("bound", [0, 150, 250])
def test_in_flight_waits_are_where_the_simulator_waits(bound):
    from keras_autovm.mechanisms.tensorflow import swap

    plan = chain_plan(bound)
    swapped = {t for t, a in plan.actions.items() if a == "swap"}
    waits = swap.in_flight_waits(plan, swapped)
    fwd = [e for e in plan.result.op_events if e.phase == "fwd"]
    waited = {i for i in range(1, len(fwd)) if fwd[i].start > fwd[i - 1].end + 1e-9}
    assert waited and {i for i, _ in waits} == waited
    # The oldest copies first, each waited for once, none of its own output.
    tags = [t for _, due in waits for t in due]
    assert tags == sorted(set(tags), key=lambda t: int(t[1:]))
    assert all(int(t[1:]) < i for i, due in waits for t in due)
    assert swap.in_flight_waits(chain_plan(None), swapped) == []


def test_explicit_copies_start_at_50_ms_of_the_link_and_tighten_where_needed():
    from keras_autovm.mechanisms.tensorflow.mechanism import TensorFlowMechanism
    from keras_autovm.planner import CostModel

    mechanism, cost = TensorFlowMechanism(), CostModel(d2h_bytes_per_s=1000)
    bounded = mechanism.swap_cost(cost)
    assert bounded.max_in_flight_bytes == 50
    assert mechanism.in_flight_bounds(bounded) == (12.5, 0)
    assert mechanism.swap_cost(CostModel(max_in_flight_bytes=7)).max_in_flight_bytes == 7
    mechanism.managed = True  # Page moves are neither bounded nor waited for.
    assert mechanism.swap_cost(cost).max_in_flight_bytes is None
    assert mechanism.in_flight_bounds(cost) == ()


def test_tensorflows_link_figures_take_the_pinned_keys_and_a_refusal_warns(monkeypatch):
    """On the CPU both ends are host placements, so nothing crosses a link:
    the figures' keys and the error path are checked, not a bandwidth."""
    import tensorflow as tf

    from keras_autovm.mechanisms.tensorflow import timing
    from keras_autovm.mechanisms.tensorflow.mechanism import TensorFlowMechanism

    monkeypatch.setattr(timing, "LINK_BYTES", 1 << 20)
    link = timing.measure_link(device="CPU:0", host="/job:localhost/replica:0/task:0/device:CPU:0")
    assert set(link) == {"pinned_d2h", "pinned_h2d", "pinned_both_d2h", "pinned_both_h2d"}
    assert all(0 < gbps < float("inf") for gbps in link.values())
    assert timing.measure_link() is None  # No GPU here.
    mechanism = TensorFlowMechanism()
    mechanism.managed = True  # Page moves are the native probe's.
    assert mechanism.measure_link() is None

    def refused(*args):
        raise tf.errors.InternalError(None, None, "no copy")

    monkeypatch.setattr(timing, "_link_gbps", refused)
    with pytest.warns(UserWarning, match="could not time TensorFlow's copies: no copy"):
        assert timing.measure_link(device="CPU:0") is None


@pytest.fixture(scope="module")
def bounded():
    """small_cnn under offload_all with no copy in flight: the callback, the
    traced step's graph, and the model."""
    from keras_autovm.mechanisms.tensorflow import internals as tf_internals
    from keras_autovm.planner import CostModel

    keras.utils.set_random_seed(7)
    model = small_cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    callback = keras_autovm.AutoVM(budget="1GiB", policy="offload_all", verbose=0,
                                   apply_without_gpu=True, headroom=0,
                                   cost=CostModel(max_in_flight_bytes=0))
    x, y = data(32, size=16)
    graphs = tf_internals.tf_function_graphs(lambda: model.fit(
        x, y, batch_size=8, epochs=1, shuffle=False, callbacks=[callback], verbose=0))
    return callback, graphs, model


def test_forward_waits_for_its_copies_to_host(bounded):
    callback, _, _ = bounded
    explicit = callback._mechanism._explicit
    plan = callback.report.plan
    assert plan.cost.max_in_flight_bytes == 0
    waits = [op for op in explicit.graph.get_operations()
             if "autovm_wait_copies" in op.name and op.type == "Identity"]
    gating = {c.name for op in waits for c in op.control_inputs}
    # Each copy due before a later forward op gates that op's inputs.
    expected = {explicit.host[t].op.name for _, due in swap_waits(plan) for t in due}
    assert expected and gating == expected
    assert all(name.endswith("autovm_swap_out/host_copy") for name in gating)
    assert callback.report.stats["in_flight_waits"] == len(expected)


def swap_waits(plan):
    from keras_autovm.mechanisms.tensorflow import swap

    return swap.in_flight_waits(plan, {t for t, a in plan.actions.items() if a == "swap"})


def test_waiting_for_copies_keeps_the_weights(bounded):
    _, _, model = bounded
    assert_identical(train(small_cnn, steps=4), model)


def _call_memory_optimizations(policy):
    """The Grappler memory option of each step's call and of the nested
    calls traced inside the training function, under `policy`."""
    from keras_autovm.mechanisms.tensorflow import first_step
    from keras_autovm.mechanisms.tensorflow import internals as tf_internals

    seen, original = [], first_step.FirstSteps.__call__

    def spy(self, iterator):
        seen.append(tf_rewrite_options().memory_optimization)
        return original(self, iterator)

    first_step.FirstSteps.__call__ = spy
    try:
        graphs = tf_internals.tf_function_graphs(
            lambda: train(small_cnn, [autovm(small_cnn, policy)]))
    finally:
        first_step.FirstSteps.__call__ = original
    # Nested calls of the functions that carry the plan's copies (Keras may
    # instantiate its step function more than once).
    nested = [tf_rewrite_options(n.attr["config_proto"].s).memory_optimization
              for g in graphs for n in g.pre_optimization_graph.node
              if "config_proto" in n.attr and _copies(g, n.attr["f"].func.name)]
    return set(seen), set(nested)


def _copies(graph, name):
    """Whether function `name` of `graph`'s library makes host copies."""
    return any("autovm_swap_out" in node.name
               for f in graph.pre_optimization_graph.library.function
               if f.signature.name == name for node in f.node_def)


def test_swapping_steps_run_without_grapplers_own_swapping():
    from tensorflow.core.protobuf import rewriter_config_pb2

    scheduling = rewriter_config_pb2.RewriterConfig.SCHEDULING_HEURISTICS
    before = tf_rewrite_options().memory_optimization
    assert _call_memory_optimizations("offload_all") == ({scheduling}, {scheduling})
    assert tf_rewrite_options().memory_optimization == before  # Only inside the steps.
    # A policy that never swaps runs as TensorFlow optimizes it.
    assert _call_memory_optimizations("sqrt_recompute") == ({before}, set())


TWO_DEVICES = """
    import json, sys
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras, keras_autovm
    from conftest import data, small_cnn
    from keras_autovm.mechanisms.tensorflow import internals as tf_internals

    keras.utils.set_random_seed(7)
    # /CPU:1 plays the GPU, /CPU:0 its host.
    with tf.device("/CPU:1"):
        model = small_cnn()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        callback = keras_autovm.AutoVM(budget="1GiB", policy="offload_all",
                                       verbose=0, apply_without_gpu=True)
        graphs = tf_internals.tf_function_graphs(lambda: model.fit(
            *data(16), batch_size=8, callbacks=[callback], verbose=0))
    moves = []
    for function in graphs:
        for part in function.partition_graphs:
            for n in part.node:
                if n.op in ("_Send", "_Recv"):
                    moves.append([n.op, n.device[-5:],
                                  n.attr["tensor_name"].s.decode(), list(n.input)])
                elif n.name.endswith("/gate"):
                    moves.append(["gate", n.device[-5:], n.name, list(n.input)])
                elif "gradient_tape" in n.name and n.device.endswith("CPU:1"):
                    moves.append(["grad", n.op, n.name, list(n.input)])
    print(json.dumps({"swaps": callback.report.plan.counts()["swap"],
                      "copy_backs": callback.report.stats["copy_backs"],
                      "moves": moves}))
"""


def test_tensors_cross_devices_as_planned():
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(TWO_DEVICES)],
                          capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    moves = found["moves"]
    to_host = [m for m in moves if m[0] == "_Send" and m[1] == "CPU:1"
               and not m[2].endswith("/ctrl")]
    to_device = [m[2] for m in moves if m[0] == "_Recv" and m[1] == "CPU:1"]
    gates = [m for m in moves if m[0] == "gate"]
    # Forward: each swapped output leaves the device once.
    assert len([m for m in to_host if "gradient_tape" not in m[2]]) == found["swaps"]
    # Backward: what comes back to the device is the gated copies, nothing
    # else (an ungated host copy would come back during the forward pass).
    assert len(to_device) == found["copy_backs"] > 0
    assert all(name.endswith("/gate") for name in to_device), to_device
    # Each gate runs on the host after a control token from the device.
    assert len(gates) == found["copy_backs"]
    for _, device, _, inputs in gates:
        assert device == "CPU:0" and any(i.startswith("^") for i in inputs)
    # The device's backward reads the received copies, not its own tensors.
    sent = {m[3][0] for m in to_host if m[3]}
    grads = [m for m in moves if m[0] == "grad" and m[1] not in ("Shape", "ShapeN")]
    assert not [g[2] for g in grads if sent & set(g[3])]


def test_segment_recompute_reruns_the_forward_and_matches_tf_recompute_grad():
    import tensorflow as tf

    from keras_autovm.mechanisms.tensorflow import swap
    from test_recompute import block

    layers, x = block()
    calls = []

    def segment(x):
        calls.append(1)
        outputs = []
        for layer in layers:
            x = layer(x)
            outputs.append(x)
        return tuple(outputs)

    variables = [v for layer in layers for v in layer.trainable_variables]

    def grads(remat):
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = tf.reduce_sum(remat(segment)(x)[-1] ** 2)
            return tape.gradient(y, [x] + variables)

        calls.clear()
        result = [g.numpy() for g in step(tf.constant(keras.ops.convert_to_numpy(x)))]
        assert len(calls) == 2, "the backward pass did not run the forward again"
        return result

    for ours, theirs in zip(grads(swap.recompute), grads(tf.recompute_grad), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_optimized_step_keeps_the_waits(bounded):
    callback, graphs, _ = bounded
    graph = max((g.post_optimization_graph for g in graphs), key=lambda g: len(g.node))
    _, control = _consumers(graph)
    hosts = [n.name for n in graph.node if n.name.endswith("autovm_swap_out/host_copy")]
    waited = [h for h in hosts
              if any(not _backward(n) and "autovm_swap_in" not in n.name
                     for n in control.get(h, []))]
    # Grappler may move a wait's control input onto the ops it guarded, but
    # keeps one on a forward op for every copy waited for.
    assert len(waited) == callback.report.stats["in_flight_waits"] > 0
