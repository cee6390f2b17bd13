import dataclasses
import json
import os

import keras
import numpy as np
import pytest

import keras_autovm
from keras_autovm import mechanisms
from keras_autovm import profiling
from conftest import BACKEND, data, skip_model, small_cnn


def train(model_fn, callbacks=(), epochs=1):
    keras.utils.set_random_seed(7)
    model = model_fn()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    x, y = data(32)
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False,
              callbacks=list(callbacks), verbose=0)
    return model


def autovm(**kwargs):
    kwargs.setdefault("budget", "1GiB")
    return keras_autovm.AutoVM(verbose=0, apply_without_gpu=True, **kwargs)


def dropout_cnn():
    return keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.Conv2D(8, 3, padding="same", name="c1"),
        keras.layers.BatchNormalization(name="bn1"),
        keras.layers.Dropout(0.5, name="drop"),
        keras.layers.GlobalAveragePooling2D(name="gap"),
        keras.layers.Dense(4, name="head"),
    ])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_AUTOVM_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def cpu_memory(monkeypatch):
    """TensorFlow's layer timing measures workspaces in the CPU's memory, as
    it does in a GPU's (without a GPU it measures none)."""
    from keras_autovm.mechanisms.tensorflow import timing

    monkeypatch.setattr(timing, "_memory_device", lambda: "CPU:0")


def test_measure_times_every_layer_call_and_changes_nothing():
    model = dropout_cnn()
    variables = [keras.ops.convert_to_numpy(v.value) for v in model.variables]
    rng = None
    if BACKEND == "torch":
        import torch
        rng = torch.random.get_rng_state()
    profile = profiling.measure(model, 4, mechanisms.get(), repeats=1)
    assert [t.name for t in profile.layers] == ["c1", "bn1", "drop", "gap", "head"]
    for t in profile.layers:
        assert t.fwd_s > 0 and t.bwd_s >= 0, t
    assert profile.layers[0].output_bytes == 4 * 16 * 16 * 8 * 4
    assert profile.layers[0].bwd_s > 0  # A convolution has a backward.
    # Moving statistics, seed generator states and weights are unchanged.
    for before, v in zip(variables, model.variables):
        np.testing.assert_array_equal(before, keras.ops.convert_to_numpy(v.value), err_msg=v.path)
    if rng is not None:
        assert torch.equal(rng, torch.random.get_rng_state())


@pytest.mark.parametrize("model_fn", [dropout_cnn, skip_model])
def test_training_with_profiling_gives_identical_weights(model_fn, cache):
    reference = train(model_fn, [autovm(policy="keep_all", profile=None)], epochs=2)
    callback = autovm(policy="keep_all")
    model = train(model_fn, [callback], epochs=2)
    assert callback.measured is not None
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_second_fit_reads_the_cache_and_a_changed_model_is_measured(
        cache, monkeypatch):
    first = autovm()
    train(small_cnn, [first])
    assert first.report.stats["profile"] == "measured"
    assert len(os.listdir(cache)) == 1

    def fail(*args, **kwargs):
        raise AssertionError("profiled again")

    monkeypatch.setattr(profiling, "measure", fail)
    second = autovm()
    train(small_cnn, [second])
    assert second.report.stats["profile"] == "cache"
    assert second.measured == first.measured
    monkeypatch.undo()
    monkeypatch.setenv("KERAS_AUTOVM_CACHE_DIR", str(cache))
    changed = autovm()
    train(lambda: small_cnn(size=8), [changed])
    assert changed.report.stats["profile"] == "measured"
    assert len(os.listdir(cache)) == 2


def test_fingerprint_follows_the_architecture():
    assert profiling.fingerprint(small_cnn()) == profiling.fingerprint(small_cnn())
    assert profiling.fingerprint(small_cnn()) != profiling.fingerprint(small_cnn(8))
    assert profiling.fingerprint(small_cnn()) != profiling.fingerprint(skip_model())


def fake_profile(model, batch_size, fwd=1e-3, link=None):
    names = [op.name for op in keras_autovm.plan(model, batch_size, "1GiB").graph.ops]
    layers = tuple(profiling.LayerTime(n, fwd, 2 * fwd, 0) for n in names)
    return profiling.Profile("test-device", BACKEND, batch_size,
                             profiling.fingerprint(model), layers,
                             link or {})


def test_plan_takes_a_profile_object_or_path(tmp_path):
    model = small_cnn()
    profile = fake_profile(model, 8, link={"pinned_d2h": 10.0, "pinned_h2d": 20.0})
    path = str(tmp_path / "p.json")
    profile.save(path)
    assert profiling.Profile.load(path) == profile
    for given in (profile, path):
        plan = keras_autovm.plan(model, 8, "1GiB", policy="keep_all", profile=given)
        assert all(op.fwd_time == 1e-3 and op.bwd_time == 2e-3 for op in plan.graph.ops)
        assert plan.cost.d2h_bytes_per_s == 10e9 and plan.cost.h2d_bytes_per_s == 20e9
        assert plan.cost_source() == "compute measured, link measured"
        n = len(plan.graph.ops)
        assert plan.result.compute_time == pytest.approx(n * 3e-3)
    # Half the batch: the times scale with it.
    half = keras_autovm.plan(model, 4, "1GiB", policy="keep_all", profile=profile)
    assert half.graph.ops[0].fwd_time == pytest.approx(0.5e-3)
    plain = keras_autovm.plan(model, 8, "1GiB", policy="keep_all")
    assert plain.cost_source().startswith("compute roofline (uncalibrated)")
    lines = []
    plain.summary(print_fn=lines.append)
    assert any("roofline (uncalibrated)" in line for line in lines)
    with pytest.raises(ValueError, match="profile="):
        keras_autovm.plan(model, 8, "1GiB", profile=3)


