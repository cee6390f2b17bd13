"""torch: recompute through non-reentrant `torch.utils.checkpoint` over plan
segments. Swapping (saved-tensor hooks with pinned buffers) is not built yet,
so a plan with swaps is refused here."""

import torch
import torch.utils.checkpoint

# Recompute replays whole plan segments under `recompute`.
REPLAYS_SEGMENTS = True
# Whether each layer runs under `recompute` while a plan is applied.
REMAT_LAYERS = False
SWAPS_BY_OPS = False
_ACTIONS = ("keep", "recompute")


def actions():
    return _ACTIONS


def auto_actions():
    return actions()


def prepare(model):
    return None


def moved_bytes():
    return None


def gpu_available():
    return torch.cuda.is_available()


def device_memory():
    """The GPU's memory times the per-process fraction, if one is set."""
    if not gpu_available():
        return None
    total = torch.cuda.get_device_properties(0).total_memory
    return int(total * torch.cuda.get_per_process_memory_fraction(0))


def peak_memory():
    return torch.cuda.max_memory_allocated() if gpu_available() else None


def reset_peak():
    if not gpu_available():
        return False
    torch.cuda.reset_peak_memory_stats()
    return True


def tag(x, name):
    return x


def recompute(fn):
    def wrapped(*args):
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    return wrapped


def install(model, runtime):
    pass


def uninstall(model):
    pass
