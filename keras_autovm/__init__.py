"""keras-autovm: train Keras models whose activations do not fit on the GPU.

    model.fit(x, y, callbacks=[keras_autovm.AutoVM(budget="16GiB")])

See docs/ for the guide and the API, and docs/architecture.md for where each
concern lives.
"""

from keras_autovm import applications
from keras_autovm.callback import AutoVM
from keras_autovm.dry_run import plan
from keras_autovm.mechanisms.tensorflow.managed import enable_managed_memory
from keras_autovm.planner import Plan
from keras_autovm.planner import PlanError
from keras_autovm.profiling import Profile
from keras_autovm.wrapper import AutoVMWrapper

__version__ = "0.1.0"
__all__ = ["AutoVM", "applications", "AutoVMWrapper", "Plan", "PlanError",
           "Profile", "enable_managed_memory", "plan"]
