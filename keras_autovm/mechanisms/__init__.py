"""One small module per Keras backend, behind the same function names.

Each backend module provides:
- `actions()`: the plan actions it can carry out now.
- `auto_actions()`: those `policy="auto"` may choose (the ones that were
  shown to save memory where the plan says).
- `SWAPS_BY_OPS`: whether swaps are carried out by page-moving ops that
  the runtime inserts after layers (TensorFlow managed memory), with
  `evict(data, targets)`, `prefetch_on_backward(data, targets)` and
  `moved_bytes()`.
- `prepare(model)`: adjusts the model for the mechanism; returns a message
  saying what it changed, or `None`.
- `REMAT_LAYERS`: whether each stateless layer runs under `recompute`
  while a plan is applied (JAX: what a layer keeps inside is then
  recomputed at its own backward instead of hoisted by XLA).
- `REPLAYS_SEGMENTS`: whether recompute means replaying plan segments
  through `recompute` (TensorFlow, torch) rather than a policy (JAX).
- `gpu_available()`, `device_memory()`, `peak_memory()`, `reset_peak()`.
- `tag(x, name)`: marks a layer output for the backend's remat machinery.
- `recompute(fn)`: wraps `fn` so that its intermediates are recomputed in
  the backward pass instead of stored.
- `install(model, runtime)` / `uninstall(model)`: hooks on the trainer that
  a backend needs to apply a plan (JAX wraps the loss in `jax.checkpoint`).

The module for the active Keras backend is picked once, on first use.
"""

import importlib

import keras

_MODULES = {
    "jax": "keras_autovm.mechanisms.jax",
    "tensorflow": "keras_autovm.mechanisms.tensorflow",
    "torch": "keras_autovm.mechanisms.torch",
}


def get():
    """Returns the mechanism module for the active Keras backend."""
    backend = keras.backend.backend()
    if backend not in _MODULES:
        raise NotImplementedError(
            f"keras_autovm supports the jax, tensorflow and torch backends; "
            f"the active Keras backend is {backend!r}."
        )
    return importlib.import_module(_MODULES[backend])