def test_autovm_checks_profile_argument():
    with pytest.raises(ValueError, match="profile=3"):
        keras_autovm.AutoVM(profile=3)


def test_autovm_plans_with_a_given_profile():
    model = small_cnn()
    callback = autovm(policy="keep_all", profile=fake_profile(model, 8, fwd=0.01))
    train(small_cnn, [callback])
    assert callback.report.stats["profile"] == "given"
    assert callback.plan.graph.ops[0].fwd_time is not None


def test_cache_serves_the_same_model_rebuilt_with_new_names(cache):
    def make():
        return keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3),
                                 keras.layers.Flatten(), keras.layers.Dense(2)])

    mechanism = mechanisms.get()
    first, second = make(), make()
    a, measured_a = profiling.obtain(first, 2, mechanism)
    b, measured_b = profiling.obtain(second, 2, mechanism)
    assert measured_a and not measured_b
    assert [t.name for t in b.layers] == [layer.name for layer in second.layers]
    assert [t.name for t in a.layers] != [t.name for t in b.layers]
    assert [t.fwd_s for t in a.layers] == [t.fwd_s for t in b.layers]


@pytest.mark.parametrize("fit_verbose,shown", [(0, False), (1, True)])
def test_progress_bar_follows_fit_verbose(fit_verbose, shown, cache, capsys):
    keras.utils.set_random_seed(7)
    model = small_cnn()
    model.compile(optimizer="sgd", loss="mse")
    callback = keras_autovm.AutoVM(budget="1GiB", apply_without_gpu=True,
                                   policy="keep_all", verbose=1)
    model.fit(*data(8), batch_size=8, epochs=1, verbose=fit_verbose,
              callbacks=[callback])
    assert ("timing each layer" in capsys.readouterr().out) == shown


@pytest.mark.skipif(BACKEND != "torch", reason="the recipe picks its backend")
def test_gpu_profile_recipe_writes_the_calibration_format(tmp_path):
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "recipes", "gpu_profile.py"), "--smoke",
         "--batch-size", "4", "--steps", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=root))
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(tmp_path / "tiny_layer_times_torch.json") as f:
        result = json.load(f)
    assert set(result) == {"device", "backend", "batch_size", "layers", "link",
                           "profile_s", "first_epoch_s", "steps"}
    assert result["backend"] == "torch" and result["steps"] == 2
    assert result["batch_size"] == 4 and result["first_epoch_s"] > 0
    assert len(result["layers"]) == 6
    assert set(result["layers"][0]) == {"name", "fwd_s", "bwd_s", "output_bytes"}


def test_a_budget_below_the_in_core_need_times_at_a_smaller_batch(cache):
    from keras_autovm.model_graph import build_graph
    model = small_cnn()
    one = build_graph(model, 1)
    per_sample = sum(t.nbytes for t in one.tensors)
    # Room for the timing pass of 3 samples, not of 8: timing at 8 would run
    # out of memory before any plan is made (seen on an H100 under a cap).
    limit = one.persistent_bytes + 2 * per_sample * 3
    assert profiling.timing_batch(model, 8, limit) == 3
    assert profiling.timing_batch(model, 8, None) == 8
    assert profiling.timing_batch(model, 8, 2**40) == 8
    assert profiling.timing_batch(model, 8, 1) == 1
    callback = autovm(budget=int(limit / (1 - mechanisms.get().default_headroom)) + 1)
    try:
        train(small_cnn, [callback])
    except keras_autovm.PlanError:
        pass  # Too tight to plan is fine here: what was timed is the point.
    assert callback.measured is not None and callback.measured.batch_size == 3
    graph = profiling.Profile.apply(callback.measured, build_graph(model, 8))
    times = {t.name: t for t in callback.measured.layers}
    # Timed at 1 too, for the part of each time that does not grow.
    assert any(t.fwd_fixed_s > 0 or t.bwd_fixed_s > 0 for t in times.values())
    op = next(op for op in graph.ops if op.name in times)
    fixed = times[op.name].fwd_fixed_s
    assert op.fwd_time == pytest.approx(fixed + (times[op.name].fwd_s - fixed) * 8 / 3)


def _profile(batch_size, *fwd_bwd):
    layers = tuple(profiling.LayerTime(f"l{i}", f, b, 1) for i, (f, b) in enumerate(fwd_bwd))
    return profiling.Profile("cpu", "test", batch_size, "", layers)


