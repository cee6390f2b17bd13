"""TensorFlow swap without managed memory: explicit host copies.

For each layer output `t` the plan swaps, in one traced training step
(`ExplicitSwap`):

- **Copy out.** Right after `t`'s producer, `Snapshot(t)` placed on
  `/CPU:0`. On a GPU, TensorFlow moves `t` to the host for it (a Send/Recv
  pair, on its device-to-host stream).
- **The backward reads the copy.** TensorFlow builds the training step as
  it would without AutoVM. Then every backward op that reads `t` (or an
  identity of it) is pointed at `t`'s copy back instead
  (`tf_internals.tf_replace_input`). No backward op reads the device `t`, so
  TensorFlow frees it after its last forward reader. Shape-only ops
  (`Shape`, `ShapeN`, `Size`, `Rank`) keep reading `t`: they need no data
  and run in the forward pass, as soon as `t` exists.
- **Copy back.** `Snapshot(host copy)` on `/CPU:0` with a control dependency
  on the gradient at the output of the op `plan.prefetch[t]` names (a later
  layer, so it runs earlier in backward), then an identity on `t`'s device.
  On a GPU the host-to-device copy is the Recv of that identity's input: it
  cannot start before the gated host snapshot exists, so it starts when the
  backward pass reaches the trigger, not when the host copy is made
  (ungated, TensorFlow would copy it back during the forward pass). Where
  the trigger's gradient is not an ancestor-safe choice (or was not made),
  the gradient at the output of `t`'s last backward reader gates it; where
  neither is, the copy back is not gated (counted in `copy_backs_ungated`).

The gradients are the ones TensorFlow builds without AutoVM, op for op; the
forward gains the host copies (and identities that mark where the backward
reaches, which Grappler prunes). Nothing is recomputed. Recomputing each
reader from copied-back inputs (`tf.custom_gradient`) was tried first and
changed the forward's numbers: with no backward op reading a layer's
intermediates, Grappler reassociates the layer's forward arithmetic (GELU's
`0.5 * x * erfc(...)`, MobileNetV3's hard-swish) differently than without
AutoVM.

Grappler keeps the copies: on one device it prunes `Identity` chains but
not `Snapshot`s read by a control-dependent `Snapshot`; across devices it
does not bypass a node when that would add device crossings.
"""

import keras
import tensorflow as tf

from keras_autovm.mechanisms.tensorflow import internals as tf_internals
from keras_autovm.mechanisms.tensorflow import logits

# Ops that read only a tensor's shape: left reading the device tensor.
SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


