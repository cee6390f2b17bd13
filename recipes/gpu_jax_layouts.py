"""What a per-layer XLA program needs beyond its inputs and outputs, and
whether letting XLA choose the layouts at its boundary changes that.

    python3 recipes/gpu_jax_layouts.py --out results/jax/layouts/probe.json
    python3 recipes/gpu_jax_layouts.py --smoke --out /tmp/probe.json   # CPU

AutoVM's JAX swap runs each layer as two compiled programs (forward, and
backward with the forward recomputed). Under them VGG-19's kept layers used
1.4x their plan and `block1_conv1`'s backward needed 3 GiB of scratch at
batch 128 (docs/results.md). Each program receives and returns arrays in
the default (row-major, channels-last) layout; a GPU convolution may want
another, so a program may transpose at both ends. For a few layers of
VGG-19 this compiles each program twice, with the default layouts and with
`Layout.AUTO` for the activations at its boundary (the weights go in in
the default layout; the kernel gradient's comes back as XLA picks), and
records per program: XLA's memory analysis (temp, arguments, outputs), the
layouts XLA chose, the transposes and layout copies and the cuDNN
workspaces in the optimized HLO, and the median time of 10 runs. Then, on
AUTO layouts: the layout each probed layer's forward takes and gives
(`auto_chain`), and whether `block1_conv1`'s output in its layout goes to
pinned host memory and back unchanged.
"""

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

LAYERS = ("block1_conv1", "block1_conv2", "block1_pool", "block2_conv1",
          "block3_conv1", "block5_conv4", "fc1")


def programs(layer, auto):
    """`(forward, backward)` jitted on `(x, weights)` and `(x, weights, dy)`."""
    import jax
    import keras
    from jax.experimental.layout import Format, Layout

    variables = list(layer.trainable_variables)

    def forward(x, ws):
        with keras.StatelessScope(state_mapping=list(zip(variables, ws))):
            return layer(x)

    def backward(x, ws, dy):
        _, vjp = jax.vjp(forward, x, ws)
        return vjp(dy)

    if not auto:
        return jax.jit(forward), jax.jit(backward)
    free = Format(Layout.AUTO)
    return (jax.jit(forward, in_shardings=(free, None), out_shardings=free),
            jax.jit(backward, in_shardings=(free, None, free), out_shardings=(free, None)))


def types(args):
    """Abstract stand-ins: a jit with AUTO layouts lowers on types only."""
    import jax
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)


def hlo_facts(text):
    """Transposes and copies (layout changes) in optimized HLO `text`, and
    the workspaces its cuDNN calls return (their `u8[...]` outputs)."""
    return {"transposes": len(re.findall(r"= \S+ transpose\(", text)),
            "copies": len(re.findall(r"= \S+ copy\(", text)),
            "mentions_of_transpose": text.count("transpose"),
            "cudnn_workspace_bytes": [int(n) for n in re.findall(r"u8\[(\d+)\]", text)]}


def formats(compiled):
    def one(f):
        layout = getattr(f, "layout", None)
        return list(getattr(layout, "major_to_minor", ()) or ())
    import jax
    ins = jax.tree_util.tree_leaves(compiled.input_formats, is_leaf=lambda f: hasattr(f, "layout"))
    outs = jax.tree_util.tree_leaves(compiled.output_formats, is_leaf=lambda f: hasattr(f, "layout"))
    return [one(f) for f in ins], [one(f) for f in outs]


def timed(run, args, repeats):
    import jax
    jax.block_until_ready(run(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def relaid(args, compiled):
    """`args` put in the layouts `compiled` takes (a copy where they differ)."""
    import jax
    fmts = compiled.input_formats[0]
    return jax.tree_util.tree_map(lambda x, f: jax.device_put(x, f), args, tuple(fmts),
                                  is_leaf=lambda x: hasattr(x, "shape"))


def probe_layer(layer, x, auto, repeats):
    import jax
    ws = [v.value for v in layer.trainable_variables]
    fwd, bwd = programs(layer, auto)
    row = {"layer": layer.name, "auto": auto}
    cf = fwd.lower(*types((x, ws))).compile()
    y = cf(*relaid((x, ws), cf)) if auto else cf(x, ws)
    dy = jax.numpy.ones_like(y) if not auto else jax.device_put(
        jax.numpy.ones(y.shape, y.dtype), y.format)
    cb = bwd.lower(*types((x, ws, dy))).compile()
    for name, compiled, args in (("forward", cf, (x, ws)), ("backward", cb, (x, ws, dy))):
        analysis = compiled.memory_analysis()
        args = relaid(args, compiled) if auto else args
        row[name] = {
            "temp_bytes": getattr(analysis, "temp_size_in_bytes", None),
            "argument_bytes": getattr(analysis, "argument_size_in_bytes", None),
            "output_bytes": getattr(analysis, "output_size_in_bytes", None),
            "formats": formats(compiled),
            "seconds": timed(compiled, args, repeats),
            **hlo_facts(compiled.as_text()),
        }
        if layer.name == "block1_conv1":  # the largest scratch: kept to read
            row[name]["hlo"] = compiled.as_text()[:30000]
    return row, y


def host_round_trip(y):
    """Whether `y` (in a layout XLA chose) goes to pinned host and back."""
    import jax
    import numpy as np
    device = next(iter(y.devices()))
    try:
        host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        on_host = jax.device_put(y, host)
        back = jax.device_put(on_host, y.format)
        jax.block_until_ready(back)
        return {"ok": True, "host_format": str(on_host.format), "back_format": str(back.format),
                "equal": bool(np.array_equal(np.asarray(back), np.asarray(y)))}
    except Exception as error:  # noqa: BLE001 -- recorded: it is what the probe asks
        return {"ok": False, "error": f"{type(error).__name__}: {error}"[:400]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import jax
    import keras
    size = 32 if args.smoke else 224
    model = keras.applications.VGG19(weights=None, input_shape=(size, size, 3),
                                     include_top=not args.smoke)
    names = [n for n in LAYERS if n in {l.name for l in model.layers}]
    result = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "keras": keras.__version__, "python": platform.python_version(),
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "batch": args.batch, "rows": []}
    x = jax.numpy.ones((args.batch, size, size, 3), "float32")
    for layer in model.layers[1:]:
        if layer.name in names:
            for auto in (False, True):
                try:
                    row, y = probe_layer(layer, x, auto, args.repeats)
                except Exception as error:  # noqa: BLE001 -- recorded
                    row, y = {"layer": layer.name, "auto": auto,
                              "error": f"{type(error).__name__}: {error}"[:600]}, None
                if auto and y is not None and layer.name == "block1_conv1":
                    result["host_round_trip"] = host_round_trip(y)
                result["rows"].append(row)
                print(json.dumps(row)[:300], flush=True)
        x = layer(x)  # The next layer's input.
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    chain = {}
    for row in result["rows"]:
        if row.get("auto") and "forward" in row:
            chain[row["layer"]] = {"takes": row["forward"]["formats"][0][:1],
                                   "gives": row["forward"]["formats"][1][:1]}
    result["auto_chain"] = chain
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for row in result["rows"]:
        if "forward" in row:
            print(f"{row['layer']:14s} auto={row['auto']!s:5s} "
                  + " ".join(f"{p}: temp {row[p]['temp_bytes'] / 2**20:8.1f} MiB "
                             f"{row[p]['seconds'] * 1e3:7.2f} ms T{row[p]['transposes']} "
                             f"C{row[p]['copies']}" for p in ("forward", "backward")))


if __name__ == "__main__":
    main()
