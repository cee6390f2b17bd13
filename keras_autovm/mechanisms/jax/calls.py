"""A layer call (or a recompute segment) as two compiled XLA programs.

In the eager swap step (`swap.py`) every layer runs under a `custom_vjp`
whose residuals are its inputs (or their host copies) and whose backward
recomputes the layer. Run op by op, that step needed 2.2x the planned
memory and 5x the planned time on VGG-19 (docs/results.md): each primitive
was its own program, with its own temporaries and dispatch. Here the
forward, `(inputs, values) -> (outputs, new state)`, is one
`jax.jit` program, and the backward (the forward recomputed, then its
vector-Jacobian product) another, both traced once per call site and
reused every step. Between programs, AutoVM's copies, waits and frees
still happen when the plan says: the step itself stays eager.

Compiling a convolution's program autotunes it, with scratch memory beside
whatever the device holds then. Compiled in the first step, next to that
step's live activations, VGG-19's programs took the process to 10.8 GiB
where the plan needs 4.2 (docs/results.md). So the programs are compiled
ahead of time (`ahead.py`): the step is traced once abstractly
(`jax.eval_shape`), before any activation exists, and each call compiles
its programs at the shapes it sees; the real step runs those executables.
"""

import jax
import keras
import numpy as np

from keras_autovm import internals
from keras_autovm.runtime import run_layers


class CompiledCall:
    """`run(*inputs)` reading the Keras `variables`, as two programs.

    Args:
        run: the call, on a flat list of arrays, returning a structure of
            arrays.
        variables: the Keras variables it reads, trainable first; their
            values are the programs' explicit inputs (`values`), so no
            variable's value is baked into a program.
        inputs: example inputs (for their shapes and dtypes).
        stats: dict of counters to add to (the mechanism's):
            `programs_compiled_ahead`, `programs_compiled_in_steps`,
            `max_program_temp_bytes`.

    Made inside the Keras call it compiles: the call's `training` is
    recorded and restored when the backward program is traced, after the
    model's call has ended (a custom layer's sublayers learn `training`
    only from the call context: batch norm and dropout would otherwise
    recompute in inference mode).

    Attributes:
        runs_as_keras: why the call must run as Keras runs it, not
            compiled here, or `None`. A call that adds losses (`add_loss`,
            an activity regularizer): Keras collects those from the layer
            that added them, outside any program. A call that cannot be
            traced on its own: it reads a variable of another layer (tied
            weights), whose value Keras's step holds outside the layer.
        traces: how often the call's Python ran (tracing its programs:
            once for its shapes, once per program and input shape).
        programs: its compiled executables, by program and argument types.
        temp_bytes: the scratch memory each executable needs, by the same
            key (XLA's memory analysis; 0 where the backend gives none).
    """

    def __init__(self, run, variables, inputs, stats):
        self.stats = stats
        self.variables = list(variables)
        self.stateful = [v for v in self.variables if not v.trainable]
        self._run = run
        self.traces = 0
        self.training = internals.keras_call_training()
        self.runs_as_keras = self._check(inputs)
        self._forward = jax.jit(lambda inputs, values: self._traced(inputs, values)[:2])
        self._backward = jax.jit(self._vjp)
        self.programs = {}  # (program, argument types) -> compiled executable
        self.temp_bytes = {}  # (program, argument types) -> its scratch bytes

    def _check(self, inputs):
        shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs]
        values = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in self.variables]
        try:
            losses = jax.eval_shape(self._traced, shapes, values)[2]
        except Exception as error:  # noqa: BLE001 -- run as Keras runs it, which reports it
            return f"cannot be traced on its own ({type(error).__name__}: {error})"
        return "adds losses" if losses else None

    def _traced(self, inputs, values):
        self.traces += 1
        mapping = list(zip(self.variables, values))
        with internals.keras_call_training_set(self.training), keras.StatelessScope(
                state_mapping=mapping, collect_losses=True) as scope:
            outputs = self._run(*inputs)
        return outputs, [scope.get_current_value(v) for v in self.stateful], scope.losses

    def _vjp(self, inputs, values, cotangents):
        wrt = [i for i, x in enumerate(inputs) if is_float(x)]
        trained = [i for i, v in enumerate(self.variables) if v.trainable]

        def outputs_of(xs, ws):
            full, vals = list(inputs), list(values)
            for i, x in zip(wrt, xs):
                full[i] = x
            for i, w in zip(trained, ws):
                vals[i] = w
            return self._traced(full, vals)[0]

        _, vjp = jax.vjp(outputs_of, [inputs[i] for i in wrt], [values[i] for i in trained])
        return vjp(cotangents)

    def forward(self, inputs, values):
        """`(outputs, new values of the stateful variables)`, on arrays."""
        return self.program("forward", inputs, values)(inputs, values)

    def traced_forward(self, inputs, values):
        """`forward` traced inline, on abstract arguments (`ahead.Ahead`'s
        pass): an executable takes only arrays."""
        return self._forward(inputs, values)

    def backward(self, inputs, values, cotangents):
        """Cotangents of `(inputs, values)` from those of the outputs;
        zero for integer inputs and untrained variables."""
        program = self.program("backward", inputs, values, cotangents)
        d_inputs, d_weights = program(inputs, values, cotangents)
        d_inputs, d_weights = iter(d_inputs), iter(d_weights)
        return ([next(d_inputs) if is_float(x) else zero(x) for x in inputs],
                [next(d_weights) if v.trainable else zero(x)
                 for v, x in zip(self.variables, values)])

    def program(self, name, *args, ahead=False):
        """The executable of program `name` ("forward" or "backward") for
        arguments of the types of `args` (arrays or `ShapeDtypeStruct`s),
        compiled the first time those types are seen. An executable
        takes arrays of its types whatever their placement on the device
        (a copy back is committed, a layer output is not), which `jax.jit`'s
        cache would tell apart and compile twice."""
        key = self._key(name, args)
        program = self.programs.get(key)
        if program is None:
            function = self._forward if name == "forward" else self._backward
            leaves, tree = jax.tree_util.tree_flatten(args)
            types = [jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=_weak(x)) for x in leaves]
            program = function.lower(*jax.tree_util.tree_unflatten(tree, types)).compile()
            self.programs[key] = program
            analysis = program.memory_analysis()  # None where the backend has none
            self.temp_bytes[key] = getattr(analysis, "temp_size_in_bytes", 0)
            self.stats["max_program_temp_bytes"] = max(
                self.stats["max_program_temp_bytes"], self.temp_bytes[key])
            self.stats["programs_compiled_ahead" if ahead else "programs_compiled_in_steps"] += 1
        return program

    @staticmethod
    def _key(name, args):
        # Looked up on every call of every step: plain tuples, no objects.
        leaves, tree = jax.tree_util.tree_flatten(args)
        return name, tree, tuple((x.shape, x.dtype, _weak(x)) for x in leaves)

    def compile_ahead(self, inputs, values):
        """Compiles both programs for arguments shaped like `inputs` and
        `values` (abstract or concrete), the backward's cotangents shaped
        like the forward's outputs; returns their scratch bytes,
        `(forward, backward)`."""
        self.program("forward", inputs, values, ahead=True)
        outputs = jax.eval_shape(self._forward, inputs, values)[0]
        cotangents = jax.tree_util.tree_map(_cotangent_type, outputs)
        self.program("backward", inputs, values, cotangents, ahead=True)
        return (self.temp_bytes[self._key("forward", (inputs, values))],
                self.temp_bytes[self._key("backward", (inputs, values, cotangents))])


