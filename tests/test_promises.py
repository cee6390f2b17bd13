"""What AutoVM states before training holds during it."""

import keras
import pytest

import keras_autovm
from conftest import data, small_cnn


def _compiled(optimizer):
    keras.utils.set_random_seed(3)
    model = small_cnn()
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _fit(model, budget):
    callback = keras_autovm.AutoVM(budget=budget, apply_without_gpu=True, verbose=0)
    x, y = data(16)
    model.fit(x, y, batch_size=8, epochs=1, callbacks=[callback], verbose=0)
    return callback


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "rmsprop"])
def test_fit_accepts_the_smallest_budget_plan_states(optimizer):
    # The optimizer is built inside `fit`: its state must count the same
    # before training (plan()) as during it (the callback's plans).
    model = _compiled(optimizer)
    with pytest.raises(keras_autovm.PlanError) as info:
        keras_autovm.plan(model, batch_size=8, budget=1)
    least = info.value.min_budget
    assert keras_autovm.plan(model, batch_size=8, budget=least).fits
    callback = _fit(model, least)
    assert callback.report.plan.fits
    # And fit's own refusal states the same figure.
    with pytest.raises(keras_autovm.PlanError) as refused:
        _fit(_compiled(optimizer), least - 64)
    assert refused.value.min_budget == least
