"""JAX swap by host copies (keras_autovm/mechanisms/jax/swap.py), on a CPU.

The CPU client has `device` and `pinned_host` memories (the same RAM), so
the device buffers a swap frees can be counted with `jax.live_arrays()`.
"""

import dataclasses
import warnings

import keras
import numpy as np
import pytest

import keras_autovm
from keras_autovm.planner import format_bytes
from conftest import BACKEND, data, skip_model, small_cnn

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="JAX swap")

if BACKEND == "jax":
    import jax

    from keras_autovm.mechanisms.jax import ahead
    from keras_autovm.mechanisms.jax import calls
    from keras_autovm.mechanisms.jax import mechanism as jax_mechanism
    from keras_autovm.mechanisms.jax import swap


@pytest.fixture
def mechanisms(monkeypatch):
    """The JAX mechanisms AutoVM makes in the test, in order."""
    made = []
    init = jax_mechanism.JaxMechanism.__init__

    def record(self):
        init(self)
        made.append(self)

    monkeypatch.setattr(jax_mechanism.JaxMechanism, "__init__", record)
    return made


def train(model_fn, callbacks=(), jit_compile=False, steps=3):
    keras.utils.set_random_seed(7)
    model = model_fn()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse",
                  jit_compile=jit_compile)
    x, y = data(8 * steps)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False,
              callbacks=list(callbacks), verbose=0)
    return model


def autovm(policy, **kwargs):
    return keras_autovm.AutoVM(budget="1GiB", policy=policy, verbose=0,
                               apply_without_gpu=True, **kwargs)


def max_diff(a, b):
    return max(float(np.max(np.abs(x - y)))
               for x, y in zip(a.get_weights(), b.get_weights()))


def copying_nothing(monkeypatch):
    """The eager step as AutoVM runs it (each layer two compiled programs,
    recomputed at its backward), with the plan's swaps left undone."""
    init = swap.SwapStep.__init__

    def init_keeping(self, *args):
        init(self, *args)
        self.swapped = set()

    monkeypatch.setattr(swap.SwapStep, "__init__", init_keeping)


@pytest.mark.parametrize("model_fn", [small_cnn, skip_model])
@pytest.mark.parametrize("policy", ["offload_all", "sqrt_offload"])
def test_swapped_weights_identical_to_the_same_step_without_copies(
        model_fn, policy, mechanisms, monkeypatch):
    # The swap runs the same programs on the same values, copied out and
    # back: bit for bit. Against Keras's step, jitted whole or op by op,
    # XLA fuses differently and the weights differ by about one float32
    # ulp (1.2e-7 measured after 3 steps).
    callback = autovm(policy)
    model = train(model_fn, [callback])
    assert callback.plan.counts()["swap"] > 0
    stats = callback.report.stats
    assert stats["eager_steps"] == 3, stats
    assert stats["bytes_freed"] == stats["bytes_to_host"] > 0, stats
    assert stats["bytes_to_device"] == stats["bytes_to_host"], stats
    assert stats["swaps_kept_on_device"] == 0, stats
    with monkeypatch.context() as patch:
        copying_nothing(patch)
        unswapped = autovm(policy)
        reference = train(model_fn, [unswapped])
    assert unswapped.report.stats["bytes_to_host"] == 0
    assert max_diff(model, reference) == 0.0
    assert max_diff(model, train(model_fn)) < 1e-6
    assert max_diff(model, train(model_fn, jit_compile=True)) < 1e-6


def test_each_call_is_traced_in_its_first_step_only(mechanisms):
    traces = []
    for steps in (1, 4):
        train(skip_model, [autovm("offload_all")], steps=steps)
        compiled = mechanisms[-1]._compiled
        # One entry per layer call or segment, its forward and backward.
        assert compiled and all(c.traces == 3 for c in compiled.values())
        traces.append(sum(c.traces for c in compiled.values()))
    assert traces[0] == traces[1]


@pytest.mark.parametrize("policy", ["offload_all", "greedy_offload"])
def test_no_activation_outlives_its_step(policy):
    # The compiled calls are kept across steps; what they keep must not
    # hold a step's arrays (their first step's activations stayed on the
    # device for the whole fit: 5 GiB of VGG-19 at batch 64 on an H200).
    left = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            left.append([a.shape for a in jax.live_arrays() if a.ndim == 4
                         and a.shape[0] == 8 and a.shape[-1] != 3 and not a.is_deleted()
                         and a.sharding.memory_kind == "device"])

    callback = autovm(policy)
    train(small_cnn, [callback, Count()])
    assert callback.report.stats["eager_steps"] == 3
    assert left == [[], [], []]


