"""JAX swap by explicit host copies, in a training step run without jit.

Under `jax.jit` XLA decides where every buffer lives and when it dies; its
host offload (a `jax.checkpoint` offload policy) moved the bytes but kept
the device footprint above keeping everything (docs/mechanisms.md). Run
eagerly, `jax.value_and_grad` executes the forward op by op on concrete
arrays, and what AutoVM does between layers happens when it says. For each
layer output `t` the plan swaps, in one training step (`SwapStep`):

- **Copy out.** After `t`'s producer, `jax.device_put(t, <host memory>)`
  (pinned host memory where the device has it; asynchronous).
- **Readers keep only the copy.** Each layer (or recompute segment) that
  reads `t` runs under a `jax.custom_vjp` whose forward computes its
  outputs and keeps as residuals its inputs, with `t` replaced by the host
  copy; its backward brings `t` back and takes the vector-Jacobian product
  of the layer recomputed from its inputs (what the per-layer
  `jax.checkpoint` does for every other layer).
- **Freed after the last forward reader.** Keras's functional runner
  holds every layer output until the forward pass ends, so once the last
  reader has been dispatched the device buffer under `t` is deleted
  (`jax.Array.delete`; the runtime frees it after the work already queued
  on it). Only readers run here may read `t` again: a reader that is not
  (a raw `keras.ops` call, a mask argument) leaves `t` on the device.
- **Bounded copies in flight.** Before each layer call, the forward waits
  while more than the plan's `max_in_flight_bytes` of copies to host are
  outstanding (the simulator's model: `planner/simulate.py`).
- **Prefetch.** The output of the op `plan.prefetch[t]` names passes
  through an identity `custom_vjp` whose backward, run when the backward
  pass reaches that op, starts copying `t` back; the reader's backward
  takes that copy (or copies it itself when nothing prefetched it).

The same `custom_vjp` runs every other layer and the recompute segments
(with no swapped input, it keeps their inputs on the device): a
`jax.checkpoint` traces its function, and a layer's state update
(batch-norm statistics) would leave that trace. Its forward and its
backward are each one compiled program per call site (`calls.py`), so the
step is eager between layers only.
"""

import collections

import jax
import keras

from keras_autovm import internals
from keras_autovm.mechanisms.jax import calls


def host_kind(device=None):
    """The memory kind copies to host go to: pinned where the device has
    it (GPUs, and the CPU client), else unpinned."""
    device = device or jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else "unpinned_host"