def test_times_from_a_smaller_batch_grow_by_their_batch_dependent_part():
    from keras_autovm.model_graph import build_graph
    # At batch 4: 10 ms; at 2: 6 ms. A line through both: 2 ms fixed and
    # 2 ms per sample, so 34 ms at 16 (scaled linearly it would be 40).
    big = _profile(4, (0.010, 0.020), (0.010, 0.004), (0.010, 0.020))
    small = _profile(2, (0.006, 0.012), (0.012, 0.001), (0.004, 0.004))
    fitted = big.with_fixed_times(small)
    first, flat, steep = fitted.layers
    assert first.at(4.0) == pytest.approx((0.034, 0.068))
    # Noise that makes a smaller batch slower: a fixed time, no slope.
    assert (flat.fwd_fixed_s, flat.at(4.0)[0]) == pytest.approx((0.010, 0.010))
    # Faster than linear below: no negative fixed time.
    assert steep.fwd_fixed_s == 0 and steep.at(4.0)[0] == pytest.approx(0.040)
    assert fitted.layers[1].at(4.0)[1] == pytest.approx(0.0 + 0.004 * 4)
    model = small_cnn()
    graph = build_graph(model, 16)
    names = [op.name for op in graph.ops][:3]
    fitted = dataclasses.replace(fitted, layers=tuple(
        dataclasses.replace(t, name=n) for t, n in zip(fitted.layers, names)))
    ops = {op.name: op for op in fitted.apply(graph).ops}
    assert ops[names[0]].fwd_time == pytest.approx(0.034)
    again = profiling.Profile.from_dict(fitted.to_dict())
    assert again.layers == fitted.layers
    with pytest.raises(ValueError, match="smaller.batch_size=4"):
        big.with_fixed_times(big)


def timed_calls(mechanism, monkeypatch):
    """The `(operation, args)` of each call `mechanism`'s timers are given,
    in order (the list fills as profiles are measured)."""
    calls, real = [], mechanism.call_timer

    def call_timer(repeats, progress=None):
        timer = real(repeats, progress)
        add = timer.add
        timer.add = lambda key, operation, args, kwargs: (
            calls.append((operation, args)), add(key, operation, args, kwargs))
        return timer

    monkeypatch.setattr(mechanism, "call_timer", call_timer)
    return calls


def test_identical_layer_calls_are_timed_once(monkeypatch):
    model = keras.Sequential([keras.Input((6,))] + [
        keras.layers.Dense(6, name=f"d{i}") for i in range(4)] + [keras.layers.Dense(2)])
    mechanism = mechanisms.get()
    calls = timed_calls(mechanism, monkeypatch)
    profile = profiling.measure(model, 4, mechanism, repeats=1)
    calls = [operation.name for operation, _ in calls]
    assert len(calls) == 2 and calls[0] == "d0"  # d0..d3 alike, then the head.
    assert [t.fwd_s for t in profile.layers[:4]] == [profile.layers[0].fwd_s] * 4


@pytest.mark.skipif(BACKEND != "jax", reason="JAX times calls from their shapes")
def test_jax_runs_no_layer_eagerly_and_compiles_on_threads(monkeypatch):
    """Run eagerly, JAX compiles each operation of each call apart (most of
    a profile's time); the pass runs on tracers, and the calls' programs
    compile off the main thread."""
    import threading

    import jax

    from keras_autovm.mechanisms.jax import timing
    passes, threads = [], set()
    real_run, real_compile = profiling.internals.run_calls, timing._Call.compile

    def run_calls(model, inputs, around):
        passes.append([isinstance(x, jax.core.Tracer) for x in inputs])
        return real_run(model, inputs, around)

    def compile(call):
        threads.add(threading.current_thread() is threading.main_thread())
        return real_compile(call)

    monkeypatch.setattr(profiling.internals, "run_calls", run_calls)
    monkeypatch.setattr(timing._Call, "compile", compile)
    monkeypatch.setattr(timing, "THREADS", 2)
    profile = profiling.measure(skip_model(), 4, mechanisms.get(), repeats=1)
    assert passes == [[True]] and threads == {False}
    assert all(t.fwd_s > 0 for t in profile.layers)
    assert {t.name: t.bwd_s > 0 for t in profile.layers}["stem"]


def test_inputs_held_in_a_keras_list_are_timed_as_inputs():
    """Inputs stored on a model before `super().__init__` become Keras's
    `TrackedList`, which JAX's tree does not open (its tracers outlived
    the pass: "compiled for 2 inputs but called with 0")."""
    class Parts(keras.Model):
        def __init__(self):
            self.parts = [keras.Input((4,)), keras.Input((4,))]
            joined = keras.layers.Concatenate(name="cat")(self.parts)
            super().__init__(self.parts, keras.layers.Dense(2, name="head")(joined))

    profile = profiling.measure(Parts(), 2, mechanisms.get(), repeats=1)
    assert [t.name for t in profile.layers] == ["cat", "head"]
    assert all(t.fwd_s > 0 for t in profile.layers)


