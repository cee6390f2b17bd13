"""`keras_autovm.applications`: every Keras Applications constructor, wrapped.

Every constructor (by default the cheapest of each family; all forty with
KERAS_AUTOVM_SLOW_TESTS=1) is built once (module fixture) at its smallest
input with `weights=None` inside `keras.StatelessScope`, where Keras defers
drawing the initial weights: wrapping and planning read shapes only, and
drawing the weights of all forty models took minutes on a CPU. A few small
models are built for real, trained a step and saved.
"""

import inspect
import os

import keras
import numpy as np
import pytest

import keras_autovm
from conftest import BACKEND, fit_two_steps
from keras_autovm import applications, internals

NAMES = sorted(name for name, value in vars(keras.applications).items()
               if name[:1].isupper() and callable(value))
# The smallest input each accepts with weights=None: 32 for most; Xception
# needs 71, the Inceptions 75.
SIZES = (32, 75)


def build(name, module=applications, **kwargs):
    """The wrapped model (or Keras's own, from `module=keras.applications`)
    at its smallest input size, and that size."""
    for size in SIZES:
        try:
            return getattr(module, name)(
                weights=None, input_shape=(size, size, 3), classes=4, **kwargs), size
        except ValueError as error:
            if "input" not in str(error).lower() or size == SIZES[-1]:
                raise
    raise AssertionError("unreachable")


def build_keras(name):
    return build(name, module=keras.applications)


RUN_SLOW = os.environ.get("KERAS_AUTOVM_SLOW_TESTS") == "1"


def family(name):
    """The keras.applications module a constructor comes from."""
    return getattr(keras.applications, name).__module__.rsplit(".", 1)[-1]


# The constructors wrapped and planned by default: the cheapest of each
# family (module). A family's other constructors repeat the same layer
# classes and blocks at other depths and widths, so they take the same
# paths through wrapping and planning. Building all forty (ConvNeXtXLarge,
# EfficientNetB7, NASNetLarge, ...) took 313 s on JAX, 77 s on TensorFlow
# and 83 s on torch on a 2-core CPU; these fifteen 89 s, 13 s and 8 s.
# KERAS_AUTOVM_SLOW_TESTS=1 wraps and plans all forty.
REPRESENTATIVES = {"ConvNeXtTiny", "DenseNet121", "EfficientNetB0",
                   "EfficientNetV2B0", "InceptionResNetV2", "InceptionV3",
                   "MobileNet", "MobileNetV2", "MobileNetV3Small", "NASNetMobile",
                   "ResNet50", "ResNet50V2", "VGG16", "VGG19", "Xception"}
PLANNED = NAMES if RUN_SLOW else sorted(REPRESENTATIVES & set(NAMES))


@pytest.fixture(scope="module")
def shapes_only():
    """Each planned constructor's wrapped model, with weights left undrawn."""
    models = {}
    with keras.StatelessScope():
        for name in PLANNED:
            try:
                models[name] = build(name)
            except ValueError as error:  # Keras's own refusal (NASNet on torch).
                if "not available with the" not in str(error):
                    raise
                models[name] = error
    return models


def test_every_constructor_is_there():
    assert NAMES and set(NAMES) <= set(applications.__all__)
    assert len(NAMES) >= 40  # Keras 3.15 has 40.
    # The default run plans one constructor of every family.
    assert {family(name) for name in PLANNED} == {family(name) for name in NAMES}


def _planned_cases():
    for name in NAMES:
        marks = [] if name in PLANNED else [pytest.mark.skip(
            reason="its family's cheapest constructor is planned; "
            "KERAS_AUTOVM_SLOW_TESTS=1 plans every constructor")]
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", NAMES)
def test_constructor_keeps_signature_and_docstring(name):
    ours, theirs = getattr(applications, name), getattr(keras.applications, name)
    assert inspect.signature(ours) == inspect.signature(theirs)
    assert ours.__name__ == name
    assert ours.__doc__.startswith(theirs.__doc__.rstrip())


