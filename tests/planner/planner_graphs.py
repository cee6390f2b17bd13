"""Small hand-built graphs for the planner tests."""

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
