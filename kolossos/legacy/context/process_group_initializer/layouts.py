"""The rank lists of every legacy process group, as Colossal-AI's initializers lay them out.

Pure functions of the sizes: each returns *all* groups of one kind, in the order every rank
creates them. Ranks are numbered with tensor innermost, then pipeline, then data
(``rank = data_index * pipeline * tensor + stage * tensor + tensor_rank``), except that the data
groups stride over the whole world as upstream's do.
"""

from __future__ import annotations

import math

__all__ = [
    "data_groups",
    "groups_2d",
    "groups_2p5d",
    "groups_3d",
    "model_groups",
    "pipeline_groups",
    "sequence_dp_groups",
    "tensor_groups",
]

Groups = list[list[int]]


def data_groups(world_size: int, data_size: int) -> Groups:
    """Ranks holding the same model shard: ``i, i + n, i + 2n, ...`` with ``n = world / data``."""
    count = world_size // data_size
    return [[i + j * count for j in range(data_size)] for i in range(count)]


def model_groups(world_size: int, model_size: int) -> Groups:
    """Blocks of ``pipeline * tensor`` consecutive ranks (one model replica each)."""
    return [
        list(range(i * model_size, (i + 1) * model_size)) for i in range(world_size // model_size)
    ]


def pipeline_groups(world_size: int, data_size: int, pipeline_size: int) -> Groups:
    """Inside each model replica, the ranks one stage apart."""
    replica = world_size // data_size
    stride = replica // pipeline_size
    return [
        list(range(i * replica + j, (i + 1) * replica, stride))
        for i in range(data_size)
        for j in range(stride)
    ]


def tensor_groups(world_size: int, tensor_size: int) -> Groups:
    """Blocks of ``tensor_size`` consecutive ranks (also the 1D and sequence groups)."""
    return [
        list(range(i * tensor_size, (i + 1) * tensor_size))
        for i in range(world_size // tensor_size)
    ]


def sequence_dp_groups(world_size: int, pipeline_size: int) -> Groups:
    """Sequence parallelism's gradient all-reduce groups: every rank of one pipeline block."""
    size = world_size // pipeline_size
    return [list(range(i * size, (i + 1) * size)) for i in range(pipeline_size)]


def groups_2d(world_size: int, tensor_size: int) -> tuple[Groups, Groups]:
    """``(rows, cols)`` of the ``q x q`` SUMMA grid in each tensor block (row-major)."""
    q = math.isqrt(tensor_size)
    blocks = range(world_size // tensor_size)
    rows = [[h * tensor_size + j * q + k for k in range(q)] for h in blocks for j in range(q)]
    cols = [[h * tensor_size + j + k * q for k in range(q)] for h in blocks for j in range(q)]
    return rows, cols


def groups_2p5d(
    world_size: int, tensor_size: int, depth: int
) -> tuple[Groups, Groups, Groups, Groups]:
    """``(cols, rows, deps, xz)`` of the ``q x q x depth`` tesseract in each tensor block."""
    q = math.isqrt(tensor_size // depth)
    blocks = range(world_size // tensor_size)

    def at(h: int, i: int, j: int, k: int) -> int:
        return h * tensor_size + i + q * (j + q * k)

    cols = [
        [at(h, i, j, k) for j in range(q)] for h in blocks for i in range(q) for k in range(depth)
    ]
    rows = [
        [at(h, i, j, k) for i in range(q)] for h in blocks for j in range(q) for k in range(depth)
    ]
    deps = [
        [at(h, i, j, k) for k in range(depth)] for h in blocks for i in range(q) for j in range(q)
    ]
    xz = [
        [at(h, i, j, k) for k in range(depth) for j in range(q)] for h in blocks for i in range(q)
    ]
    return cols, rows, deps, xz


def groups_3d(world_size: int, tensor_size: int) -> tuple[Groups, Groups, Groups, Groups, Groups]:
    """``(input, weight, output, input_x_weight, output_x_weight)`` of the ``d x d x d`` cube."""
    d = round(tensor_size ** (1 / 3))
    blocks = range(world_size // tensor_size)
    r = range(d)

    def at(h: int, i: int, j: int, k: int) -> int:
        return h * d**3 + i + d * (j + d * k)

    inputs = [[at(h, i, j, k) for j in r] for h in blocks for i in r for k in r]
    weights = [[at(h, i, j, k) for i in r] for h in blocks for k in r for j in r]
    outputs = [[at(h, i, j, k) for k in r] for h in blocks for i in r for j in r]
    in_x_w = [[at(h, i, j, k) for j in r for i in r] for h in blocks for k in r]
    out_x_w = [[at(h, i, j, k) for k in r for i in r] for h in blocks for j in r]
    return inputs, weights, outputs, in_x_w, out_x_w
