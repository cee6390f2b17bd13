"""One mechanism per Keras backend, behind the interface of `base.Mechanism`.

`get()` returns a fresh mechanism for the active Keras backend (one per
`fit` or `plan()` call: a mechanism may hold what it inserted into one
traced step). Each backend's code lives in its own subpackage and is
imported only when that backend is active.
"""

import importlib

import keras

_CLASSES = {
    "jax": ("keras_autovm.mechanisms.jax.mechanism", "JaxMechanism"),
    "tensorflow": ("keras_autovm.mechanisms.tensorflow.mechanism", "TensorFlowMechanism"),
    "torch": ("keras_autovm.mechanisms.torch.mechanism", "TorchMechanism"),
}


def get():
    """Returns a new mechanism for the active Keras backend."""
    backend = keras.backend.backend()
    if backend not in _CLASSES:
        raise NotImplementedError(
            f"keras_autovm supports the jax, tensorflow and torch backends; "
            f"the active Keras backend is {backend!r}.")
    module, name = _CLASSES[backend]
    return getattr(importlib.import_module(module), name)()
