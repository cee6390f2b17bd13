"""Python's collector is kept off what outlives the steps of an eager fit."""

import gc
import weakref

import keras

import keras_autovm
from keras_autovm import collector
from conftest import BACKEND, data, small_cnn


class Cycle:
    def __init__(self):
        self.me = self


def test_frozen_collects_first_then_freezes_until_exit():
    dropped = Cycle()
    gone = weakref.ref(dropped)
    del dropped
    kept = Cycle()
    with collector.frozen() as refreeze:
        # Garbage is collected, not frozen; what is alive is frozen.
        assert gone() is None
        frozen = gc.get_freeze_count()
        assert frozen > 0
        later = weakref.ref(Cycle())  # Garbage made inside is collected.
        refreeze()
        assert later() is None and gc.get_freeze_count() >= frozen
    assert gc.get_freeze_count() == 0
    assert kept.me is kept


def test_a_program_that_froze_objects_itself_keeps_its_choice():
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        with collector.frozen() as refreeze:
            refreeze()
            assert gc.get_freeze_count() == before
        assert gc.get_freeze_count() == before
    finally:
        gc.unfreeze()


class FreezeCounts(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.counts = []

    def on_train_batch_begin(self, batch, logs=None):
        self.counts.append(gc.get_freeze_count())


def test_an_eager_fit_runs_its_steps_frozen_and_thaws_after():
    model = small_cnn()
    model.compile(optimizer="sgd", loss="mse")
    counts = FreezeCounts()
    model.fit(*data(16), batch_size=8, epochs=2, verbose=0, callbacks=[
        keras_autovm.AutoVM(budget="1GiB", verbose=0, apply_without_gpu=True), counts])
    # Only torch runs Python for each layer every step; TensorFlow and JAX
    # trace the step once.
    assert len(counts.counts) == 4
    assert all((c > 0) == (BACKEND == "torch") for c in counts.counts)
    assert gc.get_freeze_count() == 0
