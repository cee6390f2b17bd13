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
    Keras's layouts: the same numbers. No public API chooses the layout
    `conv` hands torch; it reads the module's `_transpose_spatial_inputs`
    when called, and this swaps that only while `conv` runs (a thread
    calling Keras's `conv`, `conv_transpose` or average pooling meanwhile
    would see it). Max pooling runs Keras's own channels-first `max_pool`
    on the view instead (no swap): it picks the same maxima, but its output
    and its input's gradient come back channels-last where Keras's are
    channels-first, and a reduction reading them (batch normalization, a
    bias's gradient) would sum in another order, so both are copied to
    Keras's layouts (`_grad_layout_function`): a copy of the output (a
    quarter of the input for a 2x2 pool), and of the gradient while it is
    made, instead of one of the input for the whole step. Inputs of other
    layouts (1D, non-contiguous) get Keras's own. Entering it again while
    it is on changes nothing. Keras 3.15.1.
    """
    import torch
    from keras.src.backend.torch import nn

    conv, max_pool = nn.conv, nn.max_pool
    if getattr(conv, "_autovm_views", False):  # Already on (nested).
        yield
        return
    # Keras's own, even if another thread is inside a wrapped call now.
    transpose = getattr(nn._transpose_spatial_inputs, "_autovm_original",
                        nn._transpose_spatial_inputs)
    layouts = {4: torch.channels_last, 5: torch.channels_last_3d}
    # Made here, not inside a call torch.compile may trace.
    grad_layout = _grad_layout_function()

    def view_of(inputs):
        if not isinstance(inputs, torch.Tensor) or inputs.ndim not in layouts:
            return None
        view = inputs.permute(0, inputs.ndim - 1, *range(1, inputs.ndim - 1))
        return view if view.is_contiguous(memory_format=layouts[inputs.ndim]) else None

    def as_view(inputs):
        view = view_of(inputs)
        return transpose(inputs) if view is None else view

    as_view._autovm_original = transpose

    @functools.wraps(conv)
    def conv_on_view(*args, **kwargs):
        nn._transpose_spatial_inputs = as_view
        try:
            return conv(*args, **kwargs)
        finally:
            nn._transpose_spatial_inputs = transpose

    @functools.wraps(max_pool)
    def max_pool_on_view(inputs, pool_size, strides=None, padding="valid",
                         data_format=None):
        channels_last = nn.backend.standardize_data_format(data_format) == "channels_last"
        view = view_of(inputs) if channels_last else None
        if view is None:
            return max_pool(inputs, pool_size, strides, padding, data_format)
        outputs = max_pool(grad_layout.apply(view), pool_size, strides, padding,
                           "channels_first")
        # Keras's own output is a channels-last view of a contiguous tensor.
        return nn._transpose_spatial_outputs(outputs.contiguous())

    conv_on_view._autovm_views = max_pool_on_view._autovm_views = True
    nn.conv, nn.max_pool = conv_on_view, max_pool_on_view
    try:
        yield
    finally:
        nn.conv, nn.max_pool = conv, max_pool


@functools.cache
def _grad_layout_function():
    """An identity whose gradient comes back contiguous channels-first, the
    layout of the gradient of Keras's copy."""
    import torch

    class KerasGradLayout(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor):
            return tensor.view_as(tensor)

        @staticmethod
        def backward(ctx, grad):
            return grad.contiguous()

    return KerasGradLayout
