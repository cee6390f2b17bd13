"""Which profile a model has: its architecture's fingerprint, and where
profiles are cached on disk.

The fingerprint keys the cache (`profiling.obtain`) and tells identical
layer calls apart when timing (`profiling.measure` times each distinct call
once). It reads a layer's public settings, not `get_config()`, whose
serialisation imports TensorFlow on every backend.
"""

import hashlib
import inspect
import json
import os

from keras_autovm import internals
from keras_autovm.model_graph import layer_calls

# Layer attributes that are state, not architecture.
_STATE = ("built", "training", "name")


def fingerprint(model):
    """A stable hash of a model's architecture: each layer call's class,
    settings, weight shapes and input and output shapes and dtypes, in run
    order.

    Names are left out: the same model built again in one process gets new
    automatic layer names (`conv2d_1`, ...). A layer's settings are its
    public attributes of plain types (strides, padding, rates, the
    activation's name), not `get_config()`, whose serialisation imports
    TensorFlow on every backend.
    """
    text = json.dumps([call_key(layer, node) for layer, node in layer_calls(model)])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def call_key(layer, node):
    """What decides one layer call's time: class, settings, shapes."""
    return json.dumps([type(layer).__name__, _settings(layer),
                       [(tuple(v.shape), str(v.dtype)) for v in getattr(layer, "weights", ())],
                       [(tuple(x.shape), str(x.dtype)) for x in node.input_tensors],
                       [(tuple(x.shape), str(x.dtype)) for x in node.outputs]],
                      sort_keys=True)


def _settings(layer, depth=0):
    """A layer's plain settings, its `trainable` flag (a frozen layer has no
    weight gradients to time; a raw `keras.ops` call between layers, such as
    MobileNetV3's `x + 3.0`, has no flag and no weights), and the settings of
    layers it holds."""
    plain = (bool, int, float, str, type(None))
    found = {"trainable": bool(getattr(layer, "trainable", False))}
    for key, value in vars(layer).items():
        if key.startswith("_") or key in _STATE:
            continue
        if inspect.isfunction(value):
            value = _function_key(value)  # An activation, a Lambda's body.
        if isinstance(value, plain) or (isinstance(value, (tuple, list))
                                          and all(isinstance(v, plain) for v in value)):
            found[key] = value
    held = internals.sublayers(layer)
    if held:
        found["held layers"] = [_held(v, depth) for v in held]
    return found


def _held(layer, depth):
    if depth >= 4:  # Deep enough to tell custom blocks apart.
        return type(layer).__name__
    return [type(layer).__name__, _settings(layer, depth + 1)]


def _function_key(function):
    """A function by name and code: two lambdas differ by their bodies."""
    code = getattr(function, "__code__", None)
    if code is None:
        return f"{function.__module__}.{function.__qualname__}"
    # Nested code objects' reprs hold addresses, which change per process.
    consts = [c for c in code.co_consts if not inspect.iscode(c)]
    body = hashlib.sha256(code.co_code + repr(consts).encode()).hexdigest()[:12]
    return f"{function.__module__}.{function.__qualname__}:{body}"


def cache_dir():
    """Where profiles are cached: `$KERAS_AUTOVM_CACHE_DIR`, else
    `~/.cache/keras_autovm/profiles`."""
    return os.environ.get("KERAS_AUTOVM_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "keras_autovm", "profiles")


def cache_path(device, backend, model_fingerprint, batch_size):
    """The cache file of one (device, backend, model, batch size)."""
    key = hashlib.sha256(f"{device}|{backend}".encode()).hexdigest()[:12]
    return os.path.join(cache_dir(), f"{backend}-{key}-{model_fingerprint}-b{batch_size}.json")


def learnt_path(profile_path):
    """Where fits that plan from the profile cached at `profile_path` keep
    the memory overhead they learnt (`keras_autovm.learnt`): beside it."""
    return profile_path[:-len(".json")] + ".learnt.json"
