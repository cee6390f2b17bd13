"""`Patches`: everything AutoVM changes on a model for one `fit`, and its undo.

AutoVM changes no weight, config or saved form. For the length of one `fit`
it routes the model's forward pass through `AutoVMWrapper`s (a clone of the
model, with each layer wrapped, sharing the original layer objects and so
their variables), hooks `train_step` to plan from each batch, lets the
backend mechanism install what it needs (JAX: the checkpointed loss;
TensorFlow with managed memory: `jit_compile` off), and retraces the
training function. Each change is recorded here as it is made; `close()`
undoes them all, newest first, once.

Keras calls no `on_train_end` when `fit` ends with an exception, so the
running `fit`'s callback hooks, its data iteration, its training function
and its validation are guarded: an exception escaping any of them closes
the patches before it leaves `fit`. The guards go in at `on_train_begin`
(`guard_fit`), the model changes at the first `on_epoch_begin` (`apply`),
so that another callback's `on_train_begin` failing after AutoVM's (which
no guard can catch: that call is already running) leaves the model alone.
"""

import contextlib
import functools

import keras

from keras_autovm import internals
from keras_autovm import oom
from keras_autovm.model_graph import tag_names
from keras_autovm.wrapper import AutoVMWrapper

# The CallbackList hooks `fit` calls between `on_train_begin` and the end.
_HOOKS = ("on_epoch_begin", "on_epoch_end", "on_train_batch_begin",
          "on_train_batch_end", "on_test_begin", "on_test_end",
          "on_test_batch_begin", "on_test_batch_end", "on_train_end")


class Patches:
    """Changes to objects, each recorded with its undo."""

    def __init__(self):
        self._undo = []
        self.closed = False
        self.error = None  # The exception that closed them (`fail`).

    def set(self, obj, name, value):
        """Sets `obj.<name> = value`, recording how to put it back."""
        if isinstance(getattr(type(obj), name, None), property):
            old = getattr(obj, name)
            self._undo.append(lambda: setattr(obj, name, old))
        elif name in vars(obj):
            old = vars(obj)[name]
            self._undo.append(lambda: setattr(obj, name, old))
        else:
            self._undo.append(lambda: vars(obj).pop(name, None))
        setattr(obj, name, value)

    def enter(self, context):
        """Enters `context` (a context manager) until `close()` exits it."""
        value = context.__enter__()
        self._undo.append(lambda: context.__exit__(None, None, None))
        return value

    def on_close(self, fn):
        """Calls `fn(error)` at `close()`, in its turn among the changes:
        `error` is the exception that closed these patches (`fail`), or
        `None` (`fit` ended)."""
        self._undo.append(lambda: fn(self.error))

    def close(self):
        """Undoes every change, newest first. Safe to call again."""
        self.closed = True
        while self._undo:
            self._undo.pop()()

    def fail(self, error):
        """Closes these patches because `error` is leaving `fit`; where
        they are open, it is the `error` that `on_close` callers see."""
        if not self.closed:
            self.error = error
        self.close()

    def guarded(self, fn):
        """`fn`, closing these patches if it raises (other than the end of
        an epoch's data, which `fit` catches and trains on)."""
        # Not `fn`'s attributes: a callable object's would be copied stale.
        @functools.wraps(fn, updated=())
        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except BaseException as error:
                if not internals.ends_epoch(error):
                    self.fail(error)
                raise
        return call


def guard_fit(fit):
    """New `Patches` that close on any exception escaping the running `fit`.

    Args:
        fit: what `internals.running_fit()` found: the `fit`'s
            `CallbackList` (every callback hook goes through it) and epoch
            iterator (data errors on torch go through its
            `catch_stop_iteration`; on TensorFlow and JAX the data is read
            inside the training function, which `apply` guards).
    """
    patches = Patches()
    callbacks = fit.get("callbacks")
    for hook in _HOOKS if callbacks is not None else ():
        if hasattr(callbacks, hook):
            patches.set(callbacks, hook, patches.guarded(getattr(callbacks, hook)))
    iterator = fit.get("epoch_iterator")
    if iterator is not None:
        original = iterator.catch_stop_iteration

        @contextlib.contextmanager
        def catch_stop_iteration():
            try:
                with original():
                    yield
            except BaseException as error:
                patches.fail(error)
                raise

        patches.set(iterator, "catch_stop_iteration", catch_stop_iteration)
    return patches


