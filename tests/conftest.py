import os

import keras
import numpy as np
import pytest

BACKEND = keras.backend.backend()


def tf_rewrite_options(serialized=None):
    """The Grappler rewriter options of a serialized `ConfigProto`, by
    default the thread's function call options (TensorFlow only)."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context

    if serialized is None:
        serialized = context.context().function_call_options.config_proto_serialized
    config = config_pb2.ConfigProto()
    config.ParseFromString(serialized)
    return config.graph_options.rewrite_options


def small_cnn(size=16):
    """Sequential CNN with batch norm: stateful layers inside segments."""
    return keras.Sequential([
        keras.Input((size, size, 3)),
        keras.layers.Conv2D(8, 3, padding="same", name="c1"),
        keras.layers.BatchNormalization(name="bn1"),
        keras.layers.ReLU(name="r1"),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c2"),
        keras.layers.Conv2D(8, 3, padding="same", name="c3"),
        keras.layers.ReLU(name="r3"),
        keras.layers.MaxPooling2D(name="p1"),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="c4"),
        keras.layers.GlobalAveragePooling2D(name="gap"),
        keras.layers.Dense(4, name="head"),
    ], name="small_cnn")


def skip_model(size=16):
    """Functional model with residual adds and a concatenation."""
    inputs = keras.Input((size, size, 3), name="x")
    x = keras.layers.Conv2D(8, 3, padding="same", name="stem")(inputs)
    y = keras.layers.Conv2D(8, 3, padding="same", name="a1")(x)
    y = keras.layers.BatchNormalization(name="abn")(y)
    y = keras.layers.ReLU(name="ar")(y)
    y = keras.layers.Conv2D(8, 3, padding="same", name="a2")(y)
    x = keras.layers.Add(name="add1")([x, y])
    z = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="b1")(x)
    x = keras.layers.Concatenate(name="cat")([x, z])
    x = keras.layers.Conv2D(8, 1, name="proj")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    outputs = keras.layers.Dense(4, name="head")(x)
    return keras.Model(inputs, outputs, name="skip_model")


def fit_two_steps(model, size, classes, learning_rate, callbacks=()):
    """Trains `model` two SGD steps of 4 random images (`size` square) with
    random labels in `range(classes)`; returns it."""
    model.compile(optimizer=keras.optimizers.SGD(learning_rate),
                  loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, size, size, 3)).astype("float32")
    model.fit(x, rng.integers(0, classes, size=(8,)), batch_size=4, epochs=1,
              shuffle=False, verbose=0, callbacks=list(callbacks))
    return model


def data(n=32, size=16, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, size, size, 3)).astype("float32"),
            rng.normal(size=(n, 4)).astype("float32"))


@pytest.fixture
def cnn_data():
    return data()


@pytest.fixture(autouse=True, scope="session")
def profile_cache(tmp_path_factory):
    """Profiles measured by tests go to a fresh directory, not the user's
    cache; they are shared by the session (the same model is timed once)."""
    path = str(tmp_path_factory.mktemp("autovm_profiles"))
    old = os.environ.get("KERAS_AUTOVM_CACHE_DIR")
    os.environ["KERAS_AUTOVM_CACHE_DIR"] = path
    yield path
    if old is None:
        os.environ.pop("KERAS_AUTOVM_CACHE_DIR", None)
    else:
        os.environ["KERAS_AUTOVM_CACHE_DIR"] = old


def forget_learnt_overheads(path=None):
    """Removes the memory overheads fits kept beside the profiles cached
    in `path` (by default the cache in use; `keras_autovm.learnt`): the
    next fit learns its own."""
    path = path or os.environ["KERAS_AUTOVM_CACHE_DIR"]
    for name in os.listdir(path):
        if name.endswith(".learnt.json"):
            os.remove(os.path.join(path, name))


def kept_overhead(callback):
    """The memory overhead `callback`'s fit kept for the next fit of its
    model, batch size, budget and policy (`keras_autovm.learnt`)."""
    from keras_autovm import learnt
    return learnt.recall(*callback._learnt_at)


@pytest.fixture(autouse=True)
def no_learnt_overhead(profile_cache):
    """The profiles are shared by the session; the memory overheads fits
    keep beside them stay with the test that learnt them."""
    yield
    forget_learnt_overheads(profile_cache)


@pytest.fixture
def swap_small_tensors(monkeypatch):
    """torch leaves tensors under 1 MiB to autograd; the test models' are."""
    if BACKEND == "torch":
        from keras_autovm.mechanisms.torch import swap
        monkeypatch.setattr(swap, "MIN_BYTES", 0)