def find(compiled, key, run, variables, inputs, stats):
    """The compiled call kept under `key` in `compiled`, made (and kept,
    unless `key` is `None`) if there is none."""
    call = compiled.get(key) if key is not None else None
    if call is None:
        call = CompiledCall(run, variables, inputs, stats)
        if key is not None:
            compiled[key] = call
    return call


def layer_site(layer, structure, leaves, found, kwargs):
    """`(run, variables, key)` of a layer call on `structure` (`(inputs,
    args)`, flattened to `leaves`, arrays at positions `found`): `run(*arrays)`
    calls `layer` with the arrays put back. It holds none of this call's
    arrays: a compiled call keeps it for the next steps, and an array it
    held would stay on the device until the fit ends."""
    arrays = set(found)
    template = [None if i in arrays else x for i, x in enumerate(leaves)]
    skeleton = keras.tree.pack_sequence_as(structure, template)

    def run(*values):
        filled = list(template)
        for i, x in zip(found, values):
            filled[i] = x
        inputs, args = keras.tree.pack_sequence_as(skeleton, filled)
        return layer(inputs, *args, **kwargs)

    variables = variables_of([layer])
    return run, variables, call_key(layer, structure, leaves, found, kwargs, variables)


def segment_site(layers, kwargs, inputs):
    """`(run, variables, key)` of a recompute segment of `layers` on
    `inputs`; like `layer_site`, `run` holds none of its arrays."""
    flat = keras.tree.flatten(inputs)
    structure = keras.tree.map_structure(lambda _: None, inputs)

    def run(*xs):
        return run_layers(layers, kwargs, keras.tree.pack_sequence_as(structure, list(xs)))

    variables = variables_of(layers)
    return run, variables, call_key(tuple(layers), inputs, flat, range(len(flat)),
                                    kwargs, variables)


def variables_of(layers):
    """The distinct variables of `layers`, trainable first."""
    seen, found = set(), []
    for layer in layers:
        for v in layer.trainable_variables + layer.non_trainable_variables:
            if id(v) not in seen:
                seen.add(id(v))
                found.append(v)
    return found


def call_key(site, structure, leaves, found, kwargs, variables):
    """What identifies a call site's programs: the site, the structure of
    its arguments and their non-array leaves, the keyword arguments, the
    call's `training` and which variables train. `None` when some of it
    is not hashable: that call is traced each time it runs."""
    arrays = set(found)
    static = tuple(x for i, x in enumerate(leaves) if i not in arrays)
    key = (site, jax.tree_util.tree_structure(structure), static,
           tuple(sorted(kwargs.items())), internals.keras_call_training(),
           tuple(v.trainable for v in variables))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _weak(x):
    return bool(getattr(x, "weak_type", False) or getattr(
        getattr(x, "aval", None), "weak_type", False))


def _cotangent_type(x):
    dtype = x.dtype if is_float(x) else jax.dtypes.float0
    return jax.ShapeDtypeStruct(x.shape, dtype)


def is_float(x):
    return jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)


def zero(x):
    """A zero cotangent for `x` (`float0` for integer arrays)."""
    if is_float(x):
        return jax.numpy.zeros_like(x)
    return np.zeros(x.shape, dtype=jax.dtypes.float0)
