"""Measured costs: each layer call's forward and backward time, and the link.

`obtain(model, batch_size, mechanism)` returns the `Profile` of a model on
the device and backend in use, from the on-disk cache when this device,
backend, architecture and batch size were measured before, else measured now
(`measure`) and cached. Measuring runs the model's forward pass once on zeros
of the input shapes, layer call by layer call, and gives each distinct call
(class, settings, shapes: `profile_cache.call_key`) to the backend's
`Mechanism.call_timer`, which times its forward and backward a few times
(and on TensorFlow measures the memory it allocates for a moment):
at once on torch and TensorFlow, after the pass on JAX, whose pass runs on
shapes alone and whose calls compile together (`mechanisms/jax/timing.py`).
Nothing changes: the pass runs under a `keras.StatelessScope`, and the
timed calls through `stateless_call`.
Which profile a model has, and where it is cached, is `profile_cache.py`'s.

A layer's recompute cost is its forward time: a replay runs the same call
under a `keras.StatelessScope` too.
"""

import dataclasses
import json
import os
import time
import warnings

import keras

from keras_autovm import calibration
from keras_autovm import internals
from keras_autovm import learnt
from keras_autovm.mechanisms.timing import CallTime
from keras_autovm.model_graph import call_names
from keras_autovm.model_graph import layer_calls
from keras_autovm.model_graph import layer_facts
from keras_autovm.model_graph import needs_input_shapes
# `fingerprint` is part of this module's API: a profile records it.
from keras_autovm.profile_cache import cache_path
from keras_autovm.profile_cache import call_key
from keras_autovm.profile_cache import fingerprint
from keras_autovm.profile_cache import learnt_path
from keras_autovm.profile_batch import at_batch
from keras_autovm.profile_batch import timing_batch_for
# `timing_batch` is part of this module's API too, and times a fallback pass.
from keras_autovm.profile_batch import timing_batch

#: Timed runs of each forward and backward, after one warm-up.
REPEATS = 3
# A cached profile of another format is measured again. 4: what the timing
# costs a call is off torch's backward times (`timing.grad_call_s`). 5: torch
# convolutions timed on views of their inputs, as AutoVM now runs them. 6: max
# pooling on views too. 7: TensorFlow's calls measure their workspace. 8:
# only where no layout transpose wraps a call alone, less a kernel's copy.
_FORMAT = 8


@dataclasses.dataclass(frozen=True)
class LayerTime:
    """One layer call, measured at the profile's batch size (seconds).

    `fwd_fixed_s` and `bwd_fixed_s` are the parts that do not grow with the
    batch (launch and Python overhead), from a second timing at a smaller
    batch (`Profile.with_fixed_times`); 0 when only one batch was timed.
    `workspace_bytes` is the most the call allocates for a moment above
    what it holds before and after (0: not measured).
    """

    name: str
    fwd_s: float
    bwd_s: float
    output_bytes: int
    fwd_fixed_s: float = 0.0
    bwd_fixed_s: float = 0.0
    workspace_bytes: int = 0

    def at(self, scale):
        """`(fwd, bwd)` seconds at `scale` times the profile's batch."""
        return (self.fwd_fixed_s + (self.fwd_s - self.fwd_fixed_s) * scale,
                self.bwd_fixed_s + (self.bwd_s - self.bwd_fixed_s) * scale)


