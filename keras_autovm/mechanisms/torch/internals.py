"""Every private torch or Keras-torch name the torch mechanism relies on.

The torch half of `keras_autovm/internals.py` (which holds the versions
they were read against, `CHECKED_VERSIONS`): nothing else reaches behind
torch's or Keras's torch backend's public API. Each function says why no
public API serves; `tests/test_internals.py` exercises each reach.
"""

import contextlib
import functools


def torch_expandable_segments():
    """Turns on the CUDA caching allocator's expandable segments for the
    rest of the process. The public way is `PYTORCH_CUDA_ALLOC_CONF`, read
    once when CUDA starts, before AutoVM runs; `_set_allocator_settings`
    changes it at run time (PyTorch's own test runner does). torch 2.11.
    """
    import torch

    torch.cuda.memory._set_allocator_settings("expandable_segments:True")


@contextlib.contextmanager
def torch_inputs_on_views():
    """Keras's torch convolutions and max pooling read a channels-last
    input through a view, not through a copy of it.

    Keras 3.15.1's torch `conv` and `max_pool` (keras/src/backend/torch/
    nn.py) turn a channels-last input into a contiguous channels-first copy
    (`_transpose_spatial_inputs`), `conv` that into a channels-last-strided
    second copy (`_maybe_convert_to_channels_last`), and autograd saves the
    copy for the backward pass: every convolution and max pooling holds a
    second copy of its input until its backward runs. The channels-first
    view of a contiguous channels-last tensor already has a convolution's
    strides, so it gets the same bytes in the same layout from the input's
    own storage, and its output and the input's gradient come back in
    Keras's layouts: the same numbers. Max pooling on the view picks the
    same maxima, but its output and its input's gradient come back
    channels-last where Keras's are channels-first, and a reduction reading
    them (batch normalization, a bias's gradient) would sum in another
    order; so both are put back in Keras's layout (`_KerasPoolLayouts`), a
    copy of the output (a quarter of the input for a 2x2 pool) and of the
    gradient while it is made, instead of one of the input for the whole
    step. No public API chooses the layout these hand torch; they read the
    module's `_transpose_spatial_inputs`/`_outputs` when called, and this
    swaps those only while they run. Inputs of other layouts (1D,
    non-contiguous) get Keras's own. Entering it again while it is on
    changes nothing. Keras 3.15.1.
    """
    import torch
    from keras.src.backend.torch import nn

    if getattr(nn.conv, "_autovm_views", False):  # Already on (nested).
        yield
        return
    # Keras's own, even if another thread is inside a wrapped call now.
    keras_in, keras_out = (getattr(f, "_autovm_original", f) for f in
                           (nn._transpose_spatial_inputs, nn._transpose_spatial_outputs))
    layouts = {4: torch.channels_last, 5: torch.channels_last_3d}

    def view_of(inputs):
        view = inputs.permute(0, inputs.ndim - 1, *range(1, inputs.ndim - 1))
        layout = layouts.get(inputs.ndim)
        return view if layout and view.is_contiguous(memory_format=layout) else None

    def conv_input(inputs):
        view = view_of(inputs)
        return keras_in(inputs) if view is None else view

    def pool_input(inputs):
        view = view_of(inputs)
        return keras_in(inputs) if view is None else _keras_grad_layout(view)

    def pool_output(outputs):  # Keras's own is a permuted contiguous tensor.
        return keras_out(outputs.contiguous())

    for function, original in ((conv_input, keras_in), (pool_input, keras_in),
                               (pool_output, keras_out)):
        function._autovm_original = original
    originals = {"conv": nn.conv, "max_pool": nn.max_pool}
    nn.conv = _swapping(nn, nn.conv, _transpose_spatial_inputs=conv_input)
    nn.max_pool = _swapping(nn, nn.max_pool, _transpose_spatial_inputs=pool_input,
                            _transpose_spatial_outputs=pool_output)
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(nn, name, function)


def _swapping(module, function, **names):
    """`function` with `module`'s globals `names` replaced while it runs."""
    keras_own = {name: getattr(module, name) for name in names}

    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        for name, value in names.items():
            setattr(module, name, value)
        try:
            return function(*args, **kwargs)
        finally:
            for name, value in keras_own.items():
                setattr(module, name, value)

    wrapped._autovm_views = True
    return wrapped


def _keras_grad_layout(view):
    """`view` itself, whose gradient comes back contiguous channels-first,
    the layout of the gradient of Keras's copy."""
    return _grad_layout_function().apply(view)


@functools.cache
def _grad_layout_function():
    import torch

    class KerasGradLayout(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor):
            return tensor.view_as(tensor)

        @staticmethod
        def backward(ctx, grad):
            return grad.contiguous()

    return KerasGradLayout
