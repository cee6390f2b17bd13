"""Device facts straight from the CUDA driver (libcuda through ctypes).

Used where a framework does not say how much memory the GPU has. Returns
`None` on machines without a driver instead of failing.
"""

import ctypes
import functools


@functools.lru_cache(maxsize=None)
def _driver():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return lib if lib.cuInit(0) == 0 else None


def total_memory(device=0):
    """Total memory of GPU `device` in bytes, or `None` without a driver."""
    lib = _driver()
    if lib is None:
        return None
    handle, total = ctypes.c_int(), ctypes.c_size_t()
    if lib.cuDeviceGet(ctypes.byref(handle), device) != 0:
        return None
    if lib.cuDeviceTotalMem_v2(ctypes.byref(total), handle) != 0:
        return None
    return total.value
