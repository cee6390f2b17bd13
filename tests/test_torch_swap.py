"""torch: what each layer saves is measured, layer outputs are freed after
their last forward reader, and swapped ones come back bit for bit."""

import warnings

import keras
import numpy as np
import pytest

import keras_autovm
from keras_autovm import internals
from keras_autovm import mechanisms
from conftest import BACKEND, data, skip_model, small_cnn

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="the torch mechanism")


@pytest.fixture(autouse=True)
def swap_small_tensors(monkeypatch):
    from keras_autovm.mechanisms.torch import swap
    monkeypatch.setattr(swap, "MIN_BYTES", 0)


def train(model_fn, callbacks=(), epochs=2):
    keras.utils.set_random_seed(7)
    model = model_fn()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(*data(32), batch_size=8, epochs=epochs, shuffle=False, verbose=0,
              callbacks=list(callbacks))
    return model


def autovm(policy):
    return keras_autovm.AutoVM(budget="1GiB", policy=policy, verbose=0,
                               apply_without_gpu=True)


def test_profile_finds_what_torch_layers_save():
    from keras_autovm.mechanisms.torch import profile
    saved = profile.measure(small_cnn())
    # Keras's channels-last convolution saves a copy of its input, not the
    # input; with a fused relu it saves its own output.
    assert "r1" not in saved["c2"].tags and "c2" in saved["c2"].tags
    assert saved["c2"].internal[1] == 16 * 16 * 8 * 4
    # Run as AutoVM runs it, on a view of its input, it saves the input
    # itself: no copy per sample (the kernel's channels-last copy is left).
    with internals.torch_inputs_on_views():
        viewed = profile.measure(small_cnn())
    assert {"r1", "c2"} <= viewed["c2"].tags and viewed["c2"].internal[1] == 0
    # A ReLU layer saves its output; batch norm its input.
    assert saved["r1"].tags == {"r1"} and "c1" in saved["bn1"].tags
    graph = keras_autovm.plan(small_cnn(), 8, budget="1GiB").graph
    tensors = graph.tensor_map
    assert tensors["r1"].bwd_readers == ("r1", "c2")
    assert tensors["c2:saved"].internal and tensors["c2:saved"].bwd_readers == ("c2",)
    assert tensors["c2:saved"].nbytes == viewed["c2"].internal_bytes(8) == 8 * 8 * 9 * 4


def test_measured_transients_become_workspace():
    """What a layer allocates only while it runs (measured on a GPU) is the
    op's workspace in the plan, scaled to the batch size."""
    from keras_autovm.mechanisms.torch import profile
    model = small_cnn()
    measured = profile.measure(model)
    measured["c2"] = profile.Saved(measured["c2"].tags, measured["c2"].internal,
                                   workspace=(1000.0, 64.0))
    graph = keras_autovm.budget.build_graph(model, 8)
    ops = {op.name: op for op in profile.adjust(graph, measured).ops}
    assert ops["c2"].workspace_bytes == 1000 + 64 * 8
    assert ops["c3"].workspace_bytes == measured["c3"].workspace_bytes(8)


def test_profile_changes_no_layer_state():
    model = small_cnn()
    before = model.get_weights()
    from keras_autovm.mechanisms.torch import profile
    profile.measure(model)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("policy", ["keep_all", "offload_all", "greedy_offload",
                                    "sqrt_offload", "sqrt_recompute"])
@pytest.mark.parametrize("model_fn", [small_cnn, skip_model])
def test_weights_are_bit_identical(model_fn, policy):
    reference = train(model_fn)
    callback = autovm(policy)
    model = train(model_fn, [callback])
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    stats = callback.report.stats
    if policy == "keep_all":  # 1 GiB holds every output: nothing to free.
        assert callback.plan.unchanged and stats["bytes_freed_early"] == 0
        assert stats["unchanged_steps"] == 8
        return
    # Outputs nobody saved are freed in the forward, under every plan.
    assert stats["bytes_freed_early"] > 0 and stats["unchanged_steps"] == 0
    # Each copy back was copied out first (a swapped output that only a
    # replayed segment reads is copied and not needed back).
    assert stats["bytes_to_device"] <= stats["bytes_to_host"]


