"""Which dimension of every tensor in an exported ATen graph is the batch, and which the
feature (hidden / head / vocabulary) axis.

The graph executor (:mod:`~kolossos.auto_parallel.apply_graph`) runs each operator of a plan
on this rank's part of its tensors: under layout ``B`` the part along the batch dimension,
under ``F`` along the feature dimension. Which dimension that is changes through the graph —
GPT-2's fused ``c_attn`` output ``[b·s, 3h]`` is viewed as ``[b, s, 3h]``, split, viewed as
``[b, s, heads, head_dim]`` and transposed to ``[b, heads, s, head_dim]`` — so it is found by
propagation on the traced (global) shapes:

* batch: the user inputs' dimension 0 (when it is the batch size) starts it;
* feature: the output's last dimension of every operator reading a weight by matmul or
  lookup (``addmm``, ``linear``, ``mm``, ``embedding``), the channels (dimension 1) of a
  convolution's output;
* through views the dimension is followed by the element order (a ``view`` keeps a sharded
  dimension sharded in contiguous blocks when the product of the dimensions before it is
  unchanged: ``[b, s, h] → [b, s, heads, head_dim]`` maps ``h`` to ``heads``; ``flatten``
  alike), through
  ``transpose``/``permute``/``unsqueeze``/``squeeze``/``select`` by index arithmetic, through
  broadcasting elementwise operators by aligning shapes on the right;
* a node whose output has no such dimension (a reduction over it, a constant) gets ``None``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import fx

__all__ = [
    "CONV_OPS",
    "MATMUL_OPS",
    "as_int",
    "base_name",
    "feature_source",
    "node_shape",
    "propagate_dims",
    "sequence_sources",
    "view_dim",
]

MATMUL_OPS = {"addmm", "linear", "mm", "matmul", "embedding"}
"""Operators that start a feature dimension (their output's last) when they read a weight."""
CONV_OPS = {"conv1d", "conv2d", "conv3d", "convolution"}
"""Convolutions: their output's feature dimension is the channels, dimension 1."""


def as_int(arg: object) -> int:
    """An integer argument of a node (a dimension, a size)."""
    if not isinstance(arg, int):
        raise TypeError(f"expected an integer argument, got {arg!r}")
    return arg


def _ints(arg: object) -> list[int]:
    """An integer or list-of-integers argument as a list."""
    items = list(arg) if isinstance(arg, list | tuple) else [arg]
    return [as_int(x) for x in items]


def base_name(node: fx.Node) -> str:
    """The ATen operator's short name (``aten.view.default`` → ``view``)."""
    target = node.target
    return str(getattr(target, "__name__", target)).split(".")[0]


def node_shape(node: object) -> tuple[int, ...] | None:
    """The traced output shape of ``node`` (``None`` for a non-tensor)."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape)
    return None


def feature_source(node: fx.Node, weights: Iterable[str]) -> int | None:
    """The feature dimension ``node`` starts when it reads one of ``weights`` (a matmul's or
    lookup's last output dimension, a convolution's channels), else ``None``."""
    base = base_name(node)
    if node.op != "call_function" or not any(a.name in weights for a in node.all_input_nodes):
        return None
    if base in MATMUL_OPS:
        return len(node_shape(node) or (0,)) - 1
    if base in CONV_OPS:
        return 1
    return None


def view_dim(src: Sequence[int], dst: Sequence[int], dim: int) -> int | None:
    """The dimension of ``dst`` that holds ``src``'s dimension ``dim`` in contiguous blocks
    after a view (same elements, row-major), or ``None``."""
    before = math.prod(src[:dim])
    for j, size in enumerate(dst):
        if math.prod(dst[:j]) == before and size > 1:
            return j
    return None


def _tensor_inputs(node: fx.Node) -> Iterable[fx.Node]:
    for arg in node.args:
        if isinstance(arg, fx.Node):
            yield arg
        elif isinstance(arg, list | tuple):
            yield from (a for a in arg if isinstance(a, fx.Node))


def _aligned(src: tuple[int, ...], dst: tuple[int, ...] | None, dim: int) -> int | None:
    """``dim`` of a broadcast input mapped to the output (shapes aligned on the right)."""
    if dst is None:
        return None
    out = dim + len(dst) - len(src)
    if 0 <= out < len(dst) and dst[out] == src[dim]:
        return out
    return None


def _rule(node: fx.Node, dims: Mapping[str, int | None]) -> int | None:
    base = base_name(node)
    out = node_shape(node)
    first = node.args[0] if node.args else None
    if base == "getitem" and isinstance(first, fx.Node):
        return dims.get(first.name)
    if base in ("embedding", "addmm", "linear", "mm", "matmul", "bmm"):
        # the batch follows the activation (embedding's ids, addmm's second argument) at the
        # same index; the contracted last dimension is not kept
        act = node.args[1] if base in ("embedding", "addmm") else first
        src_act = node_shape(act)
        d = dims.get(act.name) if isinstance(act, fx.Node) else None
        if d is None or src_act is None or (base != "embedding" and d == len(src_act) - 1):
            return None
        return d
    if not isinstance(first, fx.Node) and base != "cat":
        return None
    if base == "cat":
        tensors = first if isinstance(first, list | tuple) else []
        found = [dims.get(t.name) for t in tensors if isinstance(t, fx.Node)]
        return next((d for d in found if d is not None), None)
    assert isinstance(first, fx.Node)
    src = node_shape(first)
    dim = dims.get(first.name)
    if base in ("scaled_dot_product_attention", "split", "split_with_sizes", "chunk"):
        return dim  # the outputs keep the first input's dimension (a list for a split)
    if dim is None or src is None:
        # the first input may be a broadcast constant: follow the others
        for other in _tensor_inputs(node):
            d, s = dims.get(other.name), node_shape(other)
            if d is not None and s is not None:
                return _aligned(s, out, d)
        return None
    if base in ("view", "_unsafe_view", "reshape", "flatten") and out is not None:
        return view_dim(src, out, dim)
    if base == "transpose":
        a, b = (as_int(x) % len(src) for x in node.args[1:3])
        return b if dim == a else a if dim == b else dim
    if base == "t":
        return 1 - dim
    if base == "permute":
        perm = [as_int(p) % len(src) for p in _ints(node.args[1])]
        return perm.index(dim)
    if base == "unsqueeze" and out is not None:
        k = as_int(node.args[1]) % len(out)
        return dim + 1 if k <= dim else dim
    if base in ("select", "slice", "narrow", "index_select") and out is not None:
        k = as_int(node.args[1]) % len(src)
        if k == dim and (base == "select" or out[dim] != src[dim]):
            return None
        return dim - 1 if base == "select" and k < dim else dim
    if out is None:
        return None
    if len(out) == len(src) and out[dim] == src[dim]:
        return dim
    if base in ("squeeze", "sum", "mean", "amax") and len(out) < len(src):
        removed = _removed_dims(node, src)
        return None if dim in removed else dim - sum(1 for r in removed if r < dim)
    return _aligned(src, out, dim)


def _removed_dims(node: fx.Node, src: tuple[int, ...]) -> set[int]:
    """The dimensions a ``squeeze`` or a reduction without ``keepdim`` drops."""
    given = node.args[1] if len(node.args) > 1 else None
    listed = (
        list(range(len(src))) if given is None else [as_int(d) % len(src) for d in _ints(given)]
    )
    if base_name(node) == "squeeze":
        return {d for d in listed if src[d] == 1}
    return set(listed)


def propagate_dims(graph: fx.Graph, sources: Mapping[str, int | None]) -> dict[str, int | None]:
    """The sharded-axis dimension of every node's output, starting from ``sources``.

    A ``call_function`` node in ``sources`` keeps the given dimension (it starts an axis);
    the others follow :func:`_rule` from their inputs.
    """
    dims: dict[str, int | None] = dict(sources)
    for node in graph.nodes:
        if node.op == "call_function" and node.name not in dims:
            dims[node.name] = _rule(node, dims)
    return dims


def sequence_sources(graph: fx.Graph, inputs: Iterable[str]) -> dict[str, int | None]:
    """Where the sequence axis starts: dimension 1 of every user input of at least 2
    dimensions (``input_ids [batch, seq]``)."""
    nodes = {n.name: n for n in graph.nodes}
    return {i: 1 if len(node_shape(nodes[i]) or ()) >= 2 else None for i in inputs}