def compiled_beside(monkeypatch):
    """Records, for each program compiled, the step's activations (batch
    8, not the 3-channel input) on the device while it compiles."""
    beside = []
    program = calls.CompiledCall.program

    def recording(self, name, *args, **kwargs):
        count = len(self.programs)
        compiled = program(self, name, *args, **kwargs)
        if len(self.programs) > count:
            beside.append(sum(1 for a in jax.live_arrays() if a.ndim == 4 and a.shape[0] == 8
                              and a.shape[-1] != 3 and a.sharding.memory_kind == "device"))
        return compiled

    monkeypatch.setattr(calls.CompiledCall, "program", recording)
    return beside


@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("model_fn,policy", [(small_cnn, "offload_all"),
                                             (skip_model, "sqrt_offload")])
def test_programs_are_compiled_before_any_activation_exists(
        model_fn, policy, ahead, monkeypatch):
    # Compiling autotunes a GPU convolution with scratch beside what is
    # live: compiled in the first step, VGG-19's programs took the process
    # to 10.8 GiB on an H200, where the plan needs 4.2.
    monkeypatch.setattr(jax_mechanism.JaxMechanism, "compile_ahead", ahead)
    beside = compiled_beside(monkeypatch)
    callback = autovm(policy)
    train(model_fn, [callback])
    stats = callback.report.stats
    assert beside and stats["eager_steps"] == 3
    programs = stats["programs_compiled_ahead"] + stats["programs_compiled_in_steps"]
    assert programs == len(beside), stats
    if ahead:
        assert stats["programs_compiled_in_steps"] == 0 and not any(beside), (stats, beside)
    else:
        assert stats["programs_compiled_ahead"] == 0 and any(beside), (stats, beside)


def test_compiling_ahead_changes_no_weight(monkeypatch):
    models = []
    for ahead in (True, False):
        monkeypatch.setattr(jax_mechanism.JaxMechanism, "compile_ahead", ahead)
        models.append(train(skip_model, [autovm("offload_all")]))
    assert max_diff(*models) == 0.0


def test_each_batch_shape_is_compiled_ahead(mechanisms):
    # 20 samples in batches of 8: the last batch of 4 has its own plan
    # and its own programs, compiled ahead too.
    keras.utils.set_random_seed(7)
    model = small_cnn()
    model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    callback = autovm("offload_all")
    model.fit(*data(20), batch_size=8, epochs=2, verbose=0, callbacks=[callback])
    stats = callback.report.stats
    assert stats["eager_steps"] == 6
    assert stats["programs_compiled_ahead"] > 0
    assert stats["programs_compiled_in_steps"] == 0, stats
    # Each batch size plans with its own programs' scratch.
    scratch = mechanisms[-1]._ahead.scratch
    assert 0 < scratch[4]["c1"][1] < scratch[8]["c1"][1], scratch


def test_the_plan_counts_the_scratch_its_programs_need():
    # Each program's scratch (XLA's memory analysis, read when compiled
    # ahead) is its layer's workspace; the first step runs a plan made
    # with it.
    callback = autovm("offload_all")
    with pytest.warns(UserWarning, match="scratch memory its compiled programs"):
        train(small_cnn, [callback])
    stats = callback.report.stats
    scratch = [b for op in callback.plan.graph.ops for b in op.scratch_bytes]
    assert stats["scratch_replans"] == 1 and stats["programs_compiled_in_steps"] == 0
    assert max(scratch) == stats["max_program_temp_bytes"] > 0


def test_scratch_goes_to_the_op_of_a_layer_the_user_wrapped():
    # The graph names the op after the wrapper, not the layer inside.
    def model_fn():
        inputs = keras.Input((16, 16, 3))
        x = keras_autovm.AutoVMWrapper(keras.layers.Conv2D(8, 3, padding="same"))(inputs)
        x = keras_autovm.AutoVMWrapper(keras.layers.Conv2D(8, 3, padding="same"))(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        return keras.Model(inputs, keras.layers.Dense(4)(x))

    callback = autovm("offload_all")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model_fn, [callback])
    ops = callback.plan.graph.ops
    convs = [op for op in ops if op.kind == "Conv2D"]
    assert len(convs) == 2 and all(op.scratch_bytes[1] > 0 for op in convs), ops


