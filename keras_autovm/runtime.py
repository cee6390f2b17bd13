"""What the wrappers of one model consult while it trains.

A `Runtime` holds the plan for each batch size it has seen (planned lazily,
on the first training call at that batch size, since Keras tells callbacks
no batch size) and carries out recompute segments for backends that
rematerialise per function (TensorFlow, torch): the first layer of a segment
runs the whole segment under the backend's `recompute`, and the later layers
of the segment hand back the outputs it computed.
"""

import contextlib

import keras


class Runtime:
    """Plans and applies them, for one wrapped model.

    Args:
        mechanism: the backend mechanism module (`keras_autovm.mechanisms`).
        make_plan: callable `batch_size -> Plan`.
        layers: maps layer name to the (unwrapped) layer object.
    """

    def __init__(self, mechanism, make_plan, layers, batch_size=None):
        self.mechanism = mechanism
        # Used when a traced batch has no static size (TensorFlow datasets).
        self.batch_size = batch_size
        self._make_plan = make_plan
        self._layers = layers
        self._plans = {}
        self.plan = None
        self._stash = {}
        self._swapped = {}
        self.on_error = None
        # What was carried out, for reports and tests.
        self.stats = {"segments_run": 0, "segments_replayed": 0,
                      "checkpointed_traces": 0, "evicts_inserted": 0,
                      "prefetches_inserted": 0}

    def replace(self, plan):
        """Applies `plan` from now on; other batch sizes are planned anew."""
        self._plans = {}
        self._add(plan.graph.batch_size, plan)

    def plan_for(self, batch_size):
        """The plan for `batch_size`, made on first use; `None` if unknown."""
        batch_size = batch_size or self.batch_size
        if batch_size is None:
            return self.plan
        if batch_size not in self._plans:
            self._add(batch_size, self._make_plan(batch_size))
        return self._plans[batch_size]

    def _add(self, batch_size, plan):
        self._plans[batch_size] = _Applied(plan, runnable=self._layers)
        # Reports show the plan of the full batch, not of a last partial one.
        self.plan = self._plans[max(self._plans)]

    def plan_for_inputs(self, inputs):
        """The plan for a batch of model inputs; fails if its size is unknown."""
        batch_size = _batch_size(inputs) or self.batch_size
        if batch_size is None:
            raise ValueError(
                "AutoVM could not tell the training batch size: the traced "
                "batch has no static size and the data does not say. Pass "
                "AutoVM(batch_size=...).")
        return self.plan_for(batch_size)

    def jax_policy(self, batch):
        """The checkpoint policy for this batch, or `None` to change nothing."""
        applied = self.plan_for(_batch_size(batch))
        if applied is None or not applied.changes_anything:
            return None
        self.stats["checkpointed_traces"] += 1
        return self.mechanism.policy(applied)

    def abort(self):
        """Called when planning fails inside `fit`."""
        if self.on_error is not None:
            self.on_error()

    def call(self, wrapper, inputs, args, kwargs, training):
        """Runs `wrapper`'s layer in training, applying the plan."""
        name, tags = wrapper._autovm_op
        applied = self.plan_for(_batch_size(inputs))
        segment = (applied.segment_starting.get(name)
                   if applied and self.mechanism.REPLAYS_SEGMENTS else None)
        if name in self._stash:
            outputs = self._stash.pop(name)
        elif segment and not args and set(kwargs) <= {"training"}:
            outputs = self._run_segment(segment, inputs, training)
        else:
            outputs = self._tag(tags, self._layer_call(
                wrapper.layer, applied, inputs, args, kwargs))
        if applied and applied.swaps and self.mechanism.SWAPS_BY_OPS:
            outputs = self._move_pages(name, outputs, applied)
        return outputs

    def _move_pages(self, name, outputs, applied):
        """Evicts swapped inputs after their last forward reader and arms the
        backward prefetches this layer triggers.

        Both ops pass `outputs` through, so everything downstream depends on
        them: an evict runs after the read it follows, and a prefetch fires
        when the backward pass reaches this layer's output gradient.
        """
        if applied.uses.get(name):
            self._swapped[name] = [outputs, applied.uses[name]]
        evict = [self._use(t) for t in applied.evict_after.get(name, ())]
        if evict:
            outputs = self.mechanism.evict(outputs, evict)
            self.stats["evicts_inserted"] += len(evict)
        # A skip connection can put the trigger before the last forward
        # reader, so references are dropped after their last use, not first.
        fetch = [self._use(t) for t in applied.prefetch_at.get(name, ())]
        if fetch:
            outputs = self.mechanism.prefetch_on_backward(outputs, fetch)
            self.stats["prefetches_inserted"] += len(fetch)
        return outputs

    def _layer_call(self, layer, applied, inputs, args, kwargs):
        """Calls `layer`, recomputing its internals where the backend asks.

        The plan decides about layer outputs only. What a layer keeps
        inside for its backward (the pre-activation of a fused ReLU, say)
        is recomputed from its input right before its own backward, as the
        planner assumes: measured on VGG-19 (results/gpu_vgg19_memory.json),
        XLA's own choice keeps about twice the planned bytes. Layers with
        state (batch norm) are left alone: their updates may not leave a
        `jax.checkpoint`.
        """
        if (applied is None or not self.mechanism.REMAT_LAYERS
                or layer.non_trainable_variables):
            return layer(inputs, *args, **kwargs)
        return self.mechanism.recompute(lambda x, *a: layer(x, *a, **kwargs))(
            inputs, *args)

    def _use(self, tag):
        entry = self._swapped[tag]
        entry[1] -= 1
        if not entry[1]:
            del self._swapped[tag]
        return entry[0]

    def _tag(self, names, outputs):
        if len(names) == 1:
            return self.mechanism.tag(outputs, names[0])
        flat = keras.tree.flatten(outputs)
        tagged = [self.mechanism.tag(x, n) for x, n in zip(flat, names)]
        return keras.tree.pack_sequence_as(outputs, tagged)

    def _run_segment(self, names, inputs, training):
        layers = [self._layers[n] for n in names]
        segment = _Segment(layers, training, self.stats)
        self.stats["segments_run"] += 1
        outputs = self.mechanism.recompute(lambda x: segment(x))(inputs)
        for name, output in zip(names[1:], outputs[1:]):
            self._stash[name] = output
        return outputs[0]


