"""Times one layer call on TensorFlow, inside `tf.function`s as it trains.

The forward is the layer's `stateless_call` in one `tf.function`. A
persistent `tf.GradientTape` records one call of it as one operation, whose
gradient is the function's own compiled backward; `tape.gradient` then runs
that backward alone, as often as asked. Clocks stop after
`tf.test.experimental.sync_devices()`, which waits for the GPU.

What one call of a `tf.function` and one `tape.gradient` cost in Python
is near a millisecond on an H200 (0.64 ms each for a layer that multiplies
one number), more with more arguments, and a training step does not pay
it per layer: ResNet-152's 516 layer calls timed so summed to 1.50 s at
batch 64, its whole Keras step took 0.28 s
(`results/tensorflow/timing/harness_h200_fa870f8.json`). So each call is
timed in a function that runs it once and in one that runs it twice in a
row; the difference is one call as a step runs it (`time_call`).

On a GPU it also measures what the call allocates for a moment, its
workspace (`_workspace`): the most allocated while its backward runs,
above the larger of what was allocated before and after.
Keras's `BatchNormalization` is composite on TensorFlow, and its backward
makes output-sized temporaries (Tile, Mul, AddN): on an H200, at the peak
of ResNet-152's step at batch 264, the buffers live included five the
size of a layer output made by two of them (`results/tensorflow/trace/`).
The planner holds a measured workspace while the op runs.
"""

import functools
import warnings

import tensorflow as tf

from keras_autovm.mechanisms.tensorflow import internals
from keras_autovm.mechanisms.timing import CallTime
from keras_autovm.mechanisms.timing import call_values
from keras_autovm.mechanisms.timing import link_gbps
from keras_autovm.mechanisms.timing import median_seconds
from keras_autovm.mechanisms.timing import variable_values
from keras_autovm.planner import CostModel

# Bytes each copy of the link measurement moves.
LINK_BYTES = 64 << 20


def _wait(result=None):
    if tf.config.list_logical_devices("GPU"):
        tf.test.experimental.sync_devices()


def _is_float(x):
    return isinstance(x, tf.Tensor) and x.dtype.is_floating


# Runs timed of each function: a call is the difference of two times of
# about the same size, so each is the median of more runs than one needs.
_REPEATS = 5
# A call costs at least what the planner counts for launching an op.
_LEAST_S = CostModel.op_overhead_s


def time_call(operation, args, kwargs, repeats):
    """`CallTime(forward_s, backward_s, workspace_bytes)` of one layer call;
    see `Mechanism.time_call`. `workspace_bytes` is 0 where it is not
    measured (`_workspace`: without a GPU, among others).

    The difference between a function running the call twice in a row and
    one running it once (the second call on copies of the arguments, so
    that the backward does not add the two calls' gradients, which a step
    does not). Where the two calls run out of memory, the call timed once,
    less what timing a call that doubles one number costs.
    """
    tv, ntv = variable_values(operation)
    tv = [tf.identity(x) for x in tv]
    leaves = tf.nest.flatten(args)
    floats = [i for i, x in enumerate(leaves) if _is_float(x)]

    def forward(tv, xs):
        full = list(leaves)
        for i, x in zip(floats, xs):
            full[i] = x
        return call_values(operation, tv, ntv,
                           tf.nest.pack_sequence_as(args, full), kwargs)

    xs = [leaves[i] for i in floats]
    repeats = max(repeats, _REPEATS)
    once = _Runs(forward, [(tv, xs)])
    fwd_once = once.forward_s(repeats)
    bwd_once = once.backward_s(repeats)
    del once
    workspace = _workspace(forward, [(tv, xs)], sum(_nbytes(x) for x in tv))
    fwd_twice = bwd_twice = None
    try:
        twice = _Runs(forward, [(tv, xs), _copies(tv, xs)])
        fwd_twice = twice.forward_s(repeats)
        if bwd_once is not None:
            bwd_twice = twice.backward_s(repeats)
    except tf.errors.ResourceExhaustedError:
        pass  # Two calls beside a pass that holds every layer output.
    fwd_idle, bwd_idle = _idle_call_s(repeats) if bwd_twice is None else (0.0, 0.0)
    fwd_s = _one_call(fwd_once, fwd_twice, fwd_idle)
    if bwd_once is None:  # Nothing to differentiate.
        return CallTime(fwd_s, 0.0, workspace)
    return CallTime(fwd_s, _one_call(bwd_once, bwd_twice, bwd_idle), workspace)


