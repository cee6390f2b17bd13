"""Everything AutoVM changes on a model is undone, also when `fit` fails.

Keras runs no `on_train_end` when `fit` raises, so these fail `fit` from
each place an exception can come from: another callback's hooks, the
user's data, a planning error, and after some training steps.
"""

import contextlib
import io
import types

import keras
import numpy as np
import pytest

import keras_autovm
from conftest import BACKEND, data, small_cnn
from keras_autovm.patches import Patches

# Instance attributes AutoVM sets on a model while it trains.
PATCHED = ("call", "train_step", "compute_loss_and_updates", "evaluate")


class Boom(Exception):
    pass


def fails():
    # TensorFlow re-raises an error of a generator inside its data pipeline
    # as its own error type, with the message.
    return pytest.raises(Exception, match="from (another callback|the data)")


class RaiseAt(keras.callbacks.Callback):
    """Raises `Boom` in hook `hook` at its `at`-th call."""

    def __init__(self, hook, at=0):
        super().__init__()
        self.calls = 0
        setattr(self, hook, self._maybe_raise)
        self.at = at

    def _maybe_raise(self, *args, **kwargs):
        self.calls += 1
        if self.calls > self.at:
            raise Boom("from another callback")


def compiled(seed=7):
    keras.utils.set_random_seed(seed)
    model = small_cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def autovm(**kwargs):
    kwargs.setdefault("budget", "1GiB")
    kwargs.setdefault("policy", "sqrt_recompute")
    return keras_autovm.AutoVM(verbose=0, apply_without_gpu=True, **kwargs)


def state(model):
    """What a user sees of a model: attributes, layers, summary, jit."""
    lines = []
    model.summary(print_fn=lambda line, **kwargs: lines.append(line))
    return {"patched": sorted(n for n in PATCHED if n in vars(model)),
            "layers": [(type(layer).__name__, layer.name) for layer in model.layers],
            "summary": "\n".join(lines), "jit_compile": model.jit_compile,
            "weights": [w.path for w in model.weights], "keras": keras_functions()}


def keras_functions():
    """The Keras functions a fit may swap for its length (torch: the
    convolution, max pooling and the transposes they read)."""
    if BACKEND != "torch":
        return ()
    from keras.src.backend.torch import nn
    return (nn.conv, nn.max_pool, nn._transpose_spatial_inputs,
            nn._transpose_spatial_outputs)


def flaky_batches(x, y, fail_at):
    """A generator of batches of 8 that raises on batch `fail_at`."""
    for i in range(0, len(x), 8):
        if i // 8 == fail_at:
            raise Boom("from the data")
        yield x[i:i + 8], y[i:i + 8]


def fit(model, callbacks, source="arrays", fail_at=0, epochs=2):
    x, y = data(32)
    if source == "generator":
        return model.fit(flaky_batches(x, y, fail_at), epochs=epochs,
                         steps_per_epoch=4, verbose=0, callbacks=callbacks)
    return model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=callbacks)


FAILURES = {
    # Where the exception comes from; `None` marks AutoVM's place in the
    # callback list.
    "later_on_train_begin": [None, ("on_train_begin", 0)],
    "later_on_epoch_begin": [None, ("on_epoch_begin", 0)],
    "first_batch_begin": [("on_train_batch_begin", 0), None],
    "fourth_batch_end": [None, ("on_train_batch_end", 3)],
    "epoch_end": [("on_epoch_end", 0), None],
    "train_end_before_autovm": [("on_train_end", 0), None],
}


def fail_twice(where, source="arrays"):
    """The same failing `fit`, with AutoVM and without; both models."""
    models = []
    for with_autovm in (True, False):
        model = compiled()
        # TensorFlow traces generator batches with no static size.
        callbacks = [RaiseAt(*c) if c else autovm(batch_size=8)
                     for c in FAILURES.get(where, [None])]
        if not with_autovm:
            callbacks = [c for c in callbacks if isinstance(c, RaiseAt)]
        with fails():
            fit(model, callbacks, source=source, fail_at=2)
        models.append(model)
    return models


