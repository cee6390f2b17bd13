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
def torch_conv_on_views():
    """Keras's torch convolutions read a channels-last input through a view,
    not through a copy of it.

    Keras 3.15.1's torch `conv` (keras/src/backend/torch/nn.py) turns a
    channels-last input into a contiguous channels-first copy
    (`_transpose_spatial_inputs`) and that into a channels-last-strided
    copy (`_maybe_convert_to_channels_last`), which autograd then saves for
    the backward pass: every convolution holds a second copy of its input
    until its backward runs. The channels-first view of a contiguous
    channels-last tensor already has those strides, so the convolution gets
    the same bytes in the same layout from the input's own storage, and its
    output and the input's gradient come back in Keras's layouts: the same
    numbers. (Max pooling on a view picks the same maxima, but its output
    comes back in another layout, and a reduction reading it, such as batch
    normalization, then sums in another order: not done.) No public API
    chooses the layout `conv` hands torch; `conv` reads the module's
    `_transpose_spatial_inputs` when called, and this swaps that only while
    `conv` runs. Inputs of other layouts (1D, non-contiguous, padded) get
    Keras's own. Entering it again while it is on changes nothing. Keras
    3.15.1.
    """
    import torch
    from keras.src.backend.torch import nn

    conv = nn.conv
    if getattr(conv, "_autovm_views", False):  # Already on (nested).
        yield
        return
    # Keras's own, even if another thread is inside a wrapped call now.
    transpose = getattr(nn._transpose_spatial_inputs, "_autovm_original",
                        nn._transpose_spatial_inputs)
    layouts = {4: torch.channels_last, 5: torch.channels_last_3d}

    def as_view(inputs):
        view = inputs.permute(0, inputs.ndim - 1, *range(1, inputs.ndim - 1))
        layout = layouts.get(inputs.ndim)
        if layout is not None and view.is_contiguous(memory_format=layout):
            return view
        return transpose(inputs)

    as_view._autovm_original = transpose

    @functools.wraps(conv)
    def conv_on_view(*args, **kwargs):
        nn._transpose_spatial_inputs = as_view
        try:
            return conv(*args, **kwargs)
        finally:
            nn._transpose_spatial_inputs = transpose

    conv_on_view._autovm_views = True
    nn.conv = conv_on_view
    try:
        yield
    finally:
        nn.conv = conv