def _workspace(forward, arguments, weight_bytes):
    """Bytes a call allocates for a moment as a step runs it: what its
    backward (its forward, where it has none) allocates above the larger of
    what is held before and after, less `weight_bytes`; 0 without a GPU, or
    where a call alone does not run as in the step.

    Alone, a convolution or a pooling is wrapped by Grappler's layout
    optimizer in transposes to and from the GPU's layout, which a step,
    converting its graph as a whole, pays only where the layout changes,
    not around each layer: on an H200
    (`results/tensorflow/workspace/transients_b44_cap0.json`) VGG-19's
    `block1_conv2` measured 8 outputs' worth alone and 4 with the layout
    optimizer off, where VGG-19's whole step at batch 100 under an 8 GiB
    cap peaked 0.74 GiB above a plan without any
    (`results/tensorflow/timing/d8c58ce_vgg19_96_104.json`). A call whose
    measured graphs have a transpose the layout optimizer made is not
    measured, and the first step learns what it makes (`first_step.py`).
    Neither is a call that runs out of memory here. A Dense layer's
    backward made one copy of its weight gradient (VGG-19's `fc1`, `fc2`
    and `predictions` at batch 44: 397.6, 66.1 and 16.6 MiB, their kernels
    392, 64 and 15.6 MiB), and the plan counts the weights' gradients
    already: the call's trainable bytes (`weight_bytes`) come off.
    """
    if _memory_device() is None:
        return 0
    runs = _Runs(forward, arguments)
    try:
        run = runs._gradient() or (lambda: runs.runs(runs.arguments))
        # Only the run that instantiates a function lists its graphs.
        graphs = internals.tf_function_graphs(run)
        if not graphs or _layout_transposed(graphs):
            return 0
        return max(0, _transient(run) - weight_bytes)
    except (tf.errors.ResourceExhaustedError, tf.errors.InternalError):
        # Out of memory (cuDNN's and cuBLAS's failures to allocate come as
        # internal errors): not measured, the first step learns it.
        return 0


def _layout_transposed(graphs):
    """Whether Grappler's layout optimizer put a transpose in `graphs`
    (`internals.tf_function_graphs`): it names what it adds
    `...-LayoutOptimizer`. A layer's own transposes (`Permute`) are not
    its."""
    return any(node.op == "Transpose" and "LayoutOptimizer" in node.name
               for g in graphs for node in g.post_optimization_graph.node)


def _nbytes(x):
    return int(tf.size(x)) * x.dtype.size


def _copies(tv, xs):
    return [tf.identity(x) for x in tv], [tf.identity(x) for x in xs]


def _one_call(once, twice, idle):
    """One call's seconds from the times of one call and of two (`None`:
    not timed), else from one call's less `idle`; what each function pays
    for itself cancels out. Noise can make two calls no longer than one:
    the call then costs `_LEAST_S`, not nothing."""
    if twice is None:
        return max(once - idle, _LEAST_S)
    return max(twice - once, _LEAST_S)


def _double(tv, xs):
    return xs[0] * 2.0


@functools.lru_cache(maxsize=None)
def _idle_call_s(repeats):
    """`(forward_s, backward_s)` of timing, once, a call that doubles one number."""
    runs = _Runs(_double, [([], [tf.ones((1, 1))])])
    return runs.forward_s(repeats), runs.backward_s(repeats)


def _tensors(structure):
    return [y for y in tf.nest.flatten(structure) if tf.is_tensor(y)]