@pytest.mark.parametrize("name", list(_planned_cases()))
def test_every_constructor_wraps_and_plans(shapes_only, name):
    if isinstance(shapes_only[name], ValueError):
        # Keras refuses it on this backend; ours says the same.
        with pytest.raises(ValueError, match=f"not available with the {BACKEND} backend"):
            getattr(applications, name)(weights=None)
        return
    model, size = shapes_only[name]
    layers = [layer for layer in model.layers
              if not isinstance(layer, keras.layers.InputLayer)]
    assert layers and all(isinstance(layer, keras_autovm.AutoVMWrapper)
                          for layer in layers)
    keep = keras_autovm.plan(model, batch_size=2, budget="64GiB", policy="keep_all")
    assert len(keep.actions) >= len(layers)
    # Under a budget below keeping everything, auto plans something else.
    tight = keras_autovm.plan(model, batch_size=2, policy="sqrt_recompute",
                              budget=2 * keep.result.peak_bytes)
    assert tight.counts()["recompute"] > 0, (name, size)


def _fit(model, size, callbacks=()):
    # A small step, and batches of 4: batch norm over 2 samples on random
    # labels makes large gradients, which amplify rounding.
    return fit_two_steps(model, size, 4, 1e-3, callbacks)


# One constructor of each family (module) in keras.applications: the
# cheapest, at its smallest input.
FAMILIES = ["ConvNeXtTiny", "DenseNet121", "EfficientNetB0", "EfficientNetV2B0",
            "InceptionResNetV2", "InceptionV3", "MobileNet", "MobileNetV2",
            "MobileNetV3Small", "NASNetMobile", "ResNet50", "ResNet50V2", "VGG16",
            "Xception"]
# These took 26 s to 103 s each on TensorFlow and JAX (2 s to 34 s on
# torch) on a 2-core CPU: they run when KERAS_AUTOVM_SLOW_TESTS=1
# (docs/limitations.md).
SLOW = {"DenseNet121", "EfficientNetB0", "InceptionResNetV2", "InceptionV3",
        "NASNetMobile"}
# The families that train in float64 (the rest in float32), per backend.
# The test must fail on a wrong gradient: one layer's gradient made 0.1%
# too large (deliberately, at the middle recompute segment) moved every
# family's weights by more than its tolerance here, on every backend.
# float64 where float32 cannot tell: (1) these two steps are chaotic for
# many families (batch norm over 4 samples of a few pixels), so a
# recompute that rounds differently in float32 ended up to 0.97 away
# (DenseNet121 on JAX), as far as a wrong gradient would; in
# float64 the same amplification left at most 2.6e-9. (2) VGG16,
# ConvNeXtTiny and Xception move little: the 0.1% error changed their
# weights by 1.5e-6 at most (Xception; VGG16 2.6e-10), within float32's
# tolerance. The others match Keras's own exactly in float32 (measured, on
# a CPU), where the 0.1% error moved the weights by 1.6e-4 or more; they
# keep the dtype people train in.
FLOAT64 = {
    "tensorflow": {"ConvNeXtTiny", "InceptionResNetV2", "InceptionV3",
                   "MobileNetV2", "MobileNetV3Small", "NASNetMobile", "ResNet50",
                   "ResNet50V2", "VGG16", "Xception"},
    "jax": {"ConvNeXtTiny", "DenseNet121", "EfficientNetB0", "InceptionResNetV2",
            "InceptionV3", "NASNetMobile", "VGG16", "Xception"},
    "torch": {"ConvNeXtTiny", "VGG16", "Xception"},
}[BACKEND]
# assert_allclose's (rtol, atol) per dtype. In float64 every difference
# measured (CPU, seed 3) was 4e-12 or less, but these: (backend, model,
# plan) -> atol, about 5x the difference measured.
TOLERANCE = {"float32": (2e-5, 2e-6), "float64": (1e-9, 1e-11)}
FLOAT64_ATOL = {
    ("tensorflow", "MobileNetV2", "sqrt_offload"): 3e-10,  # 5.4e-11
    ("tensorflow", "MobileNetV2", "sqrt_recompute"): 4e-10,  # 7.9e-11
    ("tensorflow", "ResNet50", "sqrt_offload"): 1e-8,  # 2.0e-9
    ("jax", "DenseNet121", "sqrt_recompute"): 1e-10,  # 2.3e-11
    ("jax", "EfficientNetB0", "sqrt_recompute"): 1e-9,  # 1.9e-10
    ("jax", "InceptionV3", "sqrt_recompute"): 1e-8,  # 2.6e-9
}


def _policies(name):
    """The plans each model trains under: one that recomputes, and on
    TensorFlow one that swaps by explicit copies too."""
    if BACKEND == "tensorflow":
        return ["sqrt_recompute", "sqrt_offload"]
    return ["sqrt_recompute"]


