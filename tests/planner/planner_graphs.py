"""Small hand-built graphs for the planner tests."""

import time

from keras_autovm.planner import Graph
from keras_autovm.planner import OpSpec
from keras_autovm.planner import TensorSpec


def op(name, fwd=1.0, bwd=2.0, **kwargs):
    return OpSpec(name, fwd_time=fwd, bwd_time=bwd, **kwargs)


def tensor(name, nbytes, producer, fwd=(), bwd=(), **kwargs):
    return TensorSpec(name, nbytes, producer, tuple(fwd), tuple(bwd), **kwargs)


def chain(sizes, persistent=0, fwd_times=None):
    """o0 -> t0 -> o1 -> t1 ... ; each op's backward reads its input.

    The last tensor is the model output: no readers.
    """
    n = len(sizes)
    fwd_times = fwd_times or [1.0] * n
    ops = tuple(op(f"o{i}", fwd_times[i]) for i in range(n))
    tensors = tuple(
        tensor(f"t{i}", sizes[i], f"o{i}",
               (f"o{i + 1}",) if i + 1 < n else (),
               (f"o{i + 1}",) if i + 1 < n else ())
        for i in range(n)
    )
    return Graph(ops, tensors, persistent_bytes=persistent)


def conv_chain(n, base=2**20):
    """A CNN-like chain with roofline times: early tensors are biggest."""
    ops, tensors = [], []
    for i in range(n):
        nbytes = base * (4 if i < n // 4 else 2 if i < n // 2 else 1)
        ops.append(OpSpec(f"conv{i}", (f"a{i - 1}",) if i else (), (f"a{i}",),
                          flops=2e9, mem_bytes=3 * nbytes))
        readers = (f"conv{i + 1}",) if i + 1 < n else ()
        tensors.append(
            TensorSpec(f"a{i}", nbytes, f"conv{i}", readers, readers)
        )
    return Graph(tuple(ops), tuple(tensors), persistent_bytes=8 * base)


def memory_at(result, time):
    """Bytes in use just after the last timeline point at or before `time`."""
    used = result.timeline[0][1]
    for t, b in result.timeline:
        if t > time:
            break
        used = b
    return used


class _Builder:
    """Ops added in forward order, each making one tensor of its name."""

    def __init__(self, unary=False):
        self.ops, self.tensors, self.readers, self.unary = [], {}, {}, unary

    def add(self, name, inputs, nbytes, flops, bwd_reads_input=True):
        extra = {"unary": len(inputs) == 1} if self.unary else {}
        self.ops.append(OpSpec(name, tuple(inputs), (name,), flops=flops,
                               mem_bytes=3 * nbytes, **extra))
        self.tensors[name] = nbytes
        for x in inputs:
            fwd, bwd = self.readers.setdefault(x, ([], []))
            fwd.append(name)
            if bwd_reads_input:
                bwd.append(name)

    def graph(self, base, output):
        specs = tuple(
            TensorSpec(name, nbytes, name, tuple(self.readers.get(name, ([], []))[0]),
                       tuple(self.readers.get(name, ([], []))[1]))
            for name, nbytes in self.tensors.items())
        return Graph(tuple(self.ops), specs, persistent_bytes=4 * base, outputs=(output,))


def branched(cells=6, branches=3, depth=4, base=2**20):
    """Multi-branch cells, as Inception or NASNet build them.

    Each cell reads the previous cell's output with `branches` chains of
    `depth` conv-like ops (backward reads the input), run interleaved in
    forward order (branch 0's op 1, branch 1's op 1, ...), and concatenates
    the branch ends (backward reads nothing). Returns a `Graph` whose
    model output is the last concatenation.
    """
    g = _Builder()
    g.add("stem", (), 4 * base, 1e9)
    prev = "stem"
    for c in range(cells):
        for d in range(depth):
            for b in range(branches):
                src = prev if d == 0 else f"c{c}b{b}d{d - 1}"
                g.add(f"c{c}b{b}d{d}", (src,), 2 * base, 2e9)
        ends = [f"c{c}b{b}d{depth - 1}" for b in range(branches)]
        g.add(f"cat{c}", ends, 2 * base * branches, 0.0, bwd_reads_input=False)
        prev = f"cat{c}"
    return g.graph(base, prev)


def residual(blocks=12, depth=3, base=2**20, scales=None):
    """Residual blocks, as a ResNet builds them.

    Block k reads the previous block's output `out{k-1}` with a chain of
    `depth` conv-like ops (backward reads the input; the last is 4x wider),
    adds the chain's end to that output (`add{k}`, backward reads nothing)
    and applies a ReLU-like `out{k}` (backward reads its input). A chain
    breaks at every add, so chains alone keep two tensors per block.
    `scales[k]`, if given, multiplies block k's sizes (a ResNet's stages
    shrink as they go).
    """
    g = _Builder(unary=True)
    scales = scales or [1] * blocks
    g.add("out-1", (), 4 * base * scales[0], 1e9)
    for k in range(blocks):
        src, size = f"out{k - 1}", base * scales[k]
        for d in range(depth):
            wide = d == depth - 1
            g.add(f"b{k}c{d}", (src,), (4 if wide else 1) * size, 2e9)
            src = f"b{k}c{d}"
        g.add(f"add{k}", (f"out{k - 1}", src), 4 * size, 0.0, bwd_reads_input=False)
        g.add(f"out{k}", (f"add{k}",), 4 * size, 0.0)
    return g.graph(base, f"out{blocks - 1}")


def best_time(fn, repeats=3):
    """(least seconds of `repeats` calls of `fn`, its last result)."""
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        rounds.append(time.perf_counter() - start)
    return min(rounds), result
