"""keras-autovm: train Keras models whose activations do not fit on the GPU.

    model.fit(x, y, callbacks=[keras_autovm.AutoVM(budget="16GiB")])

See docs/ for the guide and the API.
"""

from keras_autovm.callback import AutoVM
from keras_autovm.managed import enable_managed_memory
from keras_autovm.planner import Plan, PlanError
from keras_autovm.planning import plan
from keras_autovm.wrapper import AutoVMWrapper

__version__ = "0.1.0"
__all__ = ["AutoVM", "AutoVMWrapper", "Plan", "PlanError",
           "enable_managed_memory", "plan"]
