"""Forward FLOPs estimates of the operators that dominate a step: linear, matmul, conv, attention.

The estimate counts one multiply-add as two FLOPs and ignores elementwise operators, norms and
reductions (their cost is memory-bound and small next to the matrix products). It works on both
graph flavours :class:`~kolossos.auto_parallel.ColoTracer` produces: torch-level ``torch.fx`` graphs
(``call_module`` on ``nn.Linear``/``nn.Conv*d``, ``torch.matmul``, ``F.linear``...) and ATen-level
``torch.export`` graphs (``aten.addmm``, ``aten.linear``, ``aten.convolution``...).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch
from torch import fx

__all__ = ["node_flops"]

#: names (the last part of an operator's qualified name) of the matrix products whose FLOPs are
#: ``2 * numel(out) * k`` with ``k`` the contracted dimension of the first operand
_MATMUL_NAMES = {"matmul", "mm", "bmm", "linear", "__matmul__"}
_ADDMM_NAMES = {"addmm", "baddbmm", "addbmm"}
_CONV_NAMES = {"conv1d", "conv2d", "conv3d", "convolution", "_convolution"}
_ATTENTION_NAMES = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
}


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def _shape(value: object) -> tuple[int, ...] | None:
    if isinstance(value, torch.Tensor):
        return tuple(int(s) for s in value.shape)
    return None


def _arg_shape(node: fx.Node, index: int) -> tuple[int, ...] | None:
    if index >= len(node.args):
        return None
    arg = node.args[index]
    if isinstance(arg, fx.Node):
        return _shape(arg.meta.get("val"))
    return None


def _op_name(node: fx.Node) -> str:
    target = node.target
    if target is operator.matmul:
        return "matmul"
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", str(target))
    # aten overloads are named like "addmm.default": keep the packet name
    return name.split(".")[0]


def _module_flops(module: torch.nn.Module, out: tuple[int, ...]) -> int:
    if isinstance(module, torch.nn.Linear):
        return 2 * _numel(out) * module.in_features
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        kernel = _numel(module.kernel_size)
        return 2 * _numel(out) * (module.in_channels // module.groups) * kernel
    return 0


def node_flops(node: fx.Node, root: torch.nn.Module | None = None) -> int:
    """Return the forward FLOPs of ``node`` (0 for operators outside the counted families).

    Args:
        node: a node whose ``meta["val"]`` and its inputs' hold (fake) tensors.
        root: the traced module, to resolve ``call_module`` targets.
    """
    out = _shape(node.meta.get("val"))
    if out is None:
        return 0
    if node.op == "call_module" and root is not None and isinstance(node.target, str):
        return _module_flops(root.get_submodule(node.target), out)
    if node.op not in ("call_function", "call_method"):
        return 0
    name = _op_name(node)
    if name in _MATMUL_NAMES:
        first = _arg_shape(node, 0)
        return 2 * _numel(out) * first[-1] if first else 0
    if name in _ADDMM_NAMES:
        first = _arg_shape(node, 1)
        return 2 * _numel(out) * first[-1] if first else 0
    if name in _CONV_NAMES:
        weight = _arg_shape(node, 1)
        return 2 * _numel(out) * _numel(weight[1:]) if weight else 0
    if name in _ATTENTION_NAMES:
        query, key = _arg_shape(node, 0), _arg_shape(node, 1)
        if not query or not key:
            return 0
        # q @ k^T and softmax(.) @ v: two products of (L x E) by (E x S)
        return 4 * _numel(query[:-1]) * key[-2] * query[-1]
    return 0