def test_link_takes_the_probe_medians_and_the_backend_copies(monkeypatch):
    from keras_autovm import calibration
    from keras_autovm.mechanisms.base import Mechanism

    probe = {"pinned_d2h": {"median": 50.0}, "managed_prefetch_h2d": {"median": 40.0},
             "managed_first_eviction": 9.0, "nbytes": 1 << 26}
    monkeypatch.setattr(calibration, "_link_probe", lambda: probe)

    class Gpu(Mechanism):
        def gpu_available(self):
            return True

        def measure_link(self):
            return {"pinned_d2h": 52.0, "pinned_both_h2d": 30.0}

    assert calibration.measure_link(Gpu()) == {
        "pinned_d2h": 52.0, "managed_prefetch_h2d": 40.0,
        "managed_first_eviction": 9.0, "pinned_both_h2d": 30.0}
    assert calibration.measure_link(Mechanism()) == {}


def test_fingerprint_tells_frozen_held_and_lambda_layers_apart():
    def with_layer(layer):
        inputs = keras.Input((8,))
        return keras.Model(inputs, layer(keras.layers.Dense(8)(inputs)))

    dense = keras.layers.Dense(4)
    before = profiling.fingerprint(with_layer(dense))
    dense.trainable = False  # No weight gradients left to time.
    assert profiling.fingerprint(with_layer(dense)) != before

    class Block(keras.layers.Layer):
        def __init__(self, activation, **kwargs):
            super().__init__(**kwargs)
            self.inner = keras.layers.Activation(activation)

        def call(self, x):
            return self.inner(x)

    assert (profiling.fingerprint(with_layer(Block("relu")))
            != profiling.fingerprint(with_layer(Block("exponential"))))
    assert (profiling.fingerprint(with_layer(keras.layers.Lambda(lambda x: x * 2)))
            != profiling.fingerprint(with_layer(keras.layers.Lambda(lambda x: x + 2))))
    assert (profiling.fingerprint(with_layer(keras.layers.Dense(4)))
            == profiling.fingerprint(with_layer(keras.layers.Dense(4))))


def test_raw_ops_between_layers_are_fingerprinted_and_timed():
    # MobileNetV3's hard sigmoid adds 3.0 with a raw op between its layers:
    # its fingerprint failed, and AutoVM planned with roofline estimates.
    def with_raw_op(op):
        inputs = keras.Input((8,))
        x = keras.layers.Dense(8, name="d1")(inputs)
        return keras.Model(inputs, keras.layers.ReLU(name="r")(op(x, 3.0)))

    add, multiply = keras.ops.add, keras.ops.multiply
    assert profiling.fingerprint(with_raw_op(add)) == profiling.fingerprint(with_raw_op(add))
    assert profiling.fingerprint(with_raw_op(add)) != profiling.fingerprint(with_raw_op(multiply))
    profile = profiling.measure(with_raw_op(add), 4, mechanisms.get(), repeats=1)
    assert len(profile.layers) == 3 and all(t.fwd_s > 0 for t in profile.layers)


def test_a_profile_timed_at_a_smaller_batch_is_measured_again_with_room(cache):
    from keras_autovm.model_graph import build_graph
    model = small_cnn()
    one = build_graph(model, 1)
    tight = one.persistent_bytes + 2 * sum(t.nbytes for t in one.tensors) * 3
    mechanism = mechanisms.get()
    first, measured = profiling.obtain(model, 8, mechanism, limit_bytes=tight)
    assert measured and first.batch_size == 3
    again, measured = profiling.obtain(model, 8, mechanism, limit_bytes=tight)
    assert not measured and again.batch_size == 3
    roomy, measured = profiling.obtain(model, 8, mechanism)
    assert measured and roomy.batch_size == 8


def test_a_profile_of_another_model_warns(tmp_path):
    other = profiling.measure(skip_model(), 4, mechanisms.get(), repeats=1)
    with pytest.warns(UserWarning, match="another model") as caught:
        keras_autovm.plan(small_cnn(), 4, budget="1GiB", profile=other)
    # The same backend is not named as a difference.
    assert not any("another backend" in str(w.message) for w in caught)
    elsewhere = dataclasses.replace(fake_profile(small_cnn(), 4), backend="elsewhere")
    with pytest.warns(UserWarning, match=f"another backend \\(elsewhere; this one: {BACKEND}\\)"):
        keras_autovm.plan(small_cnn(), 4, budget="1GiB", profile=elsewhere)


def test_a_cached_profile_of_another_format_is_measured_again(cache):
    model = small_cnn()
    mechanism = mechanisms.get()
    first, measured = profiling.obtain(model, 4, mechanism)
    assert measured
    (path,) = [os.path.join(cache, name) for name in os.listdir(cache)]
    with open(path) as f:
        data = json.load(f)
    data["format"] = 2  # Times measured another way: not what plans now use.
    with open(path, "w") as f:
        json.dump(data, f)
    again, measured = profiling.obtain(model, 4, mechanism)
    assert measured
    with open(path) as f:
        assert json.load(f)["format"] == profiling._FORMAT



def ten_convs(n=10):
    return keras.Sequential([keras.Input((16, 16, 3))] + [
        keras.layers.Conv2D(8, 3, padding="same", name=f"c{i}") for i in range(n)] + [
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])