@dataclasses.dataclass(frozen=True)
class Profile:
    """What was measured for one model on one device and backend.

    Args:
        device: the device's name (`Mechanism.device_name()`).
        backend: the Keras backend.
        batch_size: the batch size the layers were timed at.
        fingerprint: the model's architecture (`fingerprint(model)`).
        layers: a tuple of `LayerTime`, in run order.
        link: GB/s per link figure (`"pinned_d2h"`, `"pinned_h2d"`,
            `"pinned_both_d2h"`, ...); empty when there is no GPU.
        profile_s: seconds the measurement took.
    """

    device: str
    backend: str
    batch_size: int
    fingerprint: str
    layers: tuple
    link: dict = dataclasses.field(default_factory=dict)
    profile_s: float = 0.0

    def to_dict(self):
        """The profile as JSON-serialisable data."""
        return {"format": _FORMAT, "device": self.device, "backend": self.backend,
                "batch_size": self.batch_size, "fingerprint": self.fingerprint,
                "layers": [dataclasses.asdict(t) for t in self.layers],
                "link": dict(self.link), "profile_s": self.profile_s}

    @classmethod
    def from_dict(cls, data):
        layers = tuple(LayerTime(t["name"], float(t["fwd_s"]), float(t["bwd_s"]),
                                 int(t["output_bytes"]), float(t.get("fwd_fixed_s", 0.0)),
                                 float(t.get("bwd_fixed_s", 0.0)),
                                 int(t.get("workspace_bytes", 0))) for t in data["layers"])
        return cls(data["device"], data["backend"], int(data["batch_size"]),
                   data.get("fingerprint", ""), layers, dict(data.get("link", {})),
                   float(data.get("profile_s", 0.0)))

    def save(self, path):
        """Writes the profile as JSON to `path`."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, path)  # A reader never sees half a file.

    @classmethod
    def load(cls, path):
        """Reads a profile written by `save`."""
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def apply(self, graph):
        """`graph` (a `planner.Graph`) with the measured times on its ops.

        Times are scaled to the graph's batch size when it differs from the
        profile's (a last partial batch, or layers timed at a smaller batch
        under a tight budget): the part that grows with the batch linearly,
        the fixed part not (`LayerTime.at`). Ops not measured keep their
        roofline estimate. A measured workspace becomes the op's, scaled
        with the batch (it is temporaries the size of the layer's tensors).
        """
        scale = graph.batch_size / self.batch_size if graph.batch_size else 1.0
        layers = {t.name: t for t in self.layers}
        return dataclasses.replace(graph, ops=tuple(
            _measured(op, layers[op.name], scale) if op.name in layers else op
            for op in graph.ops))

    def with_fixed_times(self, smaller):
        """This profile with each layer's fixed time fitted from `smaller`,
        the same model timed at a smaller batch: a line through the two
        times, its slope and its intercept kept at zero or above."""
        ratio = smaller.batch_size / self.batch_size
        if not 0 < ratio < 1 or len(smaller.layers) != len(self.layers):
            raise ValueError("`smaller` must time the same layers at a smaller batch. "
                             f"Received: smaller.batch_size={smaller.batch_size} for "
                             f"batch_size={self.batch_size}")
        layers = tuple(dataclasses.replace(
            big, fwd_fixed_s=_intercept(big.fwd_s, small.fwd_s, ratio),
            bwd_fixed_s=_intercept(big.bwd_s, small.bwd_s, ratio))
            for big, small in zip(self.layers, smaller.layers))
        return dataclasses.replace(self, layers=layers,
                                   profile_s=self.profile_s + smaller.profile_s)

    def cost(self, cost, link):
        """`cost` (a `planner.CostModel`) with the measured bandwidths of
        `link` (`"pinned"` or `"managed_prefetch"`), when measured."""
        d2h, h2d = self.link.get(f"{link}_d2h"), self.link.get(f"{link}_h2d")
        if not (d2h and h2d):
            return cost
        return dataclasses.replace(cost, d2h_bytes_per_s=d2h * 1e9,
                                   h2d_bytes_per_s=h2d * 1e9, link_measured=True)


def _measured(op, layer, scale):
    """`op` with the times and workspace of `layer` (a `LayerTime`) at
    `scale` times the profile's batch. An unmeasured workspace (0) leaves
    the op's own: torch measures its workspaces elsewhere
    (`mechanisms/torch/profile.py`)."""
    fwd, bwd = layer.at(scale)
    workspace = int(layer.workspace_bytes * scale) or op.workspace_bytes
    return dataclasses.replace(op, fwd_time=fwd, bwd_time=bwd, workspace_bytes=workspace)


def _intercept(big, small, ratio):
    """The time at batch 0 of the line through `(1, big)` and `(ratio, small)`,
    within `[0, big]`: timing noise must not make a layer's time fall, or
    go negative, as the batch grows."""
    return min(max((small - ratio * big) / (1 - ratio), 0.0), big)


def obtain(model, batch_size, mechanism, verbose=0, limit_bytes=None):
    """The profile of `model` at `batch_size`: cached, or measured and cached.

    Returns:
        `(profile, measured)`: `measured` is `False` when it came from the
        cache.
    """
    path = cache_path(mechanism.device_name(), mechanism.backend,
                      fingerprint(model), batch_size)
    names = [name for name, _ in call_names(model)]
    cached = _cached(path)
    if cached is None:  # A new profile: what fits kept with the old one goes.
        learnt.forget(learnt_path(path))
    pass_batch, time_at = timing_batch_for(model, batch_size, limit_bytes)
    # A profile timed at a smaller batch (a tighter budget then) is
    # measured again when this fit can time a larger one.
    if (cached is not None and len(cached.layers) == len(names)
            and cached.batch_size >= time_at):
        # Same architecture, in run order: take this model's op names.
        layers = tuple(dataclasses.replace(t, name=n)
                       for t, n in zip(cached.layers, names))
        return dataclasses.replace(cached, layers=layers), False
    profile = None
    if time_at > pass_batch:  # Each call alone at a batch of its own.
        try:
            profile = measure(model, pass_batch, mechanism, verbose=verbose,
                              time_at=time_at)
        except Exception as error:  # noqa: BLE001 -- only out-of-memory is caught
            if not mechanism.out_of_memory(error):
                raise
            mechanism.release_memory()  # Then time in the largest pass.
            pass_batch = timing_batch(model, batch_size, limit_bytes)
    if profile is None:
        profile = measure(model, pass_batch, mechanism, verbose=verbose)
    if 1 < profile.batch_size < batch_size:
        # Scaled up to the fit's batch, a layer's fixed cost (Python and
        # launch overhead) would grow with it: ResNet-152 timed at a small
        # batch and planned at 193 was predicted at 5.3x its measured step.
        # Timed at half its batch, beside the same pass where it had one of
        # its own, the line is fitted where the GPU is used as it is there.
        smaller = (measure(model, pass_batch, mechanism, verbose=verbose,
                           time_at=profile.batch_size // 2)
                   if profile.batch_size > pass_batch else
                   measure(model, pass_batch // 2, mechanism, verbose=verbose))
        profile = profile.with_fixed_times(smaller)
    profile.save(path)
    return profile, True


def _cached(path):
    """The profile cached at `path`, or `None`: none there, a damaged file,
    or one of another format (each is measured again and replaced)."""
    try:
        with open(path) as f:
            data = json.load(f)
        return Profile.from_dict(data) if data.get("format") == _FORMAT else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def measure(model, batch_size, mechanism, repeats=REPEATS, verbose=0, time_at=None):
    """Times each layer call of `model` in a pass at `batch_size`, and the link.

    Args:
        model: a built Sequential or functional Keras model.
        batch_size: the batch size to run the pass at.
        mechanism: the backend's mechanism (`keras_autovm.mechanisms.get()`).
        repeats: timed runs per forward and per backward. Defaults to 3.
        verbose: show a `keras.utils.Progbar` when true. Defaults to 0.
        time_at: the batch size to time each call at, on zeros made for it
            (`profile_batch.calls_fit` says when that fits); `None`:
            `batch_size`. Defaults to `None`.

    Returns:
        A `Profile`.
    """
    start = time.perf_counter()
    time_at = time_at or batch_size
    names = call_names(model)
    # Identical calls (the repeated blocks of a ResNet) are timed once.
    keys = [call_key(layer, node) for layer, node in layer_calls(model)]
    bar = None
    if verbose:
        print("AutoVM: timing each layer's forward and backward pass, once per distinct call")
        bar = keras.utils.Progbar(len(set(keys)), unit_name="call")
    timer = mechanism.call_timer(repeats, bar.update if bar is not None else None)
    fn = internals.functional_of(model)
    inputs = [keras.ops.zeros((batch_size,) + tuple(x.shape[1:]), x.dtype)
              for x in fn.inputs]
    found = []  # (name, key, output bytes) per call, in run order.

    def around(operation, run, args, kwargs):
        outputs = run()
        name, _ = names[len(found)]
        key = keys[len(found)]
        if key not in timer:
            timer.add(key, operation, *at_batch((args, kwargs), time_at, batch_size))
        size = sum(layer_facts.nbytes(x, time_at, name)
                   for x in keras.tree.flatten(outputs) if hasattr(x, "shape"))
        found.append((name, key, int(size)))
        return outputs

    # Layer state the training-mode pass would update (batch-norm moving
    # statistics, seed generators) is read from, and written to, the scope.
    state = [(v, v.value) for v in model.non_trainable_variables]
    with keras.StatelessScope(state_mapping=state), mechanism.measuring():
        mechanism.measuring_pass(lambda xs: internals.run_calls(model, xs, around), inputs)
    times = {key: CallTime(*t) for key, t in timer.results().items()}
    layers = tuple(LayerTime(name, times[key].fwd_s, times[key].bwd_s, size,
                             workspace_bytes=int(times[key].workspace_bytes))
                   for name, key, size in found)
    link = calibration.measure_link(mechanism)
    return Profile(mechanism.device_name(), mechanism.backend, int(time_at),
                   fingerprint(model), layers, link, time.perf_counter() - start)


def load(profile):
    """A `Profile` from a `Profile` or the path of its JSON."""
    if isinstance(profile, Profile):
        return profile
    if isinstance(profile, (str, os.PathLike)):
        return Profile.load(profile)
    raise ValueError("`profile` must be a keras_autovm Profile or the path of "
                     f"its JSON. Received: profile={profile!r}")



def warn_if_foreign(profile, model, backend):
    """Warns when a given profile was measured for another architecture or
    backend: its times are matched to this model's layers by name only."""
    differs = []
    if profile.fingerprint != fingerprint(model):
        differs.append("another model (its architecture differs)")
    if profile.backend != backend:
        differs.append(f"another backend ({profile.backend}; this one: {backend})")
    if differs:
        warnings.warn(
            f"The profile given was measured for {' and '.join(differs)}; AutoVM "
            f"applies its times to the layers whose names match.", stacklevel=3)


def check_setting(profile):
    """Rejects a malformed `profile=` argument now, naming it."""
    if profile in ("auto", None, False) or isinstance(profile, (Profile, str, os.PathLike)):
        return
    raise ValueError('`profile` must be "auto", None, False, a keras_autovm '
                     f"Profile or the path of its JSON. Received: profile={profile!r}")


def for_fit(setting, model, batch_size, mechanism, verbose=0, limit_bytes=None):
    """The profile a `fit` plans with, and where it came from.

    Args:
        setting: the `profile=` argument: `"auto"` (cached, else measured
            now), `None`/`False` (off), a `Profile` or the path of its JSON.
        model, batch_size, mechanism: what to measure; `batch_size` may be
            `None` when `fit` does not say it, and nothing is measured then.
        verbose: show a progress bar while measuring.
        limit_bytes: the memory the plan must fit; the pass runs at a
            smaller batch, and the calls may be, when the full one would not
            fit (`profile_batch`).

    Returns:
        `(profile, source)`: `profile` is a `Profile` or `None`; `source`
        is `"measured"`, `"cache"`, `"given"` or `"off"`.
    """
    if setting is None or setting is False:
        return None, "off"
    if setting != "auto":
        given = load(setting)
        warn_if_foreign(given, model, mechanism.backend)
        return given, "given"
    if batch_size is None:
        warnings.warn("AutoVM could not tell the batch size before training, so "
                      "it plans with roofline estimates instead of measured "
                      "layer times. Pass AutoVM(batch_size=...) to measure.",
                      stacklevel=3)
        return None, "off"
    if needs_input_shapes(model):
        warnings.warn("AutoVM times layers at fixed input shapes, and this model's "
                      "inputs have unknown dimensions besides the batch, so it plans "
                      "with roofline estimates. Pass AutoVM(profile=None) to say so.",
                      stacklevel=3)
        return None, "off"
    try:
        profile, measured = obtain(model, batch_size, mechanism, verbose, limit_bytes)
    except Exception as error:  # noqa: BLE001 - a failed measurement must not stop training
        warnings.warn(f"AutoVM could not measure layer times, so it plans with "
                      f"roofline estimates: {type(error).__name__}: {error}",
                      stacklevel=3)
        return None, "off"
    return profile, "measured" if measured else "cache"