@pytest.mark.parametrize("where", sorted(FAILURES))
def test_failed_fit_gives_the_model_back(where):
    model, plain = fail_twice(where)
    assert state(model) == state(plain)
    assert state(model)["patched"] == []
    if where != "fourth_batch_end":  # The same steps ran: the same weights.
        for a, b in zip(plain.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(a, b)


def test_failing_data_gives_the_model_back():
    model, plain = fail_twice("data", source="generator")
    assert state(model) == state(plain)
    assert state(model)["patched"] == []


def test_planning_error_gives_the_model_back():
    model = compiled()
    before = state(model)
    with pytest.raises(keras_autovm.PlanError):
        fit(model, [autovm(budget=1000, policy="auto")])
    assert state(model)["patched"] == [] and state(model)["layers"] == before["layers"]


@pytest.mark.parametrize("where", ["first_batch_begin", "data"])
def test_after_a_failed_fit_plain_training_is_bit_identical(where):
    """A model whose AutoVM fit failed trains exactly like one that never
    saw AutoVM."""
    model = compiled()
    with fails():
        if where == "data":
            fit(model, [autovm(batch_size=8)], source="generator", fail_at=0)
        else:
            fit(model, [RaiseAt("on_train_batch_begin"), autovm()])
    fit(model, [])
    reference = compiled()
    fit(reference, [])
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_failure_after_training_steps_leaves_a_plain_model():
    model = compiled()
    with pytest.raises(Boom):
        fit(model, [autovm(), RaiseAt("on_train_batch_end", at=3)])
    assert state(model)["patched"] == []
    # Same weights, trained on plainly (SGD without momentum is stateless).
    twin = compiled(seed=8)
    twin.set_weights(model.get_weights())
    fit(model, [], epochs=1)
    fit(twin, [], epochs=1)
    for a, b in zip(twin.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_successful_fit_changes_nothing_either():
    model, plain = compiled(), compiled()
    fit(model, [autovm()])
    fit(plain, [])
    assert state(model) == state(plain)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="jit_compile is switched "
                    "off only for TensorFlow's page-moving ops")
def test_jit_compile_is_restored_after_a_failed_fit():
    model = compiled()
    model.jit_compile = True
    with pytest.raises(Boom):
        fit(model, [autovm(policy="offload_all"), RaiseAt("on_train_batch_end")])
    assert model.jit_compile is True


def test_patches_undo_in_reverse_and_once():
    class Thing:
        prop_value = 1

        @property
        def prop(self):
            return self.prop_value

        @prop.setter
        def prop(self, value):
            self.prop_value = value

    thing = Thing()
    thing.kept = "old"
    patches = Patches()
    patches.set(thing, "kept", "new")
    patches.set(thing, "added", 1)
    patches.set(thing, "added", 2)
    patches.set(thing, "prop", 5)
    assert (thing.kept, thing.added, thing.prop) == ("new", 2, 5)
    patches.close()
    assert (thing.kept, thing.prop) == ("old", 1) and not hasattr(thing, "added")
    thing.kept = "later"
    patches.close()  # A second close changes nothing.
    assert thing.kept == "later" and patches.closed


def test_entered_contexts_exit_on_close_in_order():
    events = []

    @contextlib.contextmanager
    def context(name):
        events.append(f"enter {name}")
        yield name
        events.append(f"exit {name}")

    thing = types.SimpleNamespace(value="old")
    patches = Patches()
    assert patches.enter(context("a")) == "a"
    patches.set(thing, "value", "new")
    patches.enter(context("b"))
    patches.close()
    patches.close()  # Exits once.
    assert events == ["enter a", "enter b", "exit b", "exit a"] and thing.value == "old"


@pytest.mark.skipif(BACKEND != "torch", reason="Keras's torch convolution")
def test_torch_fit_runs_convolutions_on_views_and_puts_keras_back(cnn_data):
    from keras.src.backend.torch import nn
    conv, max_pool = nn.conv, nn.max_pool
    seen = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(nn.conv is not conv and nn.max_pool is not max_pool)

    x, y = cnn_data
    model = small_cnn()
    model.compile(optimizer="sgd", loss="mse")
    before = keras_functions()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
        keras_autovm.AutoVM(budget="1GiB", verbose=0, apply_without_gpu=True), Probe()])
    assert seen and all(seen) and keras_functions() == before