def test_no_scratch_no_replan(monkeypatch):
    monkeypatch.setattr(calls.CompiledCall, "compile_ahead",
                        lambda self, inputs, values: (0, 0))
    callback = autovm("offload_all")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(small_cnn, [callback])
    assert callback.report.stats["scratch_replans"] == 0
    assert not [w for w in caught if "scratch" in str(w.message)]


def test_an_error_in_a_step_gives_the_weights_back(monkeypatch):
    def fails(self, *args):
        raise RuntimeError("boom")

    monkeypatch.setattr(calls.CompiledCall, "backward", fails)
    keras.utils.set_random_seed(7)
    model = small_cnn()
    model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(*data(16), batch_size=8, verbose=0, callbacks=[autovm("offload_all")])
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def test_scratch_no_plan_fits_stops_before_the_first_step(monkeypatch):
    call = ahead.Ahead.call

    def huge_scratch(self, run, inputs, variables, reader, key=None):
        outputs = call(self, run, inputs, variables, reader, key)
        if reader == "c2":
            self.scratch[reader] = (0, 2**30)
        return outputs

    monkeypatch.setattr(ahead.Ahead, "call", huge_scratch)
    keras.utils.set_random_seed(7)
    model = small_cnn()
    model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(keras_autovm.PlanError, match="No plan fits budget=1") as error:
        model.fit(*data(16), batch_size=8, verbose=0, callbacks=[autovm("offload_all")])
    assert error.value.min_budget > 2**30
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    # And AutoVM's changes are undone (the training function was guarded).
    assert not {"train_step", "compute_loss_and_updates", "evaluate"} & set(vars(model))
    assert model.jit_compile is False


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_first_step_out_of_memory_is_replanned_and_run_again(where, monkeypatch):
    # The eager swap step takes its state as arguments: one that ran out of
    # memory (here, once, in one call's program) changed nothing and runs
    # again under a plan made with the overhead learnt.
    # Keeping all fits 1.1x over the budget less headroom (the scratch
    # planned); after the failure, the plan swaps. Both run the same
    # compiled calls: the same weights.
    roomy = autovm("greedy_offload")
    reference = train(skip_model, [roomy])
    assert roomy.plan.counts()["swap"] == 0
    budget = int(roomy.plan.result.peak_bytes / 0.85 * 1.1)
    method = getattr(calls.CompiledCall, where)
    failures = []

    def runs_out_once(self, *args):
        # In the real step, not the abstract pass that compiles ahead.
        abstract = any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(args))
        if not failures and not abstract:
            failures.append(callback.plan.result.peak_bytes)  # The plan that ran.
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 bytes.")
        return method(self, *args)

    monkeypatch.setattr(calls.CompiledCall, where, runs_out_once)
    callback = keras_autovm.AutoVM(budget=budget, headroom=0.15, policy="greedy_offload",
                                   verbose=0, apply_without_gpu=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = train(skip_model, [callback])
    said = [str(w.message) for w in caught if "ran out of GPU memory" in str(w.message)]
    stats = callback.report.stats
    assert len(failures) == 1 and stats["out_of_memory_replans"] == 1
    # Relaxed from the plan that ran out (made again with its scratch
    # before the step), not from the one in force when the step began.
    assert len(said) == 1 and f"the plan predicted {format_bytes(failures[0])}" in said[0]
    assert stats["memory_scale"] > 1 and callback.plan.counts()["swap"] > 0
    assert max_diff(model, reference) == 0.0


class Block(keras.layers.Layer):
    """A custom layer whose `call` takes no `training`: Keras passes it to
    the batch norm and dropout inside through its call context."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv2D(8, 3, padding="same")
        self.bn = keras.layers.BatchNormalization()
        self.drop = keras.layers.Dropout(0.5)

    def call(self, x):
        return self.drop(self.bn(self.conv(x)))


def block_model():
    return keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.Conv2D(8, 3, padding="same", name="c1"),
        Block(name="block"),
        keras.layers.Conv2D(8, 3, padding="same", name="c2"),
        keras.layers.GlobalAveragePooling2D(name="gap"),
        keras.layers.Dense(4, name="head")])


def tied_model():
    """A `Lambda` reading another layer's kernel (tied weights)."""
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", name="c1")(inputs)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    dense = keras.layers.Dense(4, name="head")
    x = dense(x)
    outputs = keras.layers.Lambda(
        lambda t: keras.ops.matmul(t, keras.ops.transpose(dense.kernel)), name="tied")(x)
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(outputs))


