"""`AutoVMWrapper`: tags a layer's outputs and applies the plan's action."""

import inspect

import keras

from keras_autovm import internals


@keras.saving.register_keras_serializable(package="keras_autovm")
class AutoVMWrapper(keras.layers.Wrapper):
    """Wraps a layer so AutoVM can keep, swap or recompute its outputs.

    Outside training (inference, `evaluate`, `predict`) and when no `AutoVM`
    callback drives it, the wrapper is transparent: it calls the wrapped
    layer and returns its outputs unchanged. In training under `AutoVM`, it
    tags each output with the layer's name and carries out the action the
    plan gives it (see `keras_autovm.plan`).

    The `AutoVM` callback wraps the layers of a Sequential or Functional
    model itself; use this class directly to build a model that is already
    wrapped. Such a model saves and loads back (with `keras_autovm`
    imported) like any other.

    Args:
        layer: the `keras.layers.Layer` to wrap.
        **kwargs: base layer keyword arguments, such as `name`.

    Example:

    ```python
    inputs = keras.Input((32, 32, 3))
    x = keras_autovm.AutoVMWrapper(keras.layers.Conv2D(16, 3))(inputs)
    outputs = keras_autovm.AutoVMWrapper(keras.layers.GlobalAveragePooling2D())(x)
    model = keras.Model(inputs, outputs)
    ```
    """

    def __init__(self, layer, **kwargs):
        if isinstance(layer, keras.layers.Layer):
            kwargs.setdefault("name", f"autovm_{layer.name}")
            # The layer's own policy: a wrapper under another (a float32 head
            # in a mixed-precision model) would cast its inputs first.
            kwargs.setdefault("dtype", layer.dtype_policy)
        super().__init__(layer, **kwargs)
        params = inspect.signature(layer.call).parameters
        self._inner_takes_training = "training" in params
        self._inner_takes_mask = "mask" in params
        self.supports_masking = getattr(layer, "supports_masking", False)
        # Set by the AutoVM callback while it trains; not serialized.
        self._autovm_runtime = None
        # (op name, output tags) in the model's graph, set by AutoVM: names
        # of the wrapped layer when AutoVM wrapped it, of the wrapper when
        # the user did. Strings only, so Keras tracks nothing new.
        self._autovm_op = None

    def __call__(self, *args, **kwargs):
        runtime = self._autovm_runtime
        if (runtime is not None and kwargs.get("training")
                and runtime.mechanism.calls_layers_each_step
                and not internals.has_keras_mask(args)):
            # The wrapped layer's `Layer.__call__` runs inside `call`; run
            # for the wrapper too, it doubled the Python of each step, which
            # an eager backend pays every step (ResNet-152 on torch, an H100:
            # 0.61x in-core with nothing to save). Without a mask there is
            # nothing the outer call adds: the inner casts, and sets what
            # its outputs carry.
            return self.call(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def call(self, inputs, *args, training=None, mask=None, **kwargs):
        if self._inner_takes_training and training is not None:
            kwargs["training"] = training
        if self._inner_takes_mask and mask is not None:
            kwargs["mask"] = mask
        runtime = self._autovm_runtime
        if runtime is None or not training or runtime.aside:
            return self.layer(inputs, *args, **kwargs)
        return runtime.call(self, inputs, args, kwargs, training)

    def compute_output_spec(self, inputs, *args, training=None, mask=None, **kwargs):
        return self.layer.compute_output_spec(inputs, *args, **kwargs)

    def compute_mask(self, inputs, mask=None):
        return self.layer.compute_mask(inputs, mask)