def passes_run(monkeypatch):
    """The batch of each profiling pass, in order."""
    passes, real_run = [], profiling.internals.run_calls

    def run_calls(model, inputs, around):
        passes.append(tuple(inputs[0].shape)[0])
        return real_run(model, inputs, around)

    monkeypatch.setattr(profiling.internals, "run_calls", run_calls)
    return passes


def test_calls_that_fit_at_the_training_batch_are_timed_there(cache, monkeypatch):
    from keras_autovm import profile_batch
    from keras_autovm.model_graph import build_graph
    model = small_cnn()
    one = build_graph(model, 1)
    per_sample = sum(t.nbytes for t in one.tensors)
    # The pass holds 3 samples' outputs; one call alone at 8 does not fit
    # beside it.
    limit = one.persistent_bytes + 2 * per_sample * 3
    assert profile_batch.timing_batch_for(model, 8, limit) == (3, 3)
    assert not profile_batch.calls_fit(model, 8, 3, limit)
    # A deeper model: no one call holds a third of what the pass does.
    model = ten_convs()
    one = build_graph(model, 1)
    roomy = one.persistent_bytes + sum(t.nbytes for t in one.tensors) * 100
    pass_batch, time_at = profile_batch.timing_batch_for(model, 64, roomy)
    assert pass_batch < 64 and time_at == 64
    mechanism = mechanisms.get()
    calls, passes = timed_calls(mechanism, monkeypatch), passes_run(monkeypatch)
    profile, measured = profiling.obtain(model, 64, mechanism, limit_bytes=roomy)
    shapes = [{tuple(x.shape)[0] for x in keras.tree.flatten(args) if hasattr(x, "shape")}
              for _, args in calls]
    assert measured and profile.batch_size == 64 and passes == [pass_batch]
    assert shapes and all(s == {64} for s in shapes)
    assert all(t.fwd_fixed_s == t.bwd_fixed_s == 0 for t in profile.layers)
    assert profile.layers[0].output_bytes == 64 * 16 * 16 * 8 * 4
    # Cached: the same limit reads it back.
    assert not profiling.obtain(model, 64, mechanism, limit_bytes=roomy)[1]