@pytest.mark.parametrize("model_fn", [block_model, tied_model])
@pytest.mark.parametrize("policy", ["offload_all", "greedy_offload"])
def test_layers_train_as_under_keras(model_fn, policy):
    # `block_model`: the backward program is traced after the model's call
    # has ended, with the call's `training` restored (without it, the block
    # recomputed in inference mode: 0.028 off). `tied_model`: the `Lambda`
    # cannot be traced alone and runs as Keras runs it (it crashed).
    callback = autovm(policy)
    model = train(model_fn, [callback])
    assert callback.report.stats["eager_steps"] == 3
    assert max_diff(model, train(model_fn)) < 1e-6


@pytest.mark.parametrize("run_ahead", [None, 1])
def test_run_ahead_is_bounded_when_asked(run_ahead, monkeypatch):
    monkeypatch.setattr(jax_mechanism.JaxMechanism, "run_ahead", run_ahead)
    callback = autovm("offload_all")
    train(small_cnn, [callback], steps=1)
    waits = callback.report.stats["run_ahead_waits"]
    assert waits > 0 if run_ahead else waits == 0


def test_a_call_adding_a_loss_runs_as_keras_runs_it():
    def model_fn():
        return keras.Sequential([
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(8, 3, padding="same", name="c1"),
            keras.layers.Conv2D(8, 3, padding="same", name="c2",
                                activity_regularizer=keras.regularizers.L2(0.5)),
            keras.layers.GlobalAveragePooling2D(name="gap"),
            keras.layers.Dense(4, name="head")])

    callback = autovm("offload_all")
    model = train(model_fn, [callback])
    assert callback.plan.actions["c1"] == "swap"
    # The regularizer's loss counts: without it the weights move elsewhere.
    assert max_diff(model, train(model_fn)) < 1e-6
    assert callback.report.stats["swaps_kept_on_device"] == 3  # c1, read by c2


def test_swap_turns_jit_off_and_restores_it():
    callback = autovm("offload_all")
    model = train(small_cnn, [callback], jit_compile=True)
    assert callback.report.stats["eager_steps"] == 3
    assert model.jit_compile


def live_device_bytes():
    return sum(a.nbytes for a in jax.live_arrays()
               if a.sharding.memory_kind == "device")


def conv_chain(size=16):
    """Layers without state: in keep_all each runs under `jax.checkpoint`,
    so a layer's internals are not kept in either run."""
    return keras.Sequential([
        keras.Input((size, size, 3)),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c1"),
        keras.layers.Conv2D(8, 3, padding="same", name="c2"),
        keras.layers.ReLU(name="r2"),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c3"),
        keras.layers.MaxPooling2D(name="p1"),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="c4"),
        keras.layers.GlobalAveragePooling2D(name="gap"),
        keras.layers.Dense(4, name="head"),
    ])


def forward_samples(monkeypatch, policy):
    """Device bytes alive after each layer of the last training forward."""
    samples = []
    after = jax_mechanism.JaxMechanism.after_layer

    def sample(self, name, outputs, applied):
        outputs = after(self, name, outputs, applied)
        samples.append((name, live_device_bytes()))
        return outputs

    with monkeypatch.context() as patch:
        patch.setattr(jax_mechanism.JaxMechanism, "after_layer", sample)
        callback = autovm(policy)
        train(conv_chain, [callback], steps=1)
    return samples[-len(callback.plan.graph.ops):], callback


