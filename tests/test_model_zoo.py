"""Any Keras model: training with AutoVM gives the weights training without
it gives, or AutoVM keeps what it cannot manage and says why in one line.

The zoo (tests/zoo.py): batch norm and dropout, a shared layer, a nested
model, several inputs and outputs, LSTM and GRU, attention, a keras-hub style
backbone built from a config (token ids of any length), a subclassed model,
and mixed precision.
"""

import contextlib
import warnings

import keras
import numpy as np
import pytest

import keras_autovm
from conftest import BACKEND
from zoo import MIXED
from zoo import ZOO

POLICIES = ("sqrt_recompute", "offload_all")
GRAPH_MODELS = sorted(set(ZOO) - {"subclassed"})


@contextlib.contextmanager
def policy_of(name):
    previous = keras.config.dtype_policy()
    if name == "mixed_precision":
        keras.config.set_dtype_policy(MIXED)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def fit(name, callbacks=()):
    keras.utils.set_random_seed(7)
    with policy_of(name):
        model, x, y, loss = ZOO[name]()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False,
                  callbacks=list(callbacks), verbose=0)
    return model


def autovm(policy):
    return keras_autovm.AutoVM(budget="1GiB", policy=policy, verbose=0,
                               apply_without_gpu=True)


@pytest.fixture(scope="module")
def references():
    """Weights after training without AutoVM, once per model."""
    return {}


def assert_same_weights(a, b, name):
    # The tolerances of docs/limitations.md: recompute reruns kernels whose
    # order of summation may differ, in bfloat16 more coarsely.
    atol = 5e-4 if name == "mixed_precision" else 2e-6
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(wa, wb, rtol=2e-5, atol=atol)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", GRAPH_MODELS)
def test_trains_like_without_autovm(name, policy, references, swap_small_tensors):
    if name not in references:
        references[name] = fit(name)
    callback = autovm(policy)
    model = fit(name, [callback])
    plan = callback.report.plan
    action = "recompute" if policy == "sqrt_recompute" else "swap"
    assert plan.counts()[action] > 0, (name, plan.counts(), plan.notes)
    assert_same_weights(references[name], model, name)


