"""torch: layer outputs freed after their last forward reader, and what a
plan swaps copied to a pinned host pool and back.

Keras's functional runner keeps every layer output referenced until the
forward pass ends, so on an eager backend nothing the plan drops would leave
the GPU before then. `Step` frees a layer output's storage
(`untyped_storage().resize_(0)`) once every layer that reads it in the
forward pass has run, unless autograd saved it for the backward pass: it
sees every saved tensor through `torch.autograd.graph.saved_tensors_hooks`
around the forward. What is saved and swapped is copied to host instead: a swapped
layer output, or, for a swapped `f"{op}:saved"` (what a layer saves inside
itself, `profile.py`), the tensors autograd saved during that layer call
that are no layer output:

- after its producer runs, the storage is copied into a slice of one pinned
  host buffer (`HostPool`, allocated once per fit) on a stream of its own
  (`streams.Streams.to_host`) ordered after the compute stream;
- after its last forward reader (for a layer's own saved tensors: at once),
  what autograd saved of it points at the host copy, and the GPU storage is
  handed back to torch's allocator with `record_stream` on the copy stream:
  the allocator reuses the block once the copy is done, in the GPU's time.
  Holding the storage until a poll saw the copy done (the first build)
  freed it in the CPU's time instead: the CPU launches layers well ahead of
  the GPU, so on VGG-19 about 0.8 GiB of finished copies stayed allocated
  through the forward, above the plan, and under a cap the allocator could
  not take them back (it waits for a recorded stream's copies before it
  gives up);
- in backward, the copy back starts when the gradient reaches the output of
  the plan's prefetch op (a tensor hook), or at the latest when autograd
  unpacks the tensor; the compute stream waits for it there. Copies back
  run on a second stream (`Streams.to_device`), after the tensor's own
  copy to host: the link carries both directions at once, as the planner's
  simulator assumes, so a copy back needed early in the backward does not
  queue behind copies to host the forward left outstanding;
- before each layer, the forward waits while more than the plan's
  `max_in_flight_bytes` of copies to host are outstanding.

Saved tensors are deduplicated by storage; parameters and tensors under
`MIN_BYTES` are left to autograd. Without CUDA the same steps run with plain
host memory and synchronous copies, which is how the CPU tests check the
numbers.
"""

import collections
import time
import weakref

import keras
import torch

from keras_autovm import internals
from keras_autovm.mechanisms.torch import streams as streams_lib

# Saved tensors smaller than this stay with autograd: not worth a copy.
MIN_BYTES = 1 << 20
_ALIGN = 512


def weight_key(variable):
    """The storage key of a Keras variable's tensor."""
    return internals.uncast_value(variable).untyped_storage().data_ptr()


