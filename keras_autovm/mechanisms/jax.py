"""JAX: tags become `checkpoint_name`s; one `jax.checkpoint` around the loss
applies the plan (keep = save, swap = offload to pinned host, recompute =
neither), and XLA schedules the copies on its own streams."""

import functools

import jax
from jax.ad_checkpoint import checkpoint_name

# Recompute is the checkpoint policy's: XLA replays what is not saved.
REPLAYS_SEGMENTS = False
# Whether each layer runs under `recompute` while a plan is applied.
REMAT_LAYERS = True
SWAPS_BY_OPS = False
_ACTIONS = ("keep", "swap", "recompute")


def actions():
    return _ACTIONS


def auto_actions():
    """What `policy="auto"` may choose: no swaps yet.

    XLA carries out the offloads (weights stay identical) but, measured on
    VGG-19 (results/gpu_vgg19_memory.json), its buffer assignment keeps the
    device footprint far above the plan (offload_all: 17.57 GiB on device for
    a planned 8.3 GiB), so a swap plan would not fit where it says it does.
    """
    return ("keep", "recompute")


def prepare(model):
    return None


def moved_bytes():
    return None


def gpu_available():
    return any(d.platform == "gpu" for d in jax.devices())


def _gpu():
    return next(d for d in jax.devices() if d.platform == "gpu")


def device_memory():
    """The bytes XLA's allocator may use (respects XLA_PYTHON_CLIENT_MEM_FRACTION)."""
    if not gpu_available():
        return None
    return (_gpu().memory_stats() or {}).get("bytes_limit")


def peak_memory():
    if not gpu_available():
        return None
    return (_gpu().memory_stats() or {}).get("peak_bytes_in_use")


def reset_peak():
    # XLA's client offers no reset; the callback reports the running peak.
    return False


def tag(x, name):
    return checkpoint_name(x, name)


def recompute(fn):
    return jax.checkpoint(fn)


def offload_supported():
    """Whether the default device has a pinned host memory space to offload to."""
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    return "pinned_host" in kinds


def policy(applied):
    """The `jax.checkpoint` policy carrying out a plan's actions."""
    keep, swap = applied.names("keep"), applied.names("swap")
    if swap and not offload_supported():
        keep, swap = keep + swap, []
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=keep,
        names_which_can_be_offloaded=swap,
        offload_src="device",
        offload_dst="pinned_host",
    )


def install(model, runtime):
    """Wraps the model's loss computation in `jax.checkpoint(policy)`.

    The checkpoint must enclose both the producer and the backward reader of
    each tagged tensor, and Keras's `compute_loss_and_updates` is the
    smallest stateless function that does (state goes in and out as values,
    so nothing leaks out of the checkpoint's trace).
    """
    original = type(model).compute_loss_and_updates.__get__(model)

    @functools.wraps(original)
    def compute_loss_and_updates(tv, ntv, mv, x, y, sw, training=False,
                                 optimizer_variables=None):
        plan_policy = runtime.jax_policy(batch=x) if training else None
        if plan_policy is None:
            return original(tv, ntv, mv, x, y, sw, training=training,
                            optimizer_variables=optimizer_variables)

        def loss(tv, ntv, mv, x, y, sw, ov):
            return original(tv, ntv, mv, x, y, sw, training=True,
                            optimizer_variables=ov)

        return jax.checkpoint(loss, policy=plan_policy)(
            tv, ntv, mv, x, y, sw, optimizer_variables)

    model.compute_loss_and_updates = compute_loss_and_updates


def uninstall(model):
    model.__dict__.pop("compute_loss_and_updates", None)