def test_keep_all_frees_outputs_where_holding_them_does_not_fit():
    """Between the peak with every output held (the step unchanged) and the
    peak with outputs freed early, keep-all runs under the hooks."""
    planned = keras_autovm.plan(small_cnn(), 8, budget="1GiB", policy="keep_all",
                                headroom=0.0)
    held = planned.result.peak_bytes
    freed = keras_autovm.planner.simulate(planned.graph, cost=planned.cost).peak_bytes
    assert planned.unchanged and freed < held
    reference = train(small_cnn)
    callback = keras_autovm.AutoVM(budget=(freed + held) // 2, policy="keep_all",
                                   headroom=0.0, verbose=0, apply_without_gpu=True)
    model = train(small_cnn, [callback])
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert not callback.plan.unchanged
    assert callback.plan.result.peak_bytes <= (freed + held) // 2
    stats = callback.report.stats
    assert stats["bytes_freed_early"] > 0 and stats["unchanged_steps"] == 0


def test_a_step_that_ran_unchanged_and_now_runs_under_the_hooks_is_a_replan(monkeypatch):
    planned = keras_autovm.plan(small_cnn(), 8, budget="1GiB", policy="keep_all",
                                headroom=0.0)
    callback = keras_autovm.AutoVM(budget=int(planned.result.peak_bytes * 1.05),
                                   policy="keep_all", headroom=0.0, verbose=0,
                                   apply_without_gpu=True)
    cls = type(keras_autovm.mechanisms.get())
    monkeypatch.setattr(cls, "reset_peak", lambda self: True)
    # Measured 10% over the plan: holding every output no longer fits.
    monkeypatch.setattr(cls, "peak_memory", lambda self: int(
        callback.plan.result.peak_bytes * 1.1))
    reference = train(small_cnn)
    model = train(small_cnn, [callback])
    first, second = callback.report.epochs
    assert first["replanned"] and not second.get("replanned")
    assert not callback.plan.unchanged and callback.plan.policy == "keep_all"
    stats = callback.report.stats
    assert stats["unchanged_steps"] == 4 and stats["bytes_freed_early"] > 0
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_swapping_a_layers_own_saved_tensors():
    callback = autovm("offload_all")
    train(small_cnn, [callback], epochs=1)
    plan = callback.plan
    assert plan.actions["c2:saved"] == "swap"
    assert callback.report.stats["bytes_to_host"] >= plan.graph.tensor_map["c2:saved"].nbytes


def test_copies_come_back_at_the_plans_prefetch_point():
    # Each swapped tensor with a prefetch point is fetched by the hook on
    # that layer's gradient, ahead of its use; none waits until autograd
    # unpacks it. (The prefetch hooks used to find no copy: a tag was
    # forgotten once its storage was freed, before the prefetch layer ran,
    # so every copy back started only where it was needed.)
    callback = autovm("offload_all")
    train(small_cnn, [callback], epochs=1)
    plan, stats = callback.plan, callback.report.stats
    swapped = [t for t, a in plan.actions.items() if a == "swap"]
    early = [t for t in swapped if plan.prefetch.get(t)]
    assert early, plan.prefetch
    steps = 4
    assert stats["copy_backs_prefetched"] >= len(early) * steps, stats
    late = [t for t in swapped if not plan.prefetch.get(t)]
    assert stats["copy_backs_at_use"] <= len(late) * steps * 2, (stats, late)


def test_bookkeeping_is_per_step_and_bounded():
    """The host pool is allocated once per fit and reused by every step."""
    callback = autovm("offload_all")
    train(small_cnn, [callback], epochs=2)
    mechanism = callback._mechanism
    assert mechanism._pool is not None
    steps = 2 * 4
    per_step = callback.report.stats["bytes_to_host"] / steps
    assert per_step <= mechanism._pool.nbytes


def test_profile_leaves_no_graph_behind():
    """Measuring must not keep the forward's graph (and its saved tensors)
    alive: a pack hook returning a node's own output makes a cycle."""
    import gc
    import torch
    from keras_autovm.mechanisms.torch import profile
    model = small_cnn()
    profile.measure(model)
    gc.collect()
    alive = [o for o in gc.get_objects()
             if type(o) in (torch.Tensor, torch.nn.Parameter) and o.grad_fn is not None]
    assert not alive, [tuple(t.shape) for t in alive[:5]]