def apply(model, runtime, mechanism, patches):
    """Makes the changes to `model` one `fit` with AutoVM needs, recorded in
    `patches`; returns the mechanism's message for the user, or `None`.

    Called once the `fit`'s hooks are guarded (`guard_fit`) and every
    callback's `on_train_begin` has run: an exception from any of them then
    still finds the model unchanged.
    """
    try:
        _route_through_wrappers(model, runtime, patches)
        _hook_train_step(model, runtime, patches)
        message = mechanism.install(model, runtime, patches)
        # Validation runs inside `fit` through `model.evaluate`.
        patches.set(model, "evaluate", patches.guarded(model.evaluate))
        retrace(model, patches, runtime)
    except BaseException as error:
        patches.fail(error)
        raise
    return message


def retrace(model, patches, runtime):
    """Makes `fit` trace a new training function (the plan changed), run as
    `runtime`'s mechanism runs it."""
    # Recorded before it changes: undone newest first, the function `fit`
    # had before AutoVM comes back last.
    patches.set(model, "train_function", None)
    model.make_train_function(force=True)
    function = runtime.mechanism.training_function(model, runtime, model.train_function)
    vars(model)["train_function"] = patches.guarded(function)
    if keras.backend.backend() == "jax":
        vars(model)["train_function"] = _reattaching_state(model, model.train_function)


def _reattaching_state(model, function):
    """JAX: `function` (a `fit` step on `(state, data)`), giving the model
    its state back when the step raises (AutoVM found no plan, the device
    ran out of memory, an interrupt): Keras's `fit` took the weights out of
    the model (`internals.jax_state_reattached`)."""
    @functools.wraps(function)
    def train_function(state, data):
        try:
            return function(state, data)
        except BaseException:
            internals.jax_state_reattached(model, state)
            raise

    return train_function


def inner_layers(model):
    """Maps each op name of the model's graph to the layer to run for it."""
    return {layer.name: layer.layer if isinstance(layer, AutoVMWrapper) else layer
            for layer in model.layers}


def _route_through_wrappers(model, runtime, patches):
    """Points `model.call` at a clone whose layers are wrapped."""
    sources = {}
    with internals.uncompiled(model):
        clone = keras.models.clone_model(
            model, clone_function=lambda layer: _wrap_layer(layer, sources))
    for layer in clone.layers:
        if isinstance(layer, AutoVMWrapper):
            source = sources.get(id(layer), layer)
            patches.set(layer, "_autovm_op", (source.name, tuple(tag_names(source))))
            patches.set(layer, "_autovm_runtime", runtime)
    patches.set(model, "call", clone.call)


def _wrap_layer(layer, sources):
    # Input layers and raw `keras.ops` calls stay as they are (kept); a
    # wrapper the user built is reused, so its name stays the op's name.
    if isinstance(layer, (keras.layers.InputLayer, AutoVMWrapper)) \
            or not isinstance(layer, keras.layers.Layer):
        return layer
    wrapper = AutoVMWrapper(layer)
    sources[id(wrapper)] = layer
    return wrapper


def _hook_train_step(model, runtime, patches):
    """Plans for each batch's size before any layer runs, so that an error
    (a budget no plan meets) surfaces as itself, not re-wrapped by Keras's
    layer-call error handling; a plan's first step that runs out of device
    memory is replanned and run again where the backend allows (`oom`)."""
    original = type(model).train_step.__get__(model)

    @functools.wraps(original)
    def train_step(*args):
        # JAX passes (state, data), TensorFlow and torch (data).
        x, _, _ = keras.utils.unpack_x_y_sample_weight(args[-1])
        return oom.run_step(runtime, model, original, args, x)

    patches.set(model, "train_step", train_step)
