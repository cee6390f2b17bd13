"""Every private torch name the torch mechanism relies on.

The torch half of `keras_autovm/internals.py` (which holds the versions
they were read against, `CHECKED_VERSIONS`, and the reaches into Keras's
torch backend): nothing else reaches behind torch's public API. Each
function says why no public API serves; `tests/test_internals.py`
exercises each reach.
"""


def torch_expandable_segments():
    """Turns on the CUDA caching allocator's expandable segments for the
    rest of the process. The public way is `PYTORCH_CUDA_ALLOC_CONF`, read
    once when CUDA starts, before AutoVM runs; `_set_allocator_settings`
    changes it at run time (PyTorch's own test runner does). torch 2.11.
    """
    import torch

    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