def test_calls_too_large_for_the_training_batch_are_timed_at_the_largest_that_fits(
        cache, monkeypatch):
    """Not at the pass's batch, scaled up: on an H200, ResNet-152's layers
    timed at 11 summed to 3.3x their times at 264. Beside the smallest
    pass, with the temporaries a call alone makes; the fixed times are
    fitted from half that batch, beside the same pass."""
    from keras_autovm import profile_batch
    from keras_autovm.model_graph import build_graph
    model = ten_convs()
    one = build_graph(model, 1)
    limit = one.persistent_bytes + sum(t.nbytes for t in one.tensors) * 20
    largest_pass = profiling.timing_batch(model, 64, limit)
    pass_batch, time_at = profile_batch.timing_batch_for(model, 64, limit)
    assert not profile_batch.calls_fit(model, 64, largest_pass, limit)
    assert pass_batch == profile_batch.LEAST_PASS and largest_pass < time_at < 64
    # Beside a pass of 2, 18 samples' outputs of room; a convolution's
    # call alone needs 2 x (input + output) + 8 outputs: 12 outputs.
    output = 16 * 16 * 8 * 4
    room = limit - one.persistent_bytes - 2 * sum(t.nbytes for t in one.tensors)
    assert time_at == room // (12 * output) == 15
    # Where the limit is one sample's worth less, so is the batch.
    assert profile_batch.largest_call_batch(model, 64, limit - 10**5) < time_at
    mechanism = mechanisms.get()
    calls, passes = timed_calls(mechanism, monkeypatch), passes_run(monkeypatch)
    profile, measured = profiling.obtain(model, 64, mechanism, limit_bytes=limit)
    batches = [{tuple(x.shape)[0] for x in keras.tree.flatten(args) if hasattr(x, "shape")}
               for _, args in calls]
    half = len(batches) // 2
    assert measured and profile.batch_size == time_at and passes == [pass_batch] * 2
    assert batches[:half] == [{time_at}] * half
    assert batches[half:] == [{time_at // 2}] * half
    assert profile.layers[0].output_bytes == time_at * 16 * 16 * 8 * 4


def test_calls_are_timed_at_a_batch_of_their_own_where_the_largest_pass_is_one():
    """A pass of 1 fits no fixed part; beside a pass of 2, calls at 3 do."""
    from keras_autovm import profile_batch
    from keras_autovm.model_graph import build_graph
    model = ten_convs(40)
    one = build_graph(model, 1)
    limit = one.persistent_bytes + sum(t.nbytes for t in one.tensors) * 3
    assert profiling.timing_batch(model, 64, limit) == 1
    assert profile_batch.timing_batch_for(model, 64, limit) == (2, 3)
    # Calls no larger than the pass: nothing to gain.
    assert profile_batch.timing_batch_for(model, 64, limit - 10**5) == (1, 1)
    assert profile_batch.timing_batch_for(model, 2, limit) == (1, 1)


@pytest.mark.parametrize("samples", [100, 20])
def test_calls_out_of_memory_at_a_batch_of_their_own_are_timed_in_the_largest_pass(
        cache, monkeypatch, samples):
    """At the training batch (room for 100 samples' outputs) or at the
    largest batch that fits beside the smallest pass (room for 20)."""
    from keras_autovm import profile_batch
    from keras_autovm.model_graph import build_graph
    model = ten_convs()
    one = build_graph(model, 1)
    limit = one.persistent_bytes + sum(t.nbytes for t in one.tensors) * samples
    largest_pass = profiling.timing_batch(model, 64, limit)
    assert profile_batch.timing_batch_for(model, 64, limit)[1] > largest_pass
    mechanism = mechanisms.get()
    real = profiling.measure

    class OutOfMemory(Exception):
        pass

    def measure(model, batch_size, mechanism, time_at=None, **kwargs):
        if time_at and time_at > largest_pass:
            raise OutOfMemory()
        return real(model, batch_size, mechanism, time_at=time_at, **kwargs)

    monkeypatch.setattr(profiling, "measure", measure)
    monkeypatch.setattr(type(mechanism), "out_of_memory",
                        lambda self, error: isinstance(error, OutOfMemory))
    passes = passes_run(monkeypatch)
    profile, measured = profiling.obtain(model, 64, mechanism, limit_bytes=limit)
    assert measured and profile.batch_size == largest_pass
    assert passes == [largest_pass, largest_pass // 2]


def test_inputs_made_for_a_larger_batch_keep_what_is_not_batched():
    from keras_autovm.profile_batch import at_batch
    x, w = keras.ops.ones((3, 5)), keras.ops.ones((4, 5))
    args, kwargs = at_batch(((x, w), {"mask": keras.ops.ones((3,), "bool"), "n": 2}), 8, 3)
    assert tuple(args[0].shape) == (8, 5) and args[1] is w
    assert tuple(kwargs["mask"].shape) == (8,) and kwargs["n"] == 2
    assert at_batch(((x,), {}), 3, 3)[0][0] is x


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's layer timing")
def test_tensorflow_times_a_call_as_the_second_of_two_in_a_row(monkeypatch):
    """What calling a `tf.function` and taking a tape's gradient cost in
    Python is paid once by both timed functions, and cancels out."""
    from keras_autovm.mechanisms.tensorflow import timing

    layer = keras.layers.Dense(8)
    x = keras.ops.ones((4, 8))
    layer(x)
    calls = lambda runs: len(runs.arguments)  # noqa: E731
    monkeypatch.setattr(timing._Runs, "forward_s", lambda self, r: 0.5 + 0.01 * calls(self))
    monkeypatch.setattr(timing._Runs, "backward_s", lambda self, r: 0.7 + 0.03 * calls(self))
    assert timing.time_call(layer, (x,), {}, 1)[:2] == pytest.approx((0.01, 0.03))
    # Noise that makes the longer function no longer: the call costs what
    # launching an op does, not nothing.
    monkeypatch.setattr(timing._Runs, "forward_s", lambda self, r: 0.5 - 0.01 * calls(self))
    monkeypatch.setattr(timing._Runs, "backward_s", lambda self, r: 0.7 - 0.03 * calls(self))
    assert timing.time_call(layer, (x,), {}, 1)[:2] == (timing._LEAST_S, timing._LEAST_S)
    assert timing._LEAST_S > 0


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's layer timing")
def test_tensorflow_runs_a_call_twice_after_grappler():
    """Grappler folds two identical calls on the same arguments into one;
    ordered one after the other, both run."""
    from keras_autovm.mechanisms.tensorflow import internals
    from keras_autovm.mechanisms.tensorflow import timing

    # Softsign: an op no other test runs, so that only this function has it.
    layer = keras.layers.Activation("softsign")
    x = keras.ops.ones((4, 8))

    def forward(tv, xs):
        return layer(xs[0])

    runs = timing._Runs(forward, [([], [x]), ([], [x])])
    graphs = internals.tf_function_graphs(runs.runs, runs.arguments)
    ops = [n.op for g in graphs for n in g.post_optimization_graph.node]
    assert ops.count("Softsign") == 2
    np.testing.assert_array_equal(*runs.runs(runs.arguments))


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's layer timing")
def test_tensorflow_call_timed_once_where_two_do_not_fit(monkeypatch):
    """Two calls in a row that run out of memory: the call timed once, less
    what timing a call that does next to nothing costs."""
    import tensorflow as tf

    from keras_autovm.mechanisms.tensorflow import timing

    def seconds(base):
        def run(self, repeats):
            if len(self.arguments) > 1:
                raise tf.errors.ResourceExhaustedError(None, None, "OOM")
            return base
        return run

    layer = keras.layers.Dense(8)
    x = keras.ops.ones((4, 8))
    layer(x)
    idle = timing._idle_call_s(timing._REPEATS)  # Measured before the runs are faked.
    monkeypatch.setattr(timing._Runs, "forward_s", seconds(0.5))
    monkeypatch.setattr(timing._Runs, "backward_s", seconds(0.7))
    fwd, bwd, _ = timing.time_call(layer, (x,), {}, 1)
    assert fwd == pytest.approx(0.5 - idle[0]) and bwd == pytest.approx(0.7 - idle[1])
    assert 0 < idle[0] < 0.5 and 0 < idle[1] < 0.7


def test_a_slow_warm_up_does_not_cut_the_timed_runs():
    """The warm-up compiles (a `tf.function` traces): it does not say how
    long the call runs, so it does not decide how often it is timed."""
    import time

    from keras_autovm.mechanisms.timing import LONG_RUN_S
    from keras_autovm.mechanisms.timing import median_seconds

    calls = []

    def run():
        if not calls:
            time.sleep(2 * LONG_RUN_S)  # Compiling.
        calls.append(1)

    median_seconds(run, lambda result: None, 3)
    assert len(calls) == 1 + 3


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's layer timing")
def test_tensorflow_times_the_second_call_on_copies(monkeypatch):
    """Two calls on the same tensors have a backward that adds their
    gradients, which a training step does not: the second reads copies."""
    from keras_autovm.mechanisms.tensorflow import timing

    made = []
    init = timing._Runs.__init__
    monkeypatch.setattr(timing._Runs, "__init__",
                        lambda self, forward, arguments: made.append(arguments)
                        or init(self, forward, arguments))
    layer = keras.layers.Dense(8)
    x = keras.ops.ones((4, 8))
    layer(x)
    assert all(t > 0 for t in timing.time_call(layer, (x,), {}, 1)[:2])
    (first, second) = made[-1]
    for ours, copy in zip(first[0] + first[1], second[0] + second[1], strict=True):
        assert ours is not copy
        np.testing.assert_array_equal(ours, copy)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's layer timing")
def test_tensorflow_times_a_call_with_an_output_that_is_none():
    from keras_autovm.mechanisms.tensorflow import timing

    class WithNone(keras.layers.Layer):
        def call(self, x):
            return {"y": x * 2.0, "aux": None}

    x = keras.ops.ones((4, 8))
    layer = WithNone()
    layer(x)
    fwd, bwd, _ = timing.time_call(layer, (x,), {}, 1)
    assert fwd > 0 and bwd > 0


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's layer timing")
def test_tensorflow_measures_what_a_call_allocates_for_a_moment(monkeypatch):
    """Keras's batch normalization is composite on TensorFlow: its backward
    makes temporaries the size of its output, which the planner must hold
    while it runs. An elementwise layer makes about none. Measured in the
    CPU's memory here; without a GPU, AutoVM measures none."""
    from keras_autovm.mechanisms.tensorflow import timing

    import tensorflow as tf

    layer = keras.layers.BatchNormalization()
    x = keras.ops.ones((8, 32, 32, 16))
    layer(x)
    if not tf.config.list_logical_devices("GPU"):
        assert timing.time_call(layer, (x,), {"training": True}, 1).workspace_bytes == 0
    monkeypatch.setattr(timing, "_memory_device", lambda: "CPU:0")

    x = keras.ops.ones((8, 64, 64, 16))
    output_bytes = 8 * 64 * 64 * 16 * 4
    norm, relu = keras.layers.BatchNormalization(), keras.layers.ReLU()
    norm(x), relu(x)
    measured = timing.time_call(norm, (x,), {"training": True}, 1)
    assert measured.workspace_bytes >= 2 * output_bytes
    assert timing.time_call(relu, (x,), {}, 1).workspace_bytes < 2 * output_bytes


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's layer timing")
def test_tensorflow_transient_is_the_most_above_before_and_after(cpu_memory):
    """What the run keeps (its result) is not a temporary; what it makes
    and frees inside is."""
    import tensorflow as tf

    from keras_autovm.mechanisms.tensorflow import timing


    n = 1 << 20
    x = tf.zeros([n], tf.uint8)
    keep = timing._transient(lambda: x + 1)
    made = timing._transient(lambda: tf.reduce_sum(tf.cast(x, tf.float32)))
    assert keep < n // 2
    assert made >= 4 * n  # The float32 copy, freed before the sum returns.


def test_a_measured_workspace_reaches_the_plan_scaled_with_the_batch(tmp_path):
    model = small_cnn()
    base = fake_profile(model, 8)
    layers = tuple(dataclasses.replace(t, workspace_bytes=(8 << 20) if t.name == "bn1" else 0)
                   for t in base.layers)
    profile = dataclasses.replace(base, layers=layers)
    path = str(tmp_path / "p.json")
    profile.save(path)
    assert profiling.Profile.load(path) == profile
    plain = keras_autovm.plan(model, 8, "1GiB", policy="keep_all", profile=base)
    with_it = keras_autovm.plan(model, 8, "1GiB", policy="keep_all", profile=path)
    half = keras_autovm.plan(model, 4, "1GiB", policy="keep_all", profile=profile)
    ops = {op.name: op for op in with_it.graph.ops}
    assert ops["bn1"].workspace_bytes == 8 << 20
    assert all(op.workspace_bytes == 0 for op in plain.graph.ops)
    assert {op.name: op.workspace_bytes for op in half.graph.ops}["bn1"] == 4 << 20
    assert with_it.result.peak_bytes > plain.result.peak_bytes + (7 << 20)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's layer timing")
def test_tensorflow_workspace_leaves_out_a_copy_of_the_weight_gradient(cpu_memory):
    """A Dense layer's backward makes one copy of its kernel's gradient: it
    does not grow with the batch, and the plan counts weight gradients with
    the weights."""
    from keras_autovm.mechanisms.tensorflow import timing
    from keras_autovm.mechanisms.timing import call_values
    from keras_autovm.mechanisms.timing import variable_values

    # Large against what the rest of the process may allocate meanwhile
    # (the CPU's allocator is the whole process's).
    layer = keras.layers.Dense(1024)
    x = keras.ops.ones((8, 2048))
    layer(x)
    tv, ntv = variable_values(layer)
    runs = timing._Runs(lambda tv, xs: call_values(layer, tv, ntv, (xs[0],), {}), [(tv, [x])])
    gradient = runs._gradient()
    gradient()
    kernel_bytes = 2048 * 1024 * 4
    assert timing._transient(gradient) >= kernel_bytes
    assert timing.time_call(layer, (x,), {}, 1).workspace_bytes < kernel_bytes // 4


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's layer timing")
def test_tensorflow_workspace_of_a_call_the_layout_optimizer_wraps_is_not_measured(
        monkeypatch, cpu_memory):
    """Alone, a GPU convolution is wrapped in transposes a step does not
    pay at each layer: such a call's workspace is left to the first step."""
    import types

    from keras_autovm.mechanisms.tensorflow import internals
    from keras_autovm.mechanisms.tensorflow import timing

    layer = keras.layers.BatchNormalization()
    x = keras.ops.ones((8, 32, 32, 16))
    layer(x)
    graphs = internals.tf_function_graphs

    def with_transpose(name):
        def listed(fn, *args):
            transpose = types.SimpleNamespace(op="Transpose", name=name)
            return graphs(fn, *args) + [types.SimpleNamespace(
                post_optimization_graph=types.SimpleNamespace(node=[transpose]))]
        return listed

    def measured():
        return timing.time_call(layer, (x,), {"training": True}, 1).workspace_bytes

    assert measured() > 0
    # A layer's own transpose (a Permute) is what a step runs too.
    monkeypatch.setattr(internals, "tf_function_graphs", with_transpose("bn/transpose"))
    assert measured() > 0
    monkeypatch.setattr(internals, "tf_function_graphs",
                        with_transpose("bn/x-TransposeNHWCToNCHW-LayoutOptimizer"))
    assert measured() == 0
    # No graph listed: what ran is not known, so nothing is counted.
    monkeypatch.setattr(internals, "tf_function_graphs", lambda fn, *args: fn(*args) and [])
    assert measured() == 0


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's layer timing")
def test_tensorflow_workspace_is_decided_by_the_backward(monkeypatch, cpu_memory):
    """The backward's graphs decide, and its memory: a forward that makes
    a large temporary it does not save is not what the backward holds."""
    from keras_autovm.mechanisms.tensorflow import timing

    class Wide(keras.layers.Layer):
        def call(self, x):  # An 8x temporary, gone before the forward ends.
            scale = keras.ops.mean(keras.ops.tile(x, (8, 1)))
            return keras.layers.Activation("softsign")(x) * keras.ops.stop_gradient(scale)

    seen = []
    check = timing._layout_transposed
    monkeypatch.setattr(timing, "_layout_transposed",
                        lambda graphs: seen.append(graphs) or check(graphs))
    x = keras.ops.ones((256, 1024))
    layer = Wide()
    layer(x)
    workspace = timing.time_call(layer, (x,), {}, 1).workspace_bytes
    ops = {n.op for g in seen[-1] for n in g.post_optimization_graph.node}
    assert "SoftsignGrad" in ops and "Softsign" not in ops and "Tile" not in ops
    assert workspace < 4 * 256 * 1024 * 4  # The forward's tile is 8 inputs.


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's layer timing")
def test_tensorflow_graph_listing_holds_only_what_the_call_instantiated():
    """Functions instantiated before the listing (another layer's, timed
    before) are not listed with the call's own."""
    import tensorflow as tf

    from keras_autovm.mechanisms.tensorflow import internals

    x = tf.ones((3,))
    internals.tf_function_graphs(tf.function(lambda x: tf.math.sin(x)), x)
    before = tf.function(lambda x: tf.math.cos(x))
    before(x)  # Instantiated between two listings, in neither.
    graphs = internals.tf_function_graphs(tf.function(lambda x: tf.math.tan(x)), x)
    ops = {n.op for g in graphs for n in g.post_optimization_graph.node}
    assert "Tan" in ops and "Cos" not in ops


def test_an_unmeasured_workspace_leaves_the_ops_own():
    """torch measures its workspaces apart (`mechanisms/torch/profile.py`),
    before the times are applied: a profile's 0 must not erase them."""
    model = small_cnn()
    profile = fake_profile(model, 8)
    graph = keras_autovm.plan(model, 8, "1GiB", policy="keep_all").graph
    graph = dataclasses.replace(graph, ops=tuple(
        dataclasses.replace(op, workspace_bytes=1234) for op in graph.ops))
    assert all(op.workspace_bytes == 1234 for op in profile.apply(graph).ops)