def _cases():
    for name in FAMILIES:
        marks = [] if name not in SLOW or RUN_SLOW else [pytest.mark.skip(
            reason="slow (up to 100 s); KERAS_AUTOVM_SLOW_TESTS=1 runs it")]
        dtype = "float64" if name in FLOAT64 else "float32"
        yield pytest.param(name, dtype, marks=marks, id=f"{name}-{dtype}")


@pytest.fixture
def floatx(request):
    """Builds and trains in `request.param`'s dtype; puts float32 back.

    float64 takes three switches: Keras's floatx and global dtype policy
    (which Keras fixed at float32 when the first layer was made), JAX's
    64-bit mode (global to the process), and Keras's dtype promotion, which
    on JAX and torch maps float64 results to float32: batch normalization
    computes in `result_type(inputs.dtype, "float32")`, so it normalized in
    float32 inside a float64 model, and JAX's Xception ended 4.6e-7 away.
    The last is private; `internals.float64_results` reaches it.
    """
    if request.param != "float64":
        yield request.param
        return
    old_floatx, old_policy = keras.config.floatx(), keras.config.dtype_policy()
    if BACKEND == "jax":
        import jax

        old_x64 = jax.config.jax_enable_x64
        jax.config.update("jax_enable_x64", True)
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        with internals.float64_results():
            assert keras.backend.result_type("float64", "float32") == "float64"
            yield "float64"
    finally:
        keras.config.set_floatx(old_floatx)
        keras.config.set_dtype_policy(old_policy)
        if BACKEND == "jax":
            jax.config.update("jax_enable_x64", old_x64)
    # Later tests build and compute in float32 again.
    assert keras.backend.result_type("float64", "float32") == (
        "float64" if BACKEND == "tensorflow" else "float32")
    assert keras.layers.Dense(1).dtype_policy.name == "float32"
    assert keras.backend.standardize_dtype(keras.ops.ones(1).dtype) == "float32"
    if BACKEND == "jax":
        assert jax.numpy.asarray(1.0).dtype == jax.numpy.float32


@pytest.mark.parametrize("name, floatx", list(_cases()), indirect=["floatx"])
def test_application_trains_like_keras_own(name, floatx):
    # Keras's own model trains two steps; then the same variables, set back
    # to their initial values (seed states too), train wrapped under each
    # plan. The softmax logits Keras's TensorFlow loss reads are kept
    # (mechanisms/tensorflow/logits.py). `profile=None`: the plans named here
    # do not read layer timings, and timing forty layers takes longer than
    # the training.
    keras.utils.set_random_seed(3)
    try:
        theirs, size = build_keras(name)
    except ValueError as error:  # NASNet on torch: Keras has no such model.
        if "not available with the" not in str(error):
            raise
        pytest.skip(str(error))
    assert {v.dtype for v in theirs.trainable_variables} == {floatx}
    initial = [np.array(v.numpy()) for v in theirs.variables]
    # Each fit starts from the same global seed: on torch an unseeded
    # Dropout draws from torch's global generator.
    keras.utils.set_random_seed(3)
    theirs = _fit(theirs, size)
    expected = theirs.get_weights()
    for policy in _policies(name):
        for variable, value in zip(theirs.variables, initial):
            variable.assign(value)
        keras.utils.set_random_seed(3)
        # float64 doubles every tensor (InceptionResNetV2's plan needs over
        # 1 GiB then); the plans named here do not depend on the budget.
        callback = keras_autovm.AutoVM(
            budget="2GiB" if floatx == "float64" else "1GiB", policy=policy,
            verbose=0, apply_without_gpu=True, profile=None)
        ours = _fit(applications.wrap_layers(theirs), size, [callback])
        counts = callback.report.plan.counts()
        assert counts["recompute"] > 0 and (policy == "sqrt_recompute"
                                            or counts["swap"] > 0), counts
        rtol, atol = TOLERANCE[floatx]
        atol = FLOAT64_ATOL.get((BACKEND, name, policy), atol)
        for wa, wb in zip(expected, ours.get_weights()):
            np.testing.assert_allclose(wb, wa, rtol=rtol, atol=atol,
                                       err_msg=f"{name} under {policy}")


@pytest.mark.parametrize("name", ["MobileNetV3Small", "ConvNeXtTiny"])
def test_wrapped_application_saves_and_loads(name, tmp_path):
    model, size = build(name)
    path = str(tmp_path / f"{name}.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in model.layers]
    x = np.random.default_rng(0).normal(size=(2, size, size, 3)).astype("float32")
    np.testing.assert_allclose(model.predict(x, verbose=0), loaded.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)