class HostPool:
    """One host buffer, pinned where CUDA is present, sliced per step."""

    def __init__(self, nbytes, pinned):
        self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
        self.used = 0

    @property
    def nbytes(self):
        return self.buffer.numel()

    def take(self, nbytes):
        """A slice of `nbytes`, or `None` when the pool is full."""
        start = -(-self.used // _ALIGN) * _ALIGN
        if start + nbytes > self.nbytes:
            return None
        self.used = start + nbytes
        return self.buffer[start:start + nbytes]


class Copy:
    """One swapped storage: its host copy (done at the event `d2h`) and, in
    backward, the copy back (done at `h2d`, on `stream`)."""

    __slots__ = ("host", "nbytes", "device", "d2h", "gpu", "h2d", "stream", "read",
                 "__weakref__")

    def __init__(self, host, nbytes, device, d2h=None):
        self.host, self.nbytes, self.device, self.d2h = host, nbytes, device, d2h
        self.gpu = self.h2d = self.stream = None
        self.read = False  # Whether compute waited for the copy back.

    def __del__(self):
        # A copy back no backward read (its node did not run, or the step
        # was given up) would go back to the allocator with nothing waiting
        # for it: the block could be handed out, and written, while the
        # copy still writes it. Those the compute stream waited for are
        # ordered by that wait.
        if self.gpu is not None and self.stream is not None and not self.read:
            self.gpu.record_stream(self.stream)


class Saved:
    """What autograd keeps for a saved tensor: the tensor, or its `Copy`
    and the view of it to rebuild (taken when the tensor is let go: most
    saved tensors are kept, and every step's Python pays for each)."""

    __slots__ = ("tensor", "copy", "view", "__weakref__")

    def __init__(self, tensor):
        self.tensor, self.copy, self.view = tensor, None, None

    def to_copy(self, copy):
        """Lets go of the tensor for `copy` (`None`: the step was given up)."""
        tensor = self.tensor
        if copy is not None and tensor is not None:
            self.view = (tensor.dtype, tensor.storage_offset(), tensor.size(),
                         tensor.stride())
        self.tensor, self.copy = None, copy


class Layout:
    """What `Step` needs to know of a plan, worked out once per plan."""

    def __init__(self, applied):
        graph = applied.plan.graph
        index = graph.op_index
        self.index = index
        self.swap = set(applied.names("swap"))
        self.outputs = {op.name: op.outputs for op in graph.ops}
        self.swap_internal = {op.name for op in graph.ops
                              if f"{op.name}:saved" in self.swap}
        self.keep_alive = set(graph.outputs)
        # (position of the last forward reader, tag), in forward order.
        self.last_use = sorted(
            (max([index[t.producer]] + [index[r] for r in t.fwd_readers]), t.name)
            for t in graph.tensors if t.name not in self.keep_alive and not t.internal)
        self.prefetch_at = collections.defaultdict(list)
        for tag in self.swap:
            if tag in applied.plan.prefetch:
                self.prefetch_at[applied.plan.prefetch[tag]].append(tag)
        self.swap_bytes = sum(graph.tensor_map[t].nbytes for t in self.swap)
        self.max_in_flight = applied.plan.cost.max_in_flight_bytes


class Step:
    """Frees, swaps and brings back layer outputs for one training step."""

    def __init__(self, layout, pool, streams, stats, weights, inputs=()):
        self.layout, self.pool, self.streams, self.stats = layout, pool, streams, stats
        if streams is not None:
            streams.new_step()
        # Storages of the model's variables and of the batch: saved views of
        # them are left be (later layers may read the batch; on a CPU it can
        # be the caller's NumPy memory, which cannot be freed).
        self.weights = {weight_key(v) for v in weights} | {
            x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
        self.keys = {}  # tag -> storage key
        self.storages = {}  # key -> storage, until freed
        self.sharers = collections.defaultdict(set)  # key -> tags on it
        self.saved = collections.defaultdict(list)  # key -> Saved handles
        self.saved_keys = set()  # keys autograd holds (small tensors too)
        self.copies = {}  # key -> Copy, until its storage is freed
        self.pending = []  # (key, storage) saved since the last layer call
        self.done = set()  # tags past their last forward reader
        self.cursor = 0
        self._compute = None  # The forward's stream, looked up once.
        self.in_flight = collections.deque()  # (event, nbytes)
        self.in_flight_bytes = 0
        # tag -> weak references to its copies, for the prefetch hooks: the
        # bookkeeping above lets go of a tag once its storage is freed,
        # which is before the layer where its prefetch is armed.
        self.fetchable = collections.defaultdict(list)
        # Weakly: autograd owns the handles, and frees each after its use.
        self.handles = []

    # ------------------------------------------------- autograd's hooks

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        self.saved_keys.add(key)
        if storage.nbytes() < MIN_BYTES or key in self.weights:
            return tensor
        handle = Saved(tensor)
        self.handles.append(weakref.ref(handle))
        self.saved[key].append(handle)
        self.pending.append((key, storage))
        return handle

    def unpack(self, handle):
        if not isinstance(handle, Saved):
            return handle
        if handle.tensor is not None:
            return handle.tensor
        copy = handle.copy
        if copy.gpu is None:
            self.stats["copy_backs_at_use"] += 1
            self.fetch(copy)
        if copy.h2d is not None:
            torch.cuda.current_stream(copy.device).wait_event(copy.h2d)
            copy.read = True
        dtype, offset, size, stride = handle.view
        view = torch.empty(0, dtype=dtype, device=copy.device)
        return view.set_(copy.gpu.untyped_storage(), offset, size, stride)

    # ------------------------------------------------------- the forward

    def layer_done(self, name, outputs):
        """Called after each layer call of the forward pass, in order."""
        if isinstance(outputs, torch.Tensor):  # Most layers: no tree to walk.
            tensors = [outputs]
        else:
            tensors = [x for x in keras.tree.flatten(outputs) if isinstance(x, torch.Tensor)]
        tags = self.layout.outputs.get(name, ())
        for tag, tensor in zip(tags, tensors):
            key = tensor.untyped_storage().data_ptr()
            self.keys[tag] = key
            self.storages.setdefault(key, tensor.untyped_storage())
            self.sharers[key].add(tag)
            if tag in self.layout.swap:
                self._copy_out(key, tensor.untyped_storage(), tensor.device)
                self._fetchable(tag, key)
        self._swap_internal(name)
        self._arm_prefetch(name, tensors)
        position = self.layout.index[name]
        last_use = self.layout.last_use
        while self.cursor < len(last_use) and last_use[self.cursor][0] <= position:
            self.done.add(last_use[self.cursor][1])
            self._release(last_use[self.cursor][1])
            self.cursor += 1
        self._bound_in_flight()

    def forward_done(self):
        """Drops what only the forward needed: the copies now belong to the
        handles autograd holds, and die with them."""
        self.storages.clear()
        self.copies.clear()
        self.saved.clear()
        self.fetchable.clear()

    def abandon(self):
        """Lets go of a step whose backward will not run (it failed). A
        handle holding a layer's output is held by that output's own node
        (a cycle through autograd's C++ graph that Python's collector
        cannot see); only a finished backward would break it."""
        for ref in self.handles:
            handle = ref()
            if handle is not None:
                handle.to_copy(None)
        self.handles.clear()
        self.forward_done()
        self.pending.clear()
        self.in_flight.clear()
        self.in_flight_bytes = 0

    def _swap_internal(self, name):
        """Swaps what layer `name` saved that is no layer output, if the
        plan says so, and frees it: nothing but autograd holds it."""
        pending, self.pending = self.pending, []
        if name not in self.layout.swap_internal:
            return
        tags = set(self.sharers)
        for key, storage in dict(pending).items():
            if key in tags or key not in self.saved:
                continue
            self._copy_out(key, storage, self.saved[key][0].tensor.device)
            self._fetchable(f"{name}:saved", key)
            if key in self.copies:
                self.storages[key] = storage
                self._free(key)

    def _copy_out(self, key, storage, device):
        if storage.nbytes() < MIN_BYTES or key in self.copies:
            return  # Small: autograd keeps it on the device.
        host = self.pool.take(storage.nbytes())
        if host is None:
            self.stats["swaps_skipped"] += 1
            return
        flat = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        event = None
        if self.streams is not None:
            stream, compute = self.streams.to_host, self._compute_stream(device)
            self.streams.order_after(stream, compute)
            event = streams_lib.copy_on(stream, host, flat, compute)
            # The allocator reuses the block, once freed, after the copy.
            flat.record_stream(stream)
            self.copying(event, storage.nbytes())
        else:
            host.copy_(flat)
        self.copies[key] = Copy(host, storage.nbytes(), device, event)
        self.stats["bytes_to_host"] += storage.nbytes()

    def _compute_stream(self, device):
        """The stream the forward computes on, looked up at its first copy:
        Keras's step runs its layers on one stream and device (a layer that
        switched streams would have to switch back, as torch's context
        does), and each lookup makes a Python `Stream`."""
        if self._compute is None:
            self._compute = torch.cuda.current_stream(device)
        return self._compute

    def _release(self, tag):
        """Frees a tag's storage once no forward reader of any tensor on it
        is left, unless autograd holds it and it has no host copy."""
        key = self.keys.get(tag)
        if key is None or key not in self.storages:
            return
        if not self.sharers[key] <= self.done:
            return
        if key not in self.copies and key in self.saved_keys:
            return  # Kept: the backward pass reads it.
        self._free(key)
        for name in self.sharers.pop(key):
            self.keys.pop(name, None)

    def _free(self, key):
        """Points autograd's handles at the host copy; frees the storage."""
        # The key is an address: once freed, a new storage may get it.
        copy = self.copies.pop(key, None)
        for handle in self.saved.pop(key, ()):
            handle.to_copy(copy)
        storage = self.storages.pop(key)
        self.stats["bytes_freed_early"] += storage.nbytes()
        self.saved_keys.discard(key)
        storage.resize_(0)

    def copying(self, event, nbytes):
        """Counts a copy to host of `nbytes` against the in-flight bound
        until `event` completes."""
        self.in_flight.append((event, nbytes))
        self.in_flight_bytes += nbytes

    def _bound_in_flight(self):
        while self.in_flight and self.in_flight[0][0].query():
            self.in_flight_bytes -= self.in_flight.popleft()[1]
        limit = self.layout.max_in_flight
        if limit is None or self.in_flight_bytes <= limit:
            return
        # The forward waits for the link here: the stall the plan predicts
        # as `SimResult.d2h_wait_time`.
        start = time.perf_counter()
        while self.in_flight_bytes > limit:
            event, nbytes = self.in_flight.popleft()
            event.synchronize()
            self.in_flight_bytes -= nbytes
        self.stats["forward_wait_s"] += time.perf_counter() - start

    # ------------------------------------------------------- the backward

    def _fetchable(self, tag, key):
        # Weak: the copy must die with autograd's last handle, not the hook.
        if key in self.copies:
            self.fetchable[tag].append(weakref.ref(self.copies[key]))

    def _arm_prefetch(self, name, tensors):
        tags = self.layout.prefetch_at.get(name)
        if not tags:
            return
        grad = next((x for x in tensors if x.requires_grad), None)
        if grad is None:
            return
        copies = [ref for tag in tags for ref in self.fetchable.get(tag, ())]
        if copies:
            grad.register_hook(lambda g: self._prefetch(copies))

    def _prefetch(self, copies):
        for ref in copies:
            copy = ref()
            if copy is not None and copy.gpu is None:
                self.stats["copy_backs_prefetched"] += 1
                self.fetch(copy)

    def fetch(self, copy):
        """Starts copying `copy` back to its device (synchronous on a CPU)."""
        copy.gpu = torch.empty(copy.nbytes, dtype=torch.uint8, device=copy.device)
        self.stats["bytes_to_device"] += copy.nbytes
        if self.streams is None:
            copy.gpu.copy_(copy.host)
            return
        stream, compute = self.streams.to_device, torch.cuda.current_stream(copy.device)
        # The new block may still be read by queued compute: copy after it,
        # and after the copy to host it reads.
        self.streams.order_after(stream, compute)
        stream.wait_event(copy.d2h)
        copy.h2d = streams_lib.copy_on(stream, copy.gpu, copy.host, compute)
        copy.stream = stream

