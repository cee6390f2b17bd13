"""Shared by the planner recipes (planner_bench, planner_min_fraction,
uvm_sim): reading a Keras Application's planner graph, writing JSON."""

import json
import os


def application_graph(name, batch):
    """(planner graph, mechanism) of `keras.applications.<name>` at `batch`,
    read with the active backend as `keras_autovm.plan()` reads it."""
    import keras

    from keras_autovm import budget as budget_lib
    from keras_autovm import mechanisms

    mechanism = mechanisms.get()
    # NASNetMobile takes no default input shape without weights.
    kwargs = {"input_shape": (224, 224, 3)} if name.startswith("NASNet") else {}
    model = getattr(keras.applications, name)(weights=None, **kwargs)
    return budget_lib.graph_for(model, batch, mechanism), mechanism


def write_json(path, data):
    """Writes `data` to `path` (folders made as needed) if `path` is set."""
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print("wrote", path)