def test_swap_frees_device_memory_during_the_forward(monkeypatch):
    kept, _ = forward_samples(monkeypatch, "keep_all")
    swapped, callback = forward_samples(monkeypatch, "offload_all")
    assert [n for n, _ in kept] == [n for n, _ in swapped]
    graph = callback.plan.graph
    swaps = [t for t, a in callback.plan.actions.items() if a == "swap"]
    last_read = {t: max(graph.op_index[r] for r in graph.tensor_map[t].fwd_readers)
                 for t in swaps}
    # Before any free (the first model's weights are alive in the second run).
    base = kept[0][1] - swapped[0][1]
    for position, ((name, keep), (_, swap_)) in enumerate(zip(kept, swapped)):
        freed = sum(graph.tensor_map[t].nbytes for t in swaps if last_read[t] <= position)
        # The swapped bytes past their last forward reader are gone from
        # the device, and nothing else differs.
        assert keep - swap_ - base == freed, (name, keep, swap_, freed)
    assert kept[-1][1] - swapped[-1][1] - base == callback.report.stats["bytes_freed"] > 0


def bounded(monkeypatch, limit):
    """Trains with copies that never finish on their own and at most
    `limit` bytes in flight; returns the mechanism's stats."""
    monkeypatch.setattr(swap.SwapStep, "_copy_done", staticmethod(lambda host: False))
    monkeypatch.setattr(jax_mechanism.JaxMechanism, "swap_cost",
                        lambda self, cost: dataclasses.replace(cost, max_in_flight_bytes=limit))
    callback = autovm("offload_all")
    train(small_cnn, [callback], steps=1)
    return callback.report.stats


def test_copies_in_flight_stay_within_the_bound(monkeypatch):
    limit = 70_000  # small_cnn's 16x16x8 maps at batch 8 are 65,536 bytes.
    stats = bounded(monkeypatch, limit)
    assert stats["max_in_flight_bytes"] <= limit and stats["in_flight_waits"] > 0, stats
    # A bound that does not bind: more is outstanding.
    assert bounded(monkeypatch, 1e12)["max_in_flight_bytes"] > limit


@pytest.mark.parametrize("model_fn", [small_cnn, skip_model])
def test_prefetch_happens_where_the_plan_says(model_fn, mechanisms):
    callback = autovm("offload_all")
    train(model_fn, [callback], steps=1)
    plan, events = callback.plan, mechanisms[-1].events
    prefetched = {tag: i for i, (what, tag, op) in enumerate(events) if what == "prefetch"}
    for tag, i in prefetched.items():
        assert events[i][2] == plan.prefetch[tag]
    first_use = {}
    for i, (what, tag, reader) in enumerate(events):
        if what == "use":
            first_use.setdefault(tag, (i, reader))
    at_use = 0
    for tag, (i, reader) in first_use.items():
        if reader in plan.graph.tensor_map[tag].bwd_readers:
            # The copy back started at the trigger, before the planned reader.
            assert prefetched.get(tag, len(events)) < i, (tag, reader, events)
        else:
            # A reader whose backward the plan says needs no `tag` (an
            # `Add`) recomputes from its inputs: if it comes before the
            # trigger, it copies `tag` back itself.
            at_use += prefetched.get(tag, len(events)) > i
    assert callback.report.stats["copy_backs_at_use"] == at_use
    if model_fn is small_cnn:  # A chain: every copy back was prefetched.
        assert callback.report.stats["copy_backs_at_use"] == 0
        assert set(prefetched) == {t for t, a in plan.actions.items() if a == "swap"} - {"head"}


def test_jaxs_link_figures_are_its_own_copies_to_host_and_back(monkeypatch):
    """On the CPU the copies go between its own `device` and `pinned_host`
    memories: the figures' keys are checked, not a bandwidth."""
    from keras_autovm import calibration
    from keras_autovm.mechanisms.jax import timing

    monkeypatch.setattr(timing, "LINK_BYTES", 1 << 20)
    link = timing.measure_link(device=jax.devices()[0])
    assert set(link) == {"pinned_d2h", "pinned_h2d", "pinned_both_d2h", "pinned_both_h2d"}
    assert all(0 < gbps < float("inf") for gbps in link.values())
    assert timing.measure_link() is None  # No GPU here.
    # With a GPU, the profile's link takes them over the default figures.
    mechanism = jax_mechanism.JaxMechanism()
    monkeypatch.setattr(mechanism, "gpu_available", lambda: True)
    monkeypatch.setattr(timing, "measure_link", lambda: link)
    monkeypatch.setattr(calibration, "_link_probe", lambda: None)
    assert calibration.measure_link(mechanism) == link
