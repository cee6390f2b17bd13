"""AutoVM recomputes with `keras.remat`: checked to be the program each
backend's own primitive gives, not assumed.

On JAX the gradient's jaxpr is compared with `jax.checkpoint`'s; on
TensorFlow and torch the gradients are compared bit for bit with
`tf.recompute_grad` and non-reentrant `torch.utils.checkpoint`, and the
forward is counted to show that the backward pass ran it again.
"""

import keras
import numpy as np
import pytest

import keras_autovm
from conftest import BACKEND, fit_two_steps


def block():
    keras.utils.set_random_seed(1)
    layers = [keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
              keras.layers.Conv2D(4, 3, padding="same")]
    x = keras.random.normal((2, 8, 8, 3), seed=2)
    for layer in layers:
        layer.build(x.shape if layer is layers[0] else (2, 8, 8, 4))
    return layers, x


def test_mechanism_recompute_is_keras_remat(monkeypatch):
    # TensorFlow's explicit swap has its own, under policies that may swap:
    # tests/test_tf_swap.py.
    mechanism = keras_autovm.mechanisms.get()
    made = []
    monkeypatch.setattr(keras, "remat", lambda fn: made.append(fn) or fn)
    fn = lambda x: (x,)  # noqa: E731
    recomputed = mechanism.recompute(fn)
    assert len(made) == 1
    if BACKEND == "tensorflow":  # Wrapped to keep the logits (logits.py).
        assert recomputed(1.0) == (1.0,)
    else:
        assert recomputed is fn and made == [fn]


def test_keras_remat_is_the_backends_own_recompute():
    layers, x = block()
    calls = []

    def f(x):
        calls.append(1)
        for layer in layers:
            x = layer(x)
        return x

    if BACKEND == "jax":
        import jax

        def loss(remat):
            return lambda x: jax.numpy.sum(remat(f)(x) ** 2)

        ours = jax.make_jaxpr(jax.grad(loss(keras.remat)))(x)
        theirs = jax.make_jaxpr(jax.grad(loss(jax.checkpoint)))(x)
        assert str(ours) == str(theirs)
        assert "remat" in str(ours) or "checkpoint" in str(ours)
        return
    grads = []
    for remat in (keras.remat, _native_remat()):
        calls.clear()
        grads.append(_grad(remat(f), x))
        assert len(calls) == 2, "the backward pass did not run the forward again"
    np.testing.assert_array_equal(grads[0], grads[1])


def _native_remat():
    if BACKEND == "tensorflow":
        import tensorflow as tf
        return tf.recompute_grad
    import torch.utils.checkpoint
    return lambda f: (lambda *a: torch.utils.checkpoint.checkpoint(
        f, *a, use_reentrant=False))


def _grad(fn, x):
    if BACKEND == "tensorflow":
        import tensorflow as tf
        x = tf.constant(keras.ops.convert_to_numpy(x))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(fn(x) ** 2)
        return tape.gradient(y, x).numpy()
    import torch
    x = x.detach().clone().requires_grad_(True)
    torch.sum(fn(x) ** 2).backward()
    return x.grad.numpy()


def _softmax_head(head=None):
    """A model whose softmax saturates: `Dense(activation="softmax")`, or a
    `Dense` then `Lambda(head)` with `head` a raw TensorFlow op."""
    keras.utils.set_random_seed(4)
    inputs = keras.Input((8, 8, 3))
    x = inputs
    for _ in range(4):
        x = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(x)
    x = keras.layers.Flatten()(x)
    # Large logits: a probability rounds to 0, which a loss computed from
    # the probabilities clips and one computed from the logits does not.
    init = keras.initializers.RandomNormal(stddev=30.0)
    if head is None:
        outputs = keras.layers.Dense(3, activation="softmax", kernel_initializer=init,
                                     name="head")(x)
    else:
        x = keras.layers.Dense(3, kernel_initializer=init, name="logits")(x)
        outputs = keras.layers.Lambda(head, name="head")(x)
    return keras.Model(inputs, outputs)


def _fit(model, callbacks=()):
    return fit_two_steps(model, 8, 3, 1e-2, callbacks).get_weights()


@pytest.mark.parametrize("policy", ["sqrt_recompute", "offload_all"])
def test_softmax_head_in_a_segment_trains_like_keras_own(policy):
    # On TensorFlow Keras's cross-entropy reads the logits a softmax output
    # carries; a recompute segment ending in the softmax, or a swap's mark
    # on it, lost them, and the loss came from the clipped probabilities
    # (these weights 2.9 away; MobileNet's 1.1e-2, tests/test_applications.py).
    theirs = _fit(_softmax_head())
    callback = keras_autovm.AutoVM(budget="1GiB", policy=policy, verbose=0,
                                   apply_without_gpu=True)
    ours = _fit(_softmax_head(), [callback])
    plan = callback.report.plan
    if policy == "sqrt_recompute":
        assert plan.segments[-1][-1] == "head"
    else:
        assert plan.counts()["swap"] > 0
    for a, b in zip(theirs, ours):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


@pytest.fixture(scope="module")
def tf_op_library():
    from keras_autovm.native import build as native_build
    native_build.build_tf_ops()  # Builds it, or finds it up to date.


def _fit_one_hot(model, loss, callbacks=()):
    model.compile(optimizer=keras.optimizers.SGD(1e-2), loss=loss)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 8, 8, 3)).astype("float32")
    y = np.eye(3, dtype="float32")[rng.integers(0, 3, size=(8,))]
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
              callbacks=list(callbacks))
    return model.get_weights()


@pytest.mark.skipif(BACKEND != "tensorflow", reason="a raw TensorFlow op as the head")
@pytest.mark.parametrize("loss", ["categorical_crossentropy", "binary_crossentropy"])
@pytest.mark.parametrize("head", ["softmax", "sigmoid"])
@pytest.mark.parametrize("policy, managed_mode", [
    ("sqrt_recompute", False), ("sqrt_offload", False), ("offload_all", False),
    ("offload_all", True)])
def test_raw_tensorflow_head_trains_like_keras_own(policy, managed_mode, head, loss,
                                                   monkeypatch, request):
    # Keras's TensorFlow cross-entropy also computes from the logits of a
    # graph tensor made by a Softmax op (the categorical losses) or a
    # Sigmoid op (binary cross-entropy). A segment ending in the raw op, a
    # swap's mark or a managed pass-through on it hid the op: the loss came
    # from the probabilities (weights 2.9 and 1.0 away). Logits attached to
    # the replacement instead would be read by every loss, the mismatched
    # ones too (weights 1.0 and 3.2 away).
    import tensorflow as tf

    op = {"softmax": tf.nn.softmax, "sigmoid": tf.math.sigmoid}[head]
    theirs = _fit_one_hot(_softmax_head(op), loss)
    if managed_mode:
        from keras_autovm.mechanisms.tensorflow import managed
        request.getfixturevalue("tf_op_library")
        monkeypatch.setitem(managed._state, "enabled", True)
    callback = keras_autovm.AutoVM(budget="1GiB", policy=policy, verbose=0,
                                   apply_without_gpu=True)
    ours = _fit_one_hot(_softmax_head(op), loss, [callback])
    plan = callback.report.plan
    if policy == "offload_all":
        assert plan.counts()["swap"] > 0
    else:
        assert plan.segments[-1][-1] == "head"
    for a, b in zip(theirs, ours):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
