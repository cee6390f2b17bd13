"""Keras Applications with their layers wrapped for AutoVM.

`keras_autovm.applications.<Name>(...)` exists for every constructor in
`keras.applications` (ResNet50, VGG19, EfficientNetV2S, ...), made at import
from `keras.applications`' public names, so the list follows the installed
Keras. Each takes the same arguments as Keras's and returns the same model
with every layer inside an `AutoVMWrapper`: the same weights (pretrained
ones included), the same outputs, ready for
`model.fit(..., callbacks=[keras_autovm.AutoVM(...)])`, and saved and loaded
like any Keras model (with `keras_autovm` imported).

Example:

```python
model = keras_autovm.applications.ResNet50(weights=None, input_shape=(64, 64, 3))
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
model.fit(x, y, callbacks=[keras_autovm.AutoVM(budget="16GiB")])
```
"""

import functools

import keras

from keras_autovm.wrapper import AutoVMWrapper

_NOTE = """

    keras-autovm: this constructor builds Keras's model and returns it with
    each layer wrapped in `keras_autovm.AutoVMWrapper` (layer names gain the
    prefix `autovm_`; `wrapper.layer` is the Keras layer). Weights and
    outputs are Keras's own.
"""


def _wrap_layer(layer):
    if isinstance(layer, (keras.layers.InputLayer, AutoVMWrapper)) \
            or not isinstance(layer, keras.layers.Layer):
        return layer
    return AutoVMWrapper(layer)


def wrap_layers(model):
    """The model with each layer in an `AutoVMWrapper`, sharing its weights.

    Args:
        model: a built Sequential or functional `keras.Model`.

    Returns:
        A functional `keras.Model` of the same name, whose layers wrap the
        original layer objects (so the variables are the same).
    """
    return keras.models.clone_model(model, clone_function=_wrap_layer)


def _wrapped(constructor):
    @functools.wraps(constructor)
    def build(*args, **kwargs):
        return wrap_layers(constructor(*args, **kwargs))

    build.__module__ = __name__
    build.__qualname__ = constructor.__name__
    build.__doc__ = (constructor.__doc__ or "").rstrip() + _NOTE
    return build


__all__ = sorted(name for name, value in vars(keras.applications).items()
                 if name[:1].isupper() and callable(value))
globals().update({name: _wrapped(getattr(keras.applications, name))
                  for name in __all__})
__all__.append("wrap_layers")