class ExplicitSwap:
    """Carries out one plan's swaps in one traced training step.

    Args:
        applied: the `AppliedPlan`.
        stats: dict of counters to add to (the mechanism's).
    """

    def __init__(self, applied, stats):
        plan = applied.plan
        self.applied = applied
        self.stats = stats
        self.graph = current_graph()
        self.specs = {op.name: op for op in plan.graph.ops}
        tensors = plan.graph.tensor_map
        index = plan.graph.op_index
        self.swapped = set(applied.names("swap"))
        # Only a recompute segment's last output carries a gradient.
        owner = {op: seg[-1] for seg in applied.segments for op in seg}
        # Op name -> [(what, tag)] to learn when the backward reaches it.
        self.marks = {}
        for tag in sorted(self.swapped):
            trigger = plan.prefetch.get(tag)
            if trigger is not None:
                self.marks.setdefault(owner.get(trigger, trigger), []).append(("trigger", tag))
            readers = tensors[tag].bwd_readers
            if readers:
                last = max(readers, key=index.__getitem__)
                self.marks.setdefault(owner.get(last, last), []).append(("at_use", tag))
        for t in plan.graph.tensors:
            if not t.fwd_readers:  # A model output: the backward starts here.
                self.marks.setdefault(t.producer, []).append(("start", None))
        self.host, self.device, self.values = {}, {}, {}
        self.grads = {"trigger": {}, "at_use": {}}
        self.backward_start = None  # Ops in the graph when the backward began.
        # How far each call reaches: a recompute segment runs at its first op.
        self.reach = dict(index)
        self.reach.update({seg[0]: max(index[op] for op in seg) for seg in applied.segments})
        # (op index, tags whose copies to host must be done before it), in
        # forward order; `before_layer` takes them as the forward reaches them.
        self.waits = in_flight_waits(plan, self.swapped)
        self.due = []  # Tags due whose host copies are not made yet.

    # ------------------------------------------------------------ forward

    def before_layer(self, name, inputs):
        """`inputs`, made to wait for the copies to host due before op
        `name` by the plan's bound on copies in flight.

        What waits is this layer call: TensorFlow runs ops as their inputs
        are ready, so an op that does not depend on it (a shortcut branch, a
        layer's keyword inputs) is not held back, and waits due before an
        op that runs without this call (a raw `keras.ops` call, the rest of
        a recompute segment, a shared layer's later call) come at the next
        call that does, later than the simulator's. A copy not made yet, or
        a call with no tensor inputs, leaves its wait to the next call."""
        position = self.reach.get(name)
        while self.waits and position is not None and self.waits[0][0] <= position:
            self.due += self.waits.pop(0)[1]
        flat = keras.tree.flatten(inputs)
        tensors = [i for i, x in enumerate(flat) if tf.is_tensor(x)]
        due = [t for t in self.due if t in self.host]
        if not due or not tensors:
            return inputs
        self.due = [t for t in self.due if t not in due]
        with tf_internals.tf_stop_recording(), tf.name_scope("autovm_wait_copies"), \
                tf.control_dependencies([self.host[t] for t in due]):
            gated = [tf.identity(flat[i]) for i in tensors]
        tf_internals.tf_record_operation("AutoVMWait", gated, [flat[i] for i in tensors],
                                         lambda *grads: list(grads))
        for i, x in zip(tensors, gated):
            flat[i] = x
        self.stats["in_flight_waits"] += len(due)
        return keras.tree.pack_sequence_as(inputs, flat)

    def after_layer(self, name, outputs):
        """Copies the swapped outputs of op `name` out and marks them."""
        spec = self.specs.get(name)
        if spec is None:
            return outputs
        flat = keras.tree.flatten(outputs)
        for x, tag in zip(flat, spec.outputs):
            if tag in self.swapped and tag not in self.host:
                with tf_internals.tf_stop_recording(), tf.name_scope("autovm_swap_out"), \
                        tf.device("/CPU:0"):
                    self.host[tag] = tf.raw_ops.Snapshot(input=x, name="host_copy")
                self.device[tag] = x.device or _default_device()
                self.values[tag] = [x]
                self.stats["host_copies"] += 1
        marks = self.marks.get(name)
        if not marks:
            return outputs
        marked = self._mark(flat, marks)
        for x, tag in zip(marked, spec.outputs):
            if tag in self.values:
                self.values[tag].append(x)
        return keras.tree.pack_sequence_as(outputs, marked)

    def _mark(self, flat, marks):
        """Identities whose gradients say when the backward reaches `flat`."""
        def capture(*grads):
            if self.backward_start is None:
                self.backward_start = len(self.graph.get_operations())
            found = [g for g in grads if g is not None]
            for what, tag in marks:
                if what != "start":
                    self.grads[what].setdefault(tag, found)
            return list(grads)

        # Logits a loss reads instead (`logits.py`) are marked with them.
        found = [logits.of(x) for x in flat]
        with_logits = [i for i, (found_logits, _) in enumerate(found)
                       if found_logits is not None]
        inputs = flat + [found[i][0] for i in with_logits]
        with tf_internals.tf_stop_recording():
            marked = [tf.identity(x) for x in inputs]
        tf_internals.tf_record_operation("AutoVMMark", marked, inputs, capture)
        for i, marked_logits in zip(with_logits, marked[len(flat):]):
            marked[i] = logits.attach(marked[i], marked_logits, found[i][1])
        self.stats["marks"] += len(marks)
        return marked[:len(flat)]

    # ----------------------------------------------------------- backward

    def rewire(self):
        """Points every backward op reading a swapped tensor at its copy
        back. Call once the training step's backward is built."""
        if self.backward_start is None:
            return
        ops = self.graph.get_operations()
        order = {op.name: i for i, op in enumerate(ops)}
        for tag in sorted(self.host):
            reads = self._backward_reads(tag, order)
            if not reads:
                continue
            first = min(order[op.name] for op, _ in reads)
            copy = self._copy_back(tag, self._gate(tag, first, order))
            for op, i in reads:
                tf_internals.tf_replace_input(op, i, copy)
            self.stats["reads_rewired"] += len(reads)

    def _backward_reads(self, tag, order):
        """(op, input index) of the backward ops reading `tag`'s values."""
        values, reads, seen = list(self.values[tag]), [], set()
        while values:
            x = values.pop()
            for op in x.consumers():
                forward = order[op.name] < self.backward_start
                if forward and op.type == "Identity" and op.name not in seen:
                    seen.add(op.name)
                    values.append(op.outputs[0])
                elif not forward and op.type not in SHAPE_OPS:
                    reads += [(op, i) for i, y in enumerate(op.inputs) if y.name == x.name]
        return reads

    def _gate(self, tag, first, order):
        """What the copy back waits for: the first gradient (trigger, then
        at use) made before every backward read of `tag`. A gate made
        before all the reads it guards cannot depend on them, so waiting
        for it adds no cycle."""
        for what in ("trigger", "at_use"):
            grads = self.grads[what].get(tag)
            if grads and all(order[g.op.name] < first for g in grads):
                self.stats["copy_backs_at_use"] += what == "at_use"
                return grads
        self.stats["copy_backs_ungated"] += 1
        return []

    def _copy_back(self, tag, gate):
        with tf.name_scope("autovm_swap_in"):
            with tf.device("/CPU:0"), tf.control_dependencies(gate):
                ready = tf.raw_ops.Snapshot(input=self.host[tag], name="gate")
            with tf.device(self.device[tag]):
                copy = tf.identity(ready, name="copy_back")
        self.stats["copy_backs"] += 1
        return copy