class SwapStep:
    """Carries out one plan's swaps in one eager training step.

    Args:
        applied: the `AppliedPlan`.
        stats: dict of counters to add to (the mechanism's).
        events: list the backward's events are appended to, in order:
            `("prefetch", tag, op)` and `("use", tag, reader)`.
        compiled: dict of the compiled calls of earlier steps, added to.
        run_ahead: how many compiled calls may be enqueued ahead of the
            device (`None`: no bound); see `enqueued`.
    """

    def __init__(self, applied, stats, events, compiled, run_ahead=None):
        plan = applied.plan
        self.compiled = compiled  # call key -> `calls.CompiledCall`, across steps
        self.run_ahead = run_ahead
        self.queued = collections.deque()  # An output of each call enqueued.
        self.stats, self.events = stats, events
        self.swapped = set(applied.names("swap"))
        tensors = plan.graph.tensor_map
        self.tags_of_op = {op.name: op.outputs for op in plan.graph.ops}
        self.readers_left = {t: len(tensors[t].fwd_readers) for t in self.swapped}
        # Only a recompute segment's last output carries a gradient.
        owner = {op: seg[-1] for seg in applied.segments for op in seg}
        self.prefetch_at = collections.defaultdict(list)
        for tag in sorted(self.swapped):
            if plan.prefetch.get(tag) is not None:
                trigger = plan.prefetch[tag]
                self.prefetch_at[owner.get(trigger, trigger)].append(tag)
        self.limit = plan.cost.max_in_flight_bytes
        self.tag_of = {}  # id(device array) -> tag
        self.device = {}  # tag -> device array (deleted after its last reader)
        self.host = {}  # tag -> host copy (the readers' residual)
        self.pinned = set()  # Tags a reader outside this class holds.
        self.back = {}  # tag -> [device copy back or None, backward readers left]
        self.in_flight = collections.deque()  # (host copy, bytes)

    # ------------------------------------------------------------ forward

    def after_layer(self, name, outputs):
        """Copies op `name`'s swapped outputs out; arms its prefetches."""
        flat = keras.tree.flatten(outputs)
        for x, tag in zip(flat, self.tags_of_op.get(name, ())):
            array = internals.jax_concrete(x)
            if tag in self.swapped and array is not None and tag not in self.host:
                self.host[tag] = jax.device_put(
                    array, array.sharding.with_memory_kind(host_kind()))
                self.device[tag], self.tag_of[id(array)] = array, tag
                self.in_flight.append((self.host[tag], array.nbytes))
                self.stats["bytes_to_host"] += array.nbytes
        tags = self.prefetch_at.get(name)
        first = next((i for i, x in enumerate(flat) if calls.is_float(x)), None)
        if tags and first is not None:
            flat[first] = _on_backward(flat[first], lambda: self._prefetch(tags, name))
            outputs = keras.tree.pack_sequence_as(outputs, flat)
        return outputs

    def call(self, run, inputs, variables, reader, key=None):
        """`run(*inputs)` (a flat list of arrays) under the recomputing
        `custom_vjp`, with `variables` (Keras variables it reads) as
        explicit inputs; `reader` names it in events. Its forward and
        backward are compiled programs (`calls.CompiledCall`), kept for
        the next steps under `key` (`calls.call_key`; `None`: not kept).
        A call that adds losses, or cannot be traced on its own, runs as
        Keras runs it, its swapped inputs left on the device."""
        self.bound_in_flight()
        compiled = calls.find(self.compiled, key, run, variables, inputs, self.stats)
        if compiled.runs_as_keras:
            self.pin(inputs)
            return run(*inputs)
        arrays = [internals.jax_concrete(x) for x in inputs]
        tags = [self.tag_of.get(id(a)) if a is not None else None for a in arrays]
        tags = [t if t in self.host else None for t in tags]
        outputs, state = _recomputing(compiled, tags, self, reader)(
            list(inputs), [v.value for v in variables])
        for variable, value in zip(compiled.stateful, state):
            variable.assign(value)
        for tag in set(tags) - {None}:
            self.back.setdefault(tag, [None, 0])[1] += 1
            self._read(tag)
        return outputs

    @staticmethod
    def traceable(arrays):
        """Whether a call on `arrays` can run here: each has a concrete
        value (none does where the step is traced)."""
        return all(internals.jax_concrete(x) is not None for x in arrays)

    def kept_on_device(self):
        """How many swapped tensors stayed on the device (a reader outside
        this class, or one that never ran)."""
        return sum(1 for t, left in self.readers_left.items()
                   if t in self.host and (left or t in self.pinned))

    def pin(self, inputs):
        """Marks swapped `inputs` read by a call this class does not run:
        their device buffers must stay."""
        for x in inputs:
            array = internals.jax_concrete(x)
            tag = self.tag_of.get(id(array)) if array is not None else None
            if tag is not None:
                self.pinned.add(tag)
                self._read(tag)

    def _read(self, tag):
        self.readers_left[tag] -= 1
        if self.readers_left[tag] == 0 and tag not in self.pinned:
            array = self.device[tag]
            self.stats["bytes_freed"] += array.nbytes
            array.delete()

    def bound_in_flight(self):
        """Waits while more than the plan's bound of copies to host are
        outstanding; records the most left outstanding."""
        while self.in_flight and self._copy_done(self.in_flight[0][0]):
            self.in_flight.popleft()
        while self.limit is not None and sum(n for _, n in self.in_flight) > self.limit:
            self.in_flight.popleft()[0].block_until_ready()
            self.stats["in_flight_waits"] += 1
        outstanding = sum(n for _, n in self.in_flight)
        self.stats["max_in_flight_bytes"] = max(self.stats["max_in_flight_bytes"], outstanding)

    @staticmethod
    def _copy_done(host):
        return host.is_ready()

    def enqueued(self, outputs):
        """Bounds how far Python runs ahead of the device. A program's
        buffers are allocated when it is enqueued, and a buffer deleted
        while work on it is queued is freed when that work ends; unbounded,
        the forward and backward are enqueued long before they run, and
        the device holds what the plan frees (prefetched copies, dead
        inputs) at once. Waits for the call `run_ahead` calls back."""
        first = next((x for x in keras.tree.flatten(outputs) if isinstance(x, jax.Array)), None)
        if self.run_ahead is None or first is None:
            return
        self.queued.append(first)
        while len(self.queued) > self.run_ahead:
            oldest = self.queued.popleft()
            if not oldest.is_deleted():  # A swapped output, freed already.
                oldest.block_until_ready()
                self.stats["run_ahead_waits"] += 1

    # ----------------------------------------------------------- backward

    def _prefetch(self, tags, op):
        for tag in tags:
            entry = self.back.get(tag)
            if entry is not None and entry[0] is None:
                entry[0] = self._copy_back(tag)
                self.events.append(("prefetch", tag, op))
                self.stats["copy_backs_prefetched"] += 1

    def take(self, tag, reader):
        """The device copy of `tag` for one of its backward readers."""
        entry = self.back[tag]
        if entry[0] is None:
            entry[0] = self._copy_back(tag)
            self.stats["copy_backs_at_use"] += 1
        self.events.append(("use", tag, reader))
        copy = entry[0]
        entry[1] -= 1
        if not entry[1]:
            del self.back[tag]
        return copy

    def _copy_back(self, tag):
        host = self.host[tag]
        self.stats["bytes_to_device"] += host.nbytes
        return jax.device_put(host, host.sharding.with_memory_kind("device"))


def _recomputing(compiled, tags, step, reader):
    """A `custom_vjp` of `(inputs, values) -> compiled.forward(inputs,
    values)` that keeps host copies for the inputs with a tag and
    recomputes the forward in its backward (`compiled.backward`)."""
    @jax.custom_vjp
    def call(inputs, values):
        return compiled.forward(inputs, values)

    def fwd(inputs, values):
        kept = [step.host[t] if t else x for x, t in zip(inputs, tags)]
        outputs = compiled.forward(inputs, values)
        step.enqueued(outputs)
        return outputs, (kept, values)

    def bwd(residuals, cotangents):
        kept, values = residuals
        # One copy back per tensor, however often the call reads it
        # (attention's query and value are one tensor).
        back = {t: step.take(t, reader) for t in dict.fromkeys(tags) if t}
        inputs = [back[t] if t else x for x, t in zip(kept, tags)]
        step.stats["recomputed_calls"] += 1
        grads = compiled.backward(inputs, values, cotangents[0])
        step.enqueued(grads)
        return grads

    call.defvjp(fwd, bwd)
    return call


def _on_backward(x, action):
    """`x`, through an identity whose backward runs `action` first."""
    @jax.custom_vjp
    def identity(x):
        return x

    def bwd(_, g):
        action()
        return (g,)

    identity.defvjp(lambda x: (x, None), bwd)
    return identity(x)