def test_subclassed_model_trains_unchanged_with_one_line(references):
    reference = references.get("subclassed") or fit("subclassed")
    callback = autovm("sqrt_recompute")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fit("subclassed", [callback])
    lines = [str(w.message) for w in caught if "AutoVM" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "leaves the model unchanged" in lines[0] and "subclassed" in lines[0]
    assert callback.report is None
    for wa, wb in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(wa, wb)


# What each model has that AutoVM keeps, and the words of its one-line note.
KEPT = {
    "cnn_bn_dropout": ("drop", "random layer"),
    "shared_layer": ("shared@1", "shared layer called 2 times"),
    "nested": ("inner", "KiB of activations are kept"),
    "backbone": ("embeddings_dropout", "random layer"),
}


@pytest.mark.parametrize("name", sorted(KEPT))
def test_what_autovm_keeps_it_says_in_one_line(name):
    with policy_of(name):
        model, x, *_ = ZOO[name]()
    shape = np.shape(x)[1:] if name == "backbone" else None
    plan = keras_autovm.plan(model, 8, budget="1GiB", policy="sqrt_recompute",
                             input_shape=shape)
    tag, words = KEPT[name]
    assert plan.actions[tag] == "keep"
    notes = [n for n in plan.notes if n.split(" ")[0].rstrip(":") == tag]
    # One line for each layer call it keeps.
    assert len(notes) == 1 and "\n" not in notes[0], plan.notes
    # Each note a sentence: it names what it is about and ends with a stop.
    assert all(n.split(" ")[0].rstrip(":") in plan.actions or n.startswith("auto ")
               or n.split(" ")[0] in [op.name for op in plan.graph.ops]
               for n in plan.notes), plan.notes
    assert all(n.endswith(".") for n in plan.notes), plan.notes
    assert any(words in n for n in notes), plan.notes


def test_unknown_sequence_length_needs_an_input_shape():
    model, tokens, *_ = ZOO["backbone"]()
    with pytest.raises(ValueError, match=r"token_ids.*input_shape=\(128,\)") as info:
        keras_autovm.plan(model, 8, budget="1GiB")
    assert "224" not in str(info.value)  # No image hint for a text model.
    short = keras_autovm.plan(model, 8, budget="1GiB", input_shape=(10,))
    long = keras_autovm.plan(model, 8, budget="1GiB", input_shape=[(20,)])
    sizes = [{t.name: t.nbytes for t in p.graph.tensors} for p in (short, long)]
    assert sizes[1]["block0_ff1"] == 2 * sizes[0]["block0_ff1"]
    for bad in [(10, 16), (0,), ("10",), [(10,), (10,)]]:
        with pytest.raises(ValueError, match="input_shape"):
            keras_autovm.plan(model, 8, budget="1GiB", input_shape=bad)


def test_fit_plans_from_the_shapes_of_its_batches():
    keras.utils.set_random_seed(7)
    model, tokens, y, loss = ZOO["backbone"]()
    model.compile(optimizer="sgd", loss=loss)
    callback = autovm("sqrt_recompute")
    model.fit(tokens, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    expected = keras_autovm.plan(model, 8, budget="1GiB", policy="sqrt_recompute",
                                 input_shape=tokens.shape[1:])
    assert callback.report.plan.actions == expected.actions
    # Activations sized at the batches' length (optimizer state, counted
    # once it is built, may differ).
    sizes = [{t.name: t.nbytes for t in p.graph.tensors}
             for p in (callback.report.plan, expected)]
    assert sizes[0] == sizes[1]


def test_each_sequence_length_gets_its_own_plan():
    from keras_autovm import budget
    from keras_autovm import mechanisms
    from keras_autovm.planner import CostModel
    from keras_autovm.runtime import Runtime

    model, *_ = ZOO["backbone"]()
    plans = budget.PlanBook(model, 2**30, 0.15, "sqrt_recompute", CostModel(),
                            mechanisms.get())
    runtime = Runtime(mechanisms.get(), plans, {})
    assert runtime.plan_for(8) is None  # No shape seen yet: nothing to plan.
    short = runtime.plan_for_inputs(np.zeros((8, 10), "int32")).plan
    long = runtime.plan_for_inputs(np.zeros((8, 20), "int32")).plan
    nbytes = [p.graph.tensor_map["block0_ff1"].nbytes for p in (short, long)]
    assert nbytes[1] == 2 * nbytes[0]
    assert runtime.plan_for_inputs(np.zeros((8, 10), "int32")).plan is short


def test_a_plan_predicted_again_stays_under_its_own_sequence_length():
    # A failed replan at an epoch's end predicts the plan in force again
    # (`AutoVM._keep`): the plans of other lengths stay as they are.
    import dataclasses

    from keras_autovm import budget
    from keras_autovm import mechanisms
    from keras_autovm.planner import CostModel
    from keras_autovm.runtime import Runtime

    model, *_ = ZOO["backbone"]()
    plans = budget.PlanBook(model, 2**30, 0.15, "sqrt_recompute", CostModel(),
                            mechanisms.get())
    runtime = Runtime(mechanisms.get(), plans, {})
    short = runtime.plan_for_inputs(np.zeros((8, 10), "int32"))
    long = runtime.plan_for_inputs(np.zeros((8, 20), "int32"))
    runtime.proven.add(short)
    runtime.fitted_plans[8] = short.plan
    again = dataclasses.replace(short.plan, result=dataclasses.replace(
        short.plan.result, step_time=2 * short.plan.result.step_time))
    runtime.repredict(short.plan, again)
    assert runtime.plan_for_inputs(np.zeros((8, 10), "int32")) is short
    assert short.plan is again and short in runtime.proven
    long_again = runtime.plan_for_inputs(np.zeros((8, 20), "int32"))
    assert long_again is long and long.plan is not again
    assert runtime.fitted_plans[8] is again


def test_layers_of_a_model_with_unknown_dimensions_are_not_timed():
    keras.utils.set_random_seed(7)
    model, tokens, y, loss = ZOO["backbone"]()
    model.compile(optimizer="sgd", loss=loss)
    callback = keras_autovm.AutoVM(budget="1GiB", policy="sqrt_recompute", verbose=0,
                                   apply_without_gpu=True, profile="auto")
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        model.fit(tokens, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    assert sum("unknown dimensions" in str(w.message) for w in caught) == 1
    assert callback.measured is None
    assert callback.report.plan.cost_source().startswith("compute roofline")


def padded_batches():
    """Token ids padded to each batch's own length (6, then 9), as text
    pipelines batch them: TensorFlow traces one step with the length unknown."""
    import tensorflow as tf

    def samples():
        rng = np.random.default_rng(0)
        for n in (6, 6, 6, 6, 9, 9, 9, 9):
            yield (rng.integers(0, 50, n).astype("int32"),
                   rng.normal(size=(n, 16)).astype("float32"))

    spec = (tf.TensorSpec((None,), tf.int32), tf.TensorSpec((None, 16), tf.float32))
    return tf.data.Dataset.from_generator(samples, output_signature=spec).padded_batch(4)


def test_batches_of_their_own_length_train_like_keras_own():
    def fit_padded(callbacks):
        keras.utils.set_random_seed(7)
        model, *_ = ZOO["backbone"]()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(padded_batches(), epochs=1, callbacks=callbacks, verbose=0)
        return model, [str(w.message) for w in caught if "leaves this" in str(w.message)]

    reference, _ = fit_padded([])
    callback = autovm("sqrt_recompute")
    model, lines = fit_padded([callback])
    if BACKEND == "tensorflow":  # One traced step, its length unknown.
        assert len(lines) == 1 and "\n" not in lines[0], lines
        assert "keeping every activation" in lines[0] and "(None,)" in lines[0]
        assert callback.report is None
    else:  # Each batch arrives with its length: one plan per length.
        assert not lines
        assert callback.report.plan.counts()["recompute"] > 0
    assert_same_weights(reference, model, "backbone")
