"""Does XLA honour recomputation of whole residual blocks? Pure JAX, no Keras.

A stack of ResNet bottleneck blocks (conv, normalise, ReLU; three convs
and an add per block) is trained one step four ways, and XLA's memory
analysis of each compiled step is set beside the working set the planner's
model would give (the saved tensors plus one run's recomputation):

- `keep_all`: no checkpoint;
- `outer_names`: one `jax.checkpoint` around the loss, saving only the
  block outputs at the end of every run of `--run` blocks by name (what
  AutoVM's JAX mechanism does with a plan: keep = save, recompute = not saved);
- `nested`: each run of blocks under its own `jax.checkpoint` (saving
  nothing inside), no outer checkpoint;
- `nested_in_outer`: both, the outer one saving the run ends by name.

Run where JAX sees a GPU:

    python3 recipes/gpu_jax_nested_remat.py --batch 96 --blocks 36 --run 4 --out r.json

Each variant also runs three steps; the device's peak bytes in use are read
after each variant's steps (XLA's running peak, so only an increase shows).
"""

import argparse
import functools
import json
import platform
import time

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

VARIANTS = ("keep_all", "outer_names", "nested", "nested_in_outer")


def _conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _norm(x):
    mean = x.mean(axis=(0, 1, 2))
    var = x.var(axis=(0, 1, 2))
    return (x - mean) * jax.lax.rsqrt(var + 1e-3)


def block(params, x):
    w1, w2, w3 = params
    h = jax.nn.relu(_norm(_conv(x, w1)))
    h = jax.nn.relu(_norm(_conv(h, w2)))
    h = _norm(_conv(h, w3))
    return jax.nn.relu(h + x)


def init(blocks, wide, narrow, key):
    params = []
    for _ in range(blocks):
        keys = jax.random.split(key, 4)
        key = keys[0]
        params.append((jax.random.normal(keys[1], (1, 1, wide, narrow)) * 0.05,
                       jax.random.normal(keys[2], (3, 3, narrow, narrow)) * 0.05,
                       jax.random.normal(keys[3], (1, 1, narrow, wide)) * 0.05))
    return params


def forward(params, x, run, variant):
    runs = [params[i:i + run] for i in range(0, len(params), run)]

    def one_run(ps, h):
        for p in ps:
            h = block(p, h)
        return h

    for i, ps in enumerate(runs):
        f = one_run
        if variant in ("nested", "nested_in_outer"):
            f = jax.checkpoint(one_run, policy=jax.checkpoint_policies.nothing_saveable)
        x = f(ps, x)
        x = checkpoint_name(x, f"end{i}")
    return x


def loss_fn(variant, run, params, x):
    def loss(params, x):
        return jnp.mean(forward(params, x, run, variant) ** 2)
    if variant in ("outer_names", "nested_in_outer"):
        names = [f"end{i}" for i in range(len(params) // run + 1)]
        loss = jax.checkpoint(loss, policy=jax.checkpoint_policies.save_only_these_names(*names))
    return loss(params, x)


def step(variant, run, params, x):
    grads = jax.grad(functools.partial(loss_fn, variant, run))(params, x)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)


def predicted(batch, hw, wide, narrow, blocks, run):
    """The planner's kind of figure: saved run ends, one run recomputed."""
    f32 = 4
    big = batch * hw * hw * wide * f32
    small = batch * hw * hw * narrow * f32
    per_block = 2 * big + 4 * small  # conv3 out and the add, two convs' outs and relus
    return {"keep_all_bytes": blocks * per_block + big,
            "runs_bytes": (blocks // run + 1) * big + run * per_block}


def measure(variant, args, params, x):
    fn = jax.jit(functools.partial(step, variant, args.run), donate_argnums=0)
    start = time.perf_counter()
    compiled = fn.lower(params, x).compile()
    compile_s = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    row = {"variant": variant, "compile_s": round(compile_s, 2),
           "temp_bytes": analysis.temp_size_in_bytes,
           "argument_bytes": analysis.argument_size_in_bytes,
           "output_bytes": analysis.output_size_in_bytes}
    times = []
    for _ in range(3):
        start = time.perf_counter()
        params = compiled(params, x)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - start)
    row["step_s"] = round(sorted(times)[1], 4)
    stats = jax.devices()[0].memory_stats() or {}
    row["peak_bytes_in_use_after"] = stats.get("peak_bytes_in_use")
    return row, params


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=96)
    parser.add_argument("--hw", type=int, default=28)
    parser.add_argument("--wide", type=int, default=512)
    parser.add_argument("--narrow", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=36)
    parser.add_argument("--run", type=int, default=4)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    key = jax.random.PRNGKey(0)
    params = init(args.blocks, args.wide, args.narrow, key)
    x = jax.random.normal(key, (args.batch, args.hw, args.hw, args.wide))
    result = {"command": "python3 recipes/gpu_jax_nested_remat.py " + " ".join(
                  f"--{k} {v}" for k, v in vars(args).items() if k != "out"),
              "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
              "predicted": predicted(args.batch, args.hw, args.wide, args.narrow,
                                     args.blocks, args.run),
              "variants": []}
    for variant in args.variants.split(","):
        row, params = measure(variant, args, params, x)
        print(json.dumps(row), flush=True)
        result["variants"].append(row)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