def in_flight_waits(plan, swapped):
    """Before which forward ops the copies of `swapped` tensors must be done
    for the plan's `max_in_flight_bytes`: `[(op index, [tag, ...])]`.

    The simulator lets a forward op start once the copies outstanding are
    within the bound, the oldest retired first (one stream runs them in
    turn). A traced step cannot see which copies are done, so each wait is
    placed where the bound would be passed if none were yet: a copy that
    is done by then costs the wait little (`ExplicitSwap.before_layer`
    says which ops it holds back).
    """
    bound = plan.cost.max_in_flight_bytes
    if bound is None or not swapped:
        return []
    sizes = {t.name: t.nbytes for t in plan.graph.tensors}
    made = {}  # Op -> the swapped tensors it produces.
    for t in plan.graph.tensors:
        if t.name in swapped:
            made.setdefault(t.producer, []).append(t.name)
    waits, outstanding, total = [], [], 0
    for i, op in enumerate(plan.graph.ops):
        due = []
        while outstanding and total > bound:
            tag = outstanding.pop(0)
            total -= sizes[tag]
            due.append(tag)
        if due:
            waits.append((i, due))
        outstanding += made.get(op.name, [])
        total += sum(sizes[tag] for tag in made.get(op.name, []))
    return waits


def recompute(fn):
    """`fn` (a recompute segment), its intermediates recomputed in backward.

    What `keras.remat` (`tf.recompute_grad`) does, without the two things
    that change a training step's numbers: `tf.custom_gradient`'s
    `IdentityN` around the segment (it stands between ops Grappler rewrites
    across it), and the `x + 0` by which graph-mode `tf.recompute_grad`
    orders the replay after the gradient (it turns `-0.0` into `0.0`); here
    a control dependency orders it. Only `fn`'s last output carries a
    gradient (the runtime hands the others to layers that ignore them), and
    the one before it when the last is its logits (`logits.recompute`).
    """
    def run(*inputs):
        flat = [x for x in keras.tree.flatten(inputs) if isinstance(x, tf.Tensor)]
        with tf_internals.tf_variable_watcher() as watcher, tf_internals.tf_stop_recording():
            outputs = fn(*inputs)
        variables = [v for v in watcher.watched_variables() if v.trainable]
        count = logits.carried(outputs)

        def backward(*grads):
            with tf.control_dependencies([g for g in grads if g is not None]):
                xs = [tf.identity(x) for x in flat]
            sources = [x for x in xs if x.dtype.is_floating] + variables
            with tf.GradientTape() as tape:
                tape.watch(sources)
                again = fn(*keras.tree.pack_sequence_as(inputs, xs))[-count:]
            # A loss reads the probabilities or their logits, seldom both.
            pairs = [(y, g) for y, g in zip(again, grads) if g is not None]
            found = iter(tape.gradient([y for y, _ in pairs], sources,
                                       output_gradients=[g for _, g in pairs]))
            return [next(found) if x.dtype.is_floating else None for x in xs] + list(found)

        # Reading each variable here watches it on Keras's tape, as a read
        # in the (unrecorded) forward would have.
        reads = [tf.convert_to_tensor(v) for v in variables]
        tf_internals.tf_record_operation("AutoVMRecompute", list(outputs[-count:]),
                                      flat + reads, backward)
        return outputs

    return run


def current_graph():
    """The graph being traced, or `None` when executing eagerly."""
    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


def _default_device():
    """Where an op with no device runs: the first GPU if there is one."""
    return "/GPU:0" if tf.config.list_logical_devices("GPU") else "/CPU:0"