def test_profile_leaves_the_global_generator_alone():
    import torch
    from keras_autovm.mechanisms.torch import profile
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(1)(keras.layers.Dropout(0.5)(
        keras.layers.Dense(16, name="d")(inputs)))
    model = keras.Model(inputs, outputs)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    profile.measure(model)
    # A draw from torch's generator during measuring would shift the
    # numbers that training (dropout, shuffling) draws afterwards.
    assert torch.equal(torch.rand(4), expected)


def test_swapped_storage_goes_back_to_the_allocator_before_its_copy_ends():
    # Held until a poll saw its copy done, a storage was freed in the CPU's
    # time, layers behind the GPU: about 0.8 GiB over the plan on VGG-19.
    # With CUDA, `record_stream` (in `_copy_out`) keeps the block from
    # being reused before the copy ends.
    import torch

    from keras_autovm.mechanisms.torch import swap

    class Layout:
        max_in_flight = None

    step = swap.Step(Layout(), None, None, {"bytes_freed_early": 0}, [])
    tensor = torch.ones(1 << 20)
    storage = tensor.untyped_storage()
    key = storage.data_ptr()
    step.storages[key] = storage
    step.copies[key] = swap.Copy(torch.empty(storage.nbytes(), dtype=torch.uint8),
                                 storage.nbytes(), tensor.device)
    step._free(key)
    assert storage.nbytes() == 0
    assert step.stats["bytes_freed_early"] == 4 << 20


def test_the_forward_waits_for_copies_over_the_in_flight_bound_and_says_how_long():
    import time

    from keras_autovm.mechanisms.torch import swap

    class Layout:
        max_in_flight = 100

    class Copying:  # A copy to host that ends when waited for.
        def __init__(self):
            self.done = False

        def query(self):
            return self.done

        def synchronize(self):
            time.sleep(0.01)
            self.done = True

    step = swap.Step(Layout(), None, None, {"forward_wait_s": 0.0}, [])
    first, second, third = Copying(), Copying(), Copying()
    for copy, nbytes in [(first, 80), (second, 80), (third, 20)]:
        step.copying(copy, nbytes)
    step._bound_in_flight()
    # The oldest copy is waited for, until what is left is within the bound.
    assert first.done and not second.done
    assert [n for _, n in step.in_flight] == [80, 20] and step.in_flight_bytes == 100
    assert step.stats["forward_wait_s"] >= 0.01
    waited = step.stats["forward_wait_s"]
    step._bound_in_flight()
    assert step.stats["forward_wait_s"] == waited


class _RunsOutOnce(keras.layers.Layer):
    """Raises CUDA's out-of-memory error in the first training step (batch
    size 8; AutoVM's profile runs smaller ones), after batch norm and
    dropout before it have updated their state."""

    failures = 0

    def call(self, x, training=None):
        import torch
        if training and x.shape[0] == 8 and _RunsOutOnce.failures == 0:
            _RunsOutOnce.failures += 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to "
                                              "allocate 2.00 MiB (a test)")
        return x

    def _raise_for_test(self):
        import torch
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (a test)")


def _flaky_cnn():
    return keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.Conv2D(8, 3, padding="same", name="c1"),
        keras.layers.BatchNormalization(name="bn1"),
        keras.layers.Dropout(0.3, seed=1, name="d1"),
        _RunsOutOnce(name="flaky"),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c2"),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c3"),
        keras.layers.GlobalAveragePooling2D(name="gap"),
        keras.layers.Dense(4, name="head"),
    ])


def _roomy_budget():
    """The keep-all plan, and a budget 1.3x what it needs: `auto` keeps all."""
    keras.utils.set_random_seed(7)
    model = _flaky_cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    keep = keras_autovm.plan(model, batch_size=8, budget="1GiB", policy="keep_all",
                             headroom=0)
    budget = int(keep.result.peak_bytes / (1 - mechanisms.get().default_headroom) * 1.3)
    return keep, budget


