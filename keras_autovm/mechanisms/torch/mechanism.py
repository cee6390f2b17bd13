"""torch: recompute through `keras.remat` (non-reentrant
`torch.utils.checkpoint`) over plan segments. Swapping (saved-tensor hooks
with pinned buffers) is not built yet, so a plan with swaps is refused."""

import torch

from keras_autovm.mechanisms.base import Mechanism


class TorchMechanism(Mechanism):
    """Keep and recompute."""

    backend = "torch"

    def gpu_available(self):
        return torch.cuda.is_available()

    def device_memory(self):
        """The GPU's memory times the per-process fraction, if one is set."""
        if not self.gpu_available():
            return None
        total = torch.cuda.get_device_properties(0).total_memory
        return int(total * torch.cuda.get_per_process_memory_fraction(0))

    def peak_memory(self):
        return torch.cuda.max_memory_allocated() if self.gpu_available() else None

    def reset_peak(self):
        if not self.gpu_available():
            return False
        torch.cuda.reset_peak_memory_stats()
        return True
