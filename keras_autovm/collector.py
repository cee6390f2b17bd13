"""Python's cyclic garbage collector, kept off what outlives a training step.

An eager step (torch) runs Python for every layer call, and AutoVM's hooks
make objects for every saved tensor, so the collector runs often during a
step; each of its full collections walks every object the process tracks:
the model, the data, AutoVM's graph and plans. On a CPU, in a ResNet-like
model of 554 layers, one full collection took about 0.35 s and came once
or twice in 25 steps of 0.4 s (`recipes/cpu_step_python.py`). Objects alive when an epoch
starts are moved out of the collector's sight (`gc.freeze`) for the fit,
after a collection, so garbage never sits frozen: what a later step drops
is collected as before.
"""

import contextlib
import gc


@contextlib.contextmanager
def frozen():
    """Freezes what is alive now until exit; yields `refreeze`, to call as
    each later epoch starts. A program that froze objects itself keeps its
    choice: nothing is frozen or thawed then."""
    if gc.get_freeze_count():
        yield lambda: None
        return
    refreeze()
    try:
        yield refreeze
    finally:
        gc.unfreeze()


def refreeze():
    """Collects what is unreachable (the frozen are not walked), then
    freezes what is left."""
    gc.collect()
    gc.freeze()
