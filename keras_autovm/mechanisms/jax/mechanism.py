"""JAX: tags become `checkpoint_name`s; one `jax.checkpoint` around the loss
applies the plan (keep = save, swap = offload to pinned host, recompute =
neither), and XLA schedules the copies on its own streams."""

import functools

import jax
from jax.ad_checkpoint import checkpoint_name

from keras_autovm import internals
from keras_autovm.mechanisms.base import Mechanism
from keras_autovm.mechanisms.jax import timing


class JaxMechanism(Mechanism):
    """Keep, swap (XLA host offload) and recompute (`jax.checkpoint`)."""

    backend = "jax"

    def __init__(self):
        super().__init__()
        self.stats = {"checkpointed_traces": 0}

    def actions(self):
        return ("keep", "swap", "recompute")

    def auto_actions(self):
        """No swaps: XLA carries out the offloads (weights stay identical)
        but, measured on VGG-19 (results/gpu_vgg19_memory.json), its buffer
        assignment keeps the device footprint far above the plan
        (offload_all: 17.57 GiB on device for a planned 8.3 GiB), so a swap
        plan would not fit where it says it does."""
        return ("keep", "recompute")

    @property
    def replays_segments(self):
        # XLA recomputes whatever the checkpoint policy does not save.
        return False

    def gpu_available(self):
        return any(d.platform == "gpu" for d in jax.devices())

    def device_memory(self):
        """The bytes XLA's allocator may use (respects XLA_PYTHON_CLIENT_MEM_FRACTION)."""
        return self._memory_stat("bytes_limit")

    def peak_memory(self):
        # XLA's client offers no reset: this is the process's running peak.
        return self._memory_stat("peak_bytes_in_use")

    def device_name(self):
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        return gpus[0].device_kind if gpus else super().device_name()

    def time_call(self, operation, args, kwargs, repeats):
        return timing.time_call(operation, args, kwargs, repeats)

    def _memory_stat(self, key):
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        return (gpus[0].memory_stats() or {}).get(key) if gpus else None

    def tag(self, x, name):
        return checkpoint_name(x, name)

    def call_layer(self, layer, inputs, args, kwargs, applied):
        """Runs each stateless layer under its own `jax.checkpoint`.

        The plan decides about layer outputs only. What a layer keeps inside
        for its backward (the pre-activation of a fused ReLU, say) is then
        recomputed from its input right before its own backward, as the
        planner assumes: measured on VGG-19 (results/gpu_vgg19_memory.json),
        XLA's own choice keeps about twice the planned bytes. Layers with
        state (batch norm) are left alone: their updates may not leave a
        `jax.checkpoint`.
        """
        if applied is None or layer.non_trainable_variables:
            return layer(inputs, *args, **kwargs)
        return self.recompute(lambda x, *a: layer(x, *a, **kwargs))(inputs, *args)

    def checkpoint_policy(self, applied):
        """The `jax.checkpoint` policy carrying out a plan's actions."""
        keep, swap = applied.names("keep"), applied.names("swap")
        if swap and not _has_pinned_host():
            keep, swap = keep + swap, []
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=keep, names_which_can_be_offloaded=swap,
            offload_src="device", offload_dst="pinned_host")

    def install(self, model, runtime, patches):
        """Runs the model's loss computation under `jax.checkpoint(policy)`.

        The checkpoint must enclose both the producer and the backward
        reader of each tagged tensor; Keras's stateless loss function is the
        smallest that does (`internals.JAX_LOSS_FUNCTION`).
        """
        name = internals.JAX_LOSS_FUNCTION
        original = getattr(type(model), name).__get__(model)
        patches.set(model, name, functools.wraps(original)(
            functools.partial(self._checkpointed_loss, original, runtime)))

    def _checkpointed_loss(self, original, runtime, tv, ntv, mv, x, y, sw,
                           training=False, optimizer_variables=None):
        applied = runtime.plan_for_inputs(x) if training else None
        if applied is None or not applied.changes_anything:
            return original(tv, ntv, mv, x, y, sw, training=training,
                            optimizer_variables=optimizer_variables)
        self.stats["checkpointed_traces"] += 1

        def loss(tv, ntv, mv, x, y, sw, ov):
            return original(tv, ntv, mv, x, y, sw, training=True,
                            optimizer_variables=ov)

        return jax.checkpoint(loss, policy=self.checkpoint_policy(applied))(
            tv, ntv, mv, x, y, sw, optimizer_variables)


def _has_pinned_host():
    """Whether the default device has a pinned host memory space to offload to."""
    return "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}

