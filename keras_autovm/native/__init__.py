"""keras-autovm's native libraries: where they are built, and the helper.

Both libraries are compiled from ops/ by `build.py` (at install, or with
`python -m keras_autovm.native.build`) into this directory: the TensorFlow
op library `_autovm_ops.so` (loaded by `mechanisms/tensorflow/ops.py`) and
the optional pybind11 helper, CUDA managed-memory facts no framework
exposes.

`helper` is the compiled pybind11 module `keras_autovm.native._autovm_native`
(sources in ops/native/), or `None` when it was not built for this Python.
The module itself imports without CUDA; its functions then raise
`RuntimeError("no CUDA driver: ...")`. `available()` says whether both the
module and a working driver are there.

Functions of `helper` (see their docstrings):

- `device_count()`, `device_info(device=0)`, `mem_info(device=0) -> (free, total)`
- `pointer_info(ptr, nbytes=1) -> dict(is_managed, device, memory_type,
  last_prefetch_location)` where the location is `'host'`, `'device:N'` or
  `'none'` (the last requested prefetch of the range, not its residency)
- `prefetch(ptr, nbytes, to='host' | device, sync=True)`, on a dedicated stream
- `advise(ptr, nbytes, advice, device)`, e.g. `'set_preferred_location'`
- `synchronize(device=0)`
- `link_probe(nbytes=256 MiB, repeats=5, device=0) -> dict` of GB/s: pinned
  D2H/H2D, managed prefetch both ways, first eviction, fault-driven migration.
  Refuses a size over 25% of the free device memory.

Example:

    from keras_autovm import native

    if native.available():
        free, total = native.helper.mem_info(0)
"""

from pathlib import Path

from keras_autovm.native import build

#: Where the built libraries live.
LIBRARY_DIR = Path(__file__).resolve().parent

try:
    from keras_autovm.native import _autovm_native as helper
except ImportError as e:  # Not built for this Python: the package still works.
    helper = None
    _IMPORT_ERROR = str(e)
else:
    _IMPORT_ERROR = None

BUILD_COMMAND = f"{build.BUILD_COMMAND} --only native"


def available():
    """Whether the native module is built and a CUDA driver initialised."""
    return helper is not None and bool(helper.driver_available())


def require():
    """Returns `helper`, or raises `ImportError` saying how to build it."""
    if helper is None:
        raise ImportError(
            "keras-autovm's native helper (keras_autovm.native._autovm_native) is not "
            f"built for this Python ({_IMPORT_ERROR}). Build it with "
            f"`{BUILD_COMMAND}` (needs a C++17 compiler and pybind11)."
        )
    return helper