@pytest.mark.skipif(BACKEND != "torch", reason="Keras's torch convolution")
def test_torch_layers_are_measured_on_views_as_the_step_runs_them(monkeypatch):
    from keras.src.backend.torch import nn

    from keras_autovm.mechanisms.torch import mechanism as torch_mechanism
    from keras_autovm.mechanisms.torch import profile
    from keras_autovm.mechanisms.torch import timing
    conv, seen = nn.conv, []
    monkeypatch.setattr(timing, "time_call", lambda *args: seen.append(nn.conv) or (1, 1))
    monkeypatch.setattr(profile, "measure", lambda *args: seen.append(nn.conv) or {})
    mechanism = torch_mechanism.TorchMechanism()
    mechanism.time_call(None, (), {}, 1)
    with mechanism.measuring():
        seen.append(nn.conv)
    mechanism.adjust_graph(keras_autovm.budget.build_graph(small_cnn(), 2), small_cnn())
    assert len(seen) == 3 and conv not in seen and nn.conv is conv


def test_guarded_function_closes_except_at_the_end_of_data():
    patches = Patches()
    thing = type("Thing", (), {})()
    patches.set(thing, "x", 1)

    def end_of_data():
        raise StopIteration

    with pytest.raises(StopIteration):
        patches.guarded(end_of_data)()
    assert thing.x == 1 and not patches.closed
    with pytest.raises(ValueError):
        patches.guarded(lambda: int("no"))()
    assert patches.closed and not hasattr(thing, "x")


def test_on_close_is_told_the_error_that_closed_the_patches():
    told = []
    patches = Patches()
    patches.on_close(told.append)
    patches.close()  # `fit` ended.
    patches.fail(ValueError("after the end"))  # Closed already: not what closed them.
    assert told == [None] and patches.error is None
    patches, told = Patches(), []
    patches.on_close(told.append)
    with pytest.raises(KeyError):
        patches.guarded(lambda: {}["x"])()
    patches.fail(ValueError("later"))
    assert len(told) == 1 and isinstance(told[0], KeyError) and patches.error is told[0]


def test_a_plan_error_keras_re_raised_from_a_layer_call_is_kept(tmp_path):
    """Keras re-raises a layer call's `PlanError` as a `RuntimeError`; what
    the fit learnt is kept all the same (`keras_autovm.learnt.on_stop`)."""
    from keras_autovm import learnt

    told = []
    plans = types.SimpleNamespace(keep_learnt=lambda: told.append(True))

    class Plans(keras.layers.Layer):
        def call(self, x):
            raise keras_autovm.PlanError("No plan fits.", 1)

    with pytest.raises(RuntimeError) as raised:
        Plans()(np.zeros((1, 2), "float32"))
    assert not isinstance(raised.value, keras_autovm.PlanError)
    learnt.on_stop(plans)(raised.value)
    learnt.on_stop(plans)(RuntimeError("not about plans"))
    learnt.on_stop(plans)(None)
    assert told == [True]


def test_summary_is_unchanged_during_training_too():
    """The user's model keeps its own layers while AutoVM routes calls."""
    seen = []

    class Look(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            out = io.StringIO()
            self.model.summary(print_fn=lambda line, **kwargs: out.write(line))
            seen.append(("autovm" in out.getvalue(), len(self.model.layers)))

    model = compiled()
    fit(model, [autovm(), Look()], epochs=1)
    assert seen and all(not wrapped for wrapped, _ in seen)