class _Applied:
    """A plan with the look-ups the runtime needs."""

    def __init__(self, plan, runnable):
        self.actions = dict(plan.actions)
        self.plan = plan
        # A segment holding a raw `keras.ops` call cannot be replayed layer by
        # layer: its outputs stay as computed (kept), at a cost in memory.
        segments = [tuple(seg) for seg in plan.segments
                    if len(seg) > 1 and all(op in runnable for op in seg)]
        self.segment_starting = {seg[0]: seg for seg in segments}
        self.changes_anything = any(a != "keep" for a in self.actions.values())
        self.swaps = set(self.names("swap"))
        self.evict_after, self.prefetch_at = _page_moves(plan, segments)
        moves = [t for ts in self.evict_after.values() for t in ts]
        moves += [t for ts in self.prefetch_at.values() for t in ts]
        self.uses = {t: moves.count(t) for t in self.swaps}

    def names(self, action):
        """The tags whose action is `action`."""
        return [t for t, a in self.actions.items() if a == action]


class _Segment:
    """Runs a chain of layers; replays it with the forward's layer state.

    The backward pass calls it a second time to recompute. Layer state that
    the forward updated (batch-norm moving statistics, seed generators) is
    read from a snapshot taken before the forward, and updates made while
    replaying are discarded, so recomputing changes no variable.
    """

    def __init__(self, layers, training, stats):
        self.layers = layers
        self.stats = stats
        self.kwargs = {} if training is None else {"training": training}
        self.snapshot = [(v, keras.ops.copy(v.value)) for layer in layers
                         for v in layer.non_trainable_variables]
        self.calls = 0

    def __call__(self, x):
        # `training` is passed explicitly: the replay runs in the backward
        # pass, outside the call context that carried it in the forward.
        replaying = self.calls > 0
        self.calls += 1
        self.stats["segments_replayed"] += replaying
        scope = (keras.StatelessScope(state_mapping=self.snapshot)
                 if replaying and self.snapshot else contextlib.nullcontext())
        outputs = []
        with scope:
            for layer in self.layers:
                x = layer(x, **_accepted(layer, self.kwargs))
                outputs.append(x)
        return tuple(outputs)


def _page_moves(plan, segments):
    """Where each swapped tensor is evicted and its prefetch triggered.

    Only a segment's last output carries gradient (the others are handed to
    layers that ignore them), so duties of a layer inside a recompute
    segment move to the segment's last layer.
    """
    owner = {op: seg[-1] for seg in segments for op in seg}
    index = plan.graph.op_index
    tensors = plan.graph.tensor_map
    evict_after, prefetch_at = {}, {}
    for tag, action in plan.actions.items():
        if action != "swap":
            continue
        readers = tensors[tag].fwd_readers
        if readers:
            last = max(readers, key=index.__getitem__)
            evict_after.setdefault(owner.get(last, last), []).append(tag)
        trigger = plan.prefetch.get(tag)
        if trigger is not None:
            prefetch_at.setdefault(owner.get(trigger, trigger), []).append(tag)
    return evict_after, prefetch_at


def _accepted(layer, kwargs):
    return kwargs if getattr(layer, "_call_has_training_arg", False) else {}


def _batch_size(inputs):
    leaves = keras.tree.flatten(inputs)
    shape = getattr(leaves[0], "shape", None) if leaves else None
    if not shape:
        return None
    size = shape[0]
    return int(size) if size is not None else None