def test_first_step_out_of_memory_is_replanned_and_run_again():
    # The step ran out of memory under a plan that fit the budget: AutoVM
    # learns that the model needs at least the whole budget's worth more,
    # replans tighter, restores what the failed forward changed, and trains
    # to the weights of a run that never failed.
    keep, budget = _roomy_budget()

    def run(fails):
        _RunsOutOnce.failures = 0 if fails else 1
        callback = keras_autovm.AutoVM(budget=budget, verbose=0, apply_without_gpu=True)
        return train(_flaky_cnn, [callback]), callback

    theirs, quiet = run(fails=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, replanned = run(fails=True)
    said = [str(w.message) for w in caught if "ran out of GPU memory" in str(w.message)]
    assert len(said) == 1, said
    assert quiet.report.plan.counts()["keep"] == len(quiet.report.plan.actions)
    assert replanned.report.stats["out_of_memory_replans"] == 1
    assert replanned.report.plan.result.peak_bytes < keep.result.peak_bytes
    assert replanned.report.stats["memory_scale"] >= budget / keep.result.peak_bytes
    for a, b in zip(theirs.get_weights(), ours.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("headroom, margin", [(0.0, 1.05), (0.05, 1.0), (0.15, 1.0)])
def test_an_out_of_memory_replan_adds_only_the_margin_the_headroom_lacks(headroom, margin):
    # The step needed more than the device (here the budget: no GPU) under a
    # plan predicted at the keep-all peak. The retried plan must be 1/1.05
    # of it or less; a headroom of 5% or more already makes it so.
    keep, budget = _roomy_budget()
    _RunsOutOnce.failures = 0
    callback = keras_autovm.AutoVM(budget=budget, verbose=0, apply_without_gpu=True,
                                   headroom=headroom, profile=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(_flaky_cnn, [callback])
    need = budget / keep.result.peak_bytes
    assert callback.report.stats["memory_scale"] == pytest.approx(need * margin, rel=1e-6)
    assert callback.report.plan.result.peak_bytes <= keep.result.peak_bytes / 1.05


def test_an_out_of_memory_replan_shrinks_where_the_budget_exceeds_the_device(monkeypatch):
    # A budget above the card's memory: the step needed more than the plan
    # predicted, though the device is smaller than the prediction. The
    # retried plan is still 1/1.05 of the one that failed, or less.
    keep, budget = _roomy_budget()
    device = int(keep.result.peak_bytes * 0.9)
    monkeypatch.setattr(type(mechanisms.get()), "device_memory", lambda self: device)
    _RunsOutOnce.failures = 0
    callback = keras_autovm.AutoVM(budget=budget, verbose=0, apply_without_gpu=True,
                                   headroom=0.05, profile=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(_flaky_cnn, [callback])
    assert callback.report.stats["out_of_memory_replans"] == 1
    assert callback.report.plan.result.peak_bytes <= keep.result.peak_bytes / 1.05


def test_a_failed_step_leaves_no_activations_behind(monkeypatch):
    # Saved-tensor hooks make cycles through autograd's C++ graph (a saved
    # output holds its own node), which only a finished backward breaks:
    # without letting go of them, a step that ran out of memory kept its
    # activations, and the step run again under the new plan ran out too.
    import gc
    import weakref

    from keras_autovm.mechanisms.torch import swap
    saved = []
    pack = swap.Step.pack

    def recording(self, tensor):
        if tensor.dim() == 4 and tensor.shape[0] == 8:
            saved.append(weakref.ref(tensor))
        return pack(self, tensor)

    monkeypatch.setattr(swap.Step, "pack", recording)
    _RunsOutOnce.failures = 0
    _, budget = _roomy_budget()
    callback = keras_autovm.AutoVM(budget=budget, verbose=0, apply_without_gpu=True)
    callback.on_train_end = lambda logs=None: None  # The model stays patched.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train(_flaky_cnn, [callback], epochs=1)
        gc.collect()
        assert callback._runtime.stats["out_of_memory_replans"] == 1
        assert saved and not [r for r in saved if r() is not None]
    finally:
        if callback._patches is not None:  # What `on_train_end` undoes.
            callback._patches.close()


def test_a_replay_leaves_nothing_for_the_cycle_collector():
    # torch's checkpoint stops a replay early by raising an exception whose
    # traceback holds the replay's frames, with their tensors: a cycle that
    # kept a step's recomputed activations until Python's collector
    # happened to run, which GPU memory does not prompt. Keras's torch tree
    # functions leave the tensors a layer call walks in cycles too: a
    # replayed VGG-19 block1 output (1.2 GiB) outlived its step on an H100.
    import gc
    import types

    import torch
    left = []

    def layer_output(o):  # Not the input batch (8, 16, 16, 3), not Keras's loss.
        return isinstance(o, torch.Tensor) and o.ndim == 4 and o.shape[-1] != 3

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            left.append((sum(isinstance(o, types.TracebackType) for o in gc.garbage),
                         sum(layer_output(o) for o in gc.garbage)))
            gc.set_debug(0)
            gc.garbage.clear()

    train(small_cnn, epochs=1)  # Lazy imports (a failed one leaves a cycle) first.
    gc.collect()
    gc.disable()
    try:
        callback = keras_autovm.AutoVM(budget="1GiB", policy="sqrt_recompute",
                                       verbose=0, apply_without_gpu=True)
        train(small_cnn, [callback, Count()], epochs=1)
    finally:
        gc.enable()
    assert callback.report.plan.counts()["recompute"] > 0
    assert left and left == [(0, 0)] * len(left)


def test_out_of_memory_in_the_optimizer_is_not_rerun():
    # Weights may be half updated there: the error is the user's.
    import torch

    from keras_autovm.mechanisms.torch.mechanism import TorchMechanism

    def from_optimizer():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (a test)")

    from_optimizer.__code__ = from_optimizer.__code__.replace(
        co_filename="/site-packages/keras/src/optimizers/adam.py")
    mechanism = TorchMechanism()
    for fn, expected in ((from_optimizer, False), (_RunsOutOnce()._raise_for_test, True)):
        try:
            fn()
        except Exception as error:  # noqa: BLE001
            assert mechanism.out_of_memory(error) is expected
    assert not mechanism.out_of_memory(ValueError("out of memory"))


def test_expandable_segments_unless_the_user_chose():
    from keras_autovm.mechanisms.torch.mechanism import expandable_segments
    assert expandable_segments({})
    assert expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})
    assert not expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert not expandable_segments(
        {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True"})


def test_a_layer_backward_is_timed_less_what_the_timing_costs_a_call(monkeypatch):
    from keras_autovm.mechanisms.torch import timing
    assert timing.grad_call_s() > 0
    layer = keras.layers.Dense(4)
    x = keras.ops.ones((2, 4))
    layer(x)
    # Every run timed at 4 ms, the timing's own cost at 1 ms.
    monkeypatch.setattr(timing, "median_seconds", lambda run, wait, repeats: 0.004)
    monkeypatch.setattr(timing, "grad_call_s", lambda: 0.001)
    assert timing.time_call(layer, (x,), {}, repeats=3) == (0.004, pytest.approx(0.003))
    monkeypatch.setattr(timing, "grad_call_s", lambda: 0.01)
    assert timing.time_call(layer, (x,), {}, repeats=3) == (0.004, 0.0)


class _FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append((self.name, "waits for", other.name))

    def wait_event(self, event):
        self.log.append((self.name, "waits for", event.name, event.recorded))


class _FakeEvent:
    made = 0

    def __init__(self):
        _FakeEvent.made += 1
        self.name, self.recorded = f"event {_FakeEvent.made}", None

    def record(self, stream):
        self.recorded = stream.name


def test_each_copy_waits_for_compute_through_one_event_per_stream_recorded_again():
    # `wait_stream` made an event per copy: hundreds a step.
    from keras_autovm.mechanisms.torch import streams

    log, _FakeEvent.made = [], 0
    pair = streams.Streams(_FakeStream("to_host", log), _FakeStream("to_device", log),
                           event=_FakeEvent)
    compute, other = _FakeStream("compute", log), _FakeStream("other", log)
    pair.order_after(pair.to_host, compute)
    pair.order_after(pair.to_host, other)
    pair.order_after(pair.to_device, compute)
    # Each wait sees its event as last recorded, on the stream waited for.
    assert log == [("to_host", "waits for", "event 1", "compute"),
                   ("to_host", "waits for", "event 1", "other"),
                   ("to_device", "waits for", "event 2", "compute")]
    assert _FakeEvent.made == 2


def test_copies_run_on_their_stream_and_the_stream_before_comes_back(monkeypatch):
    import torch
    from keras_autovm.mechanisms.torch import streams

    current = ["compute"]
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: current.append(s))

    def work():
        assert current[-1] == "copies"
        raise RuntimeError("a copy failed")

    with pytest.raises(RuntimeError, match="a copy failed"):
        streams.run_on("copies", work, "compute")
    assert current == ["compute", "copies", "compute"]
    assert streams.run_on("copies", lambda: 7, "compute") == 7


def _step_on_fake_streams(monkeypatch, log):
    """A `Step` on CPU tensors whose stream calls are logged: the calls a
    GPU makes, in the order they are made."""
    import torch
    from keras_autovm.mechanisms.torch import streams, swap

    pair = streams.Streams(_FakeStream("to_host", log), _FakeStream("to_device", log),
                           event=_FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: _FakeStream("compute", log))
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: log.append(("current", s.name)))
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, s: log.append(("block kept for", s.name)), raising=False)
    monkeypatch.setattr(pair.to_host, "wait_stream", lambda other: None, raising=False)

    class Layout:
        max_in_flight = None

    stats = {"bytes_to_host": 0, "bytes_to_device": 0}
    return swap.Step(Layout(), swap.HostPool(1 << 21, pinned=False), pair, stats, [])


def test_a_copy_to_host_runs_on_its_stream_after_the_compute_before_it(monkeypatch):
    import torch
    from keras_autovm.mechanisms.torch import swap

    log, _FakeEvent.made = [], 0
    step = _step_on_fake_streams(monkeypatch, log)
    tensor = torch.arange(swap.MIN_BYTES, dtype=torch.int64).to(torch.uint8)
    step._copy_out(1, tensor.untyped_storage(), tensor.device)
    assert log == [("to_host", "waits for", "event 1", "compute"),
                   ("current", "to_host"), ("current", "compute"),
                   ("block kept for", "to_host")]
    copy = step.copies[1]
    assert copy.d2h.recorded == "to_host"  # Marks the copy's end, on its stream.
    assert torch.equal(copy.host, tensor)
    assert step.in_flight_bytes == swap.MIN_BYTES


def test_a_copy_back_runs_on_its_stream_after_compute_and_its_copy_to_host(monkeypatch):
    import torch
    from keras_autovm.mechanisms.torch import swap

    log, _FakeEvent.made = [], 0
    step = _step_on_fake_streams(monkeypatch, log)
    d2h = _FakeEvent()
    d2h.record(_FakeStream("to_host", log))
    copy = swap.Copy(torch.arange(16, dtype=torch.uint8), 16, "cpu", d2h)
    step.fetch(copy)
    assert log == [("to_device", "waits for", "event 2", "compute"),
                   ("to_device", "waits for", "event 1", "to_host"),
                   ("current", "to_device"), ("current", "compute")]
    assert copy.h2d.recorded == "to_device" and copy.stream is step.streams.to_device
    assert torch.equal(copy.gpu, copy.host)


def test_a_copy_back_dropped_unread_keeps_its_block_until_the_copy_is_done():
    # Compute waited for a copy back it read; one it never read must be
    # marked with `record_stream` on its stream as it is dropped, or the
    # allocator could hand the block out while the copy still writes it.
    from keras_autovm.mechanisms.torch import swap

    class Block:
        def __init__(self, log):
            self.log = log

        def record_stream(self, stream):
            self.log.append(stream)

    log = []
    for read in (False, True):
        copy = swap.Copy(None, 8, "cuda")
        copy.gpu, copy.stream, copy.read = Block(log), "to_device", read
        del copy
    assert log == ["to_device"]
    copy = swap.Copy(None, 8, "cpu")  # Never fetched: nothing to mark.
    del copy
    assert log == ["to_device"]


def test_backward_marks_waits_and_marks_each_backward_pass():
    import importlib.util
    import pathlib
    import torch

    path = pathlib.Path(__file__).resolve().parents[1] / "recipes" / "measure.py"
    spec = importlib.util.spec_from_file_location("measure", path)
    measure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(measure)
    original = torch.Tensor.backward
    x = torch.ones(3, requires_grad=True)
    with measure.backward_marks(torch, all_streams=False, arrival=True) as marks:
        (x * 2).sum().backward()
        (x * 3).sum().backward()
    assert len(marks) == 6  # Arrival, before and after each backward.
    with measure.backward_marks(torch) as marks:
        (x * 2).sum().backward()
    assert len(marks) == 2
    assert torch.Tensor.backward is original
    np.testing.assert_array_equal(x.grad.numpy(), [7.0, 7.0, 7.0])
