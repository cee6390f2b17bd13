"""The optional native helper: CUDA managed-memory facts no framework exposes.

`native` is the compiled pybind11 module `keras_autovm._autovm_native`
(sources in ops/native/), or `None` when it was not built for this Python.
The module itself imports without CUDA; its functions then raise
`RuntimeError("no CUDA driver: ...")`. `available()` says whether both the
module and a working driver are there.

Functions of `native` (see their docstrings):

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

    from keras_autovm import native as nat

    if nat.available():
        free, total = nat.native.mem_info(0)
"""

try:
    from keras_autovm import _autovm_native as native
except ImportError as e:  # Not built for this Python: the package still works.
    native = None
    _IMPORT_ERROR = str(e)
else:
    _IMPORT_ERROR = None

BUILD_COMMAND = "python -m keras_autovm._build --only native"


def available():
    """Whether the native module is built and a CUDA driver initialised."""
    return native is not None and bool(native.driver_available())


def require():
    """Returns `native`, or raises `ImportError` saying how to build it."""
    if native is None:
        raise ImportError(
            "keras-autovm's native helper (keras_autovm._autovm_native) is not "
            f"built for this Python ({_IMPORT_ERROR}). Build it with "
            f"`{BUILD_COMMAND}` (needs a C++17 compiler and pybind11)."
        )
    return native