class _Runs:
    """A layer's forward run once per `(tv, xs)` of `arguments`, each after
    the one before, in one `tf.function`; and the backward of all of them."""

    def __init__(self, forward, arguments):
        @tf.function
        def runs(arguments):
            outputs, last = [], []
            for tv, xs in arguments:
                # Ordered after the run before, the same call is another
                # op to Grappler, not a duplicate to fold into it.
                with tf.control_dependencies(last):
                    outputs.append(forward(tv, xs))
                last = _tensors(outputs[-1])
            return outputs

        self.arguments, self.runs = arguments, runs

    def forward_s(self, repeats):
        return median_seconds(lambda: self.runs(self.arguments), _wait, repeats)

    def backward_s(self, repeats):
        """Seconds of the backward of the runs, on a persistent tape freed
        after; `None` where nothing is floating, in or out. The gradients
        flowing in are made once, outside the clock."""
        gradient = self._gradient()
        return None if gradient is None else median_seconds(gradient, _wait, repeats)

    def _gradient(self):
        """A function that runs the backward of the runs, recorded once on
        a persistent tape; `None` where nothing is floating, in or out."""
        sources = [list(pair) for pair in self.arguments]
        if not any(tv or xs for tv, xs in sources):
            return None
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(sources)
            outputs = [y for y in _tensors(self.runs(self.arguments))
                       if y.dtype.is_floating]
        if not outputs:
            return None
        ones = [tf.ones_like(y) for y in outputs]
        return lambda: tape.gradient(outputs, sources, output_gradients=ones)


def _memory_device():
    """The device whose memory a plan fits: the GPU's; none without one (a
    plan applied on a CPU manages no memory, so its layers have none)."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else None


def _transient(run):
    """Bytes `run()` allocates above the larger of what was allocated before
    it and after it (its results held): the temporaries it makes and frees.
    0 without a GPU (`_memory_device`), or where the allocator keeps no
    count."""
    device = _memory_device()
    if device is None:
        return 0
    _wait()
    try:
        before = tf.config.experimental.get_memory_info(device)["current"]
        tf.config.experimental.reset_memory_stats(device)
    except (ValueError, tf.errors.OpError):
        return 0  # This device's allocator keeps no count.
    result = run()  # Running out of memory here is the caller's to handle.
    _wait()
    stats = tf.config.experimental.get_memory_info(device)
    del result
    return max(0, stats["peak"] - max(before, stats["current"]))


def measure_link(device="GPU:0", host="CPU:0", repeats=3):
    """GB/s of TensorFlow's own copies as the explicit swap makes them (a
    `Snapshot` placed on the other device, in a `tf.function`): to the
    host, to the device, and both at once; `None` without a GPU, or, with
    a warning, where TensorFlow refuses a copy. TensorFlow allocates what
    a copy to the host lands in itself (pinned where its GPU host
    allocator serves it), so these are the figures its swaps plan with,
    under the pinned link's keys. `device` and `host` name the two ends
    (tests copy between two CPU placements)."""
    if device.startswith("GPU") and not tf.config.list_logical_devices("GPU"):
        return None
    try:
        return _link_gbps(device, host, repeats)
    except tf.errors.OpError as error:
        warnings.warn(f"AutoVM could not time TensorFlow's copies: {error.message}",
                      stacklevel=2)
        return None


def _link_gbps(device, host, repeats):
    def copy(x, where):
        with tf.device(where):
            return tf.raw_ops.Snapshot(input=x)

    d2h = tf.function(lambda x: copy(x, host))
    h2d = tf.function(lambda h: copy(h, device))
    both = tf.function(lambda x, h: (copy(x, host), copy(h, device)))
    with tf.device(device):
        on_device = tf.zeros([LINK_BYTES], tf.uint8)
    # What a swap copies back is what its copy to the host made, in the
    # memory TensorFlow gave that copy. A tensor made on the host is in
    # pageable memory: copied from there, 7.0 GB/s against 35.3 on an H200.
    on_host = d2h(on_device)
    return link_gbps(LINK_BYTES, lambda: d2h(on_device), lambda: h2d(on_host),
                     lambda: both(on_device, on_host), _wait, repeats)
