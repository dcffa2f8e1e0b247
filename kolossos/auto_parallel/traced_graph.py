"""The result of :class:`~kolossos.auto_parallel.ColoTracer`: a graph plus per-node meta info."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import fx

from kolossos.auto_parallel.flops import node_flops

__all__ = ["NodeInfo", "TracedGraph", "TracingError", "node_info"]


class TracingError(RuntimeError):
    """A model (or one of its operators) cannot be traced; the message names node and operator."""


@dataclass(frozen=True, kw_only=True)
class NodeInfo:
    """Meta information of one graph node."""

    name: str
    """The node's name in the graph."""
    op: str
    """The fx opcode: placeholder, get_attr, call_module, call_function, call_method, output."""
    target: str
    """The operator, module path or attribute the node calls."""
    shapes: tuple[tuple[int, ...], ...]
    """Shape of each tensor output (several for tuple outputs)."""
    dtypes: tuple[torch.dtype, ...]
    """Dtype of each tensor output."""
    output_bytes: int
    """Bytes of all tensor outputs."""
    flops: int
    """Forward FLOPs estimate (see :mod:`kolossos.auto_parallel.flops`)."""

    @property
    def shape(self) -> tuple[int, ...] | None:
        """The shape of the first tensor output, or ``None`` without tensor output."""
        return self.shapes[0] if self.shapes else None


@dataclass(frozen=True, kw_only=True)
class TracedGraph:
    """A traced model: the graph module and one :class:`NodeInfo` per node, in graph order."""

    graph_module: fx.GraphModule
    """The traced graph; every node's ``meta["val"]`` holds its (fake) output."""
    nodes: list[NodeInfo] = field(default_factory=list)
    """Per-node information, in graph order."""
    param_bytes: int = 0
    """Bytes of the traced module's parameters."""
    backend: str = "fx"
    """The front end that made the graph: ``fx`` or ``export``."""

    @property
    def total_flops(self) -> int:
        """Sum of the nodes' forward FLOPs estimates."""
        return sum(info.flops for info in self.nodes)

    @property
    def activation_bytes(self) -> int:
        """Sum of the output bytes of the computing nodes (an upper bound on stored activations)."""
        return sum(i.output_bytes for i in self.nodes if i.op.startswith("call_"))

    def __getitem__(self, name: str) -> NodeInfo:
        for info in self.nodes:
            if info.name == name:
                return info
        raise KeyError(f"no node named {name!r}; nodes: {[i.name for i in self.nodes][:20]}...")

    def summary(self) -> str:
        """A table: node, op, target, output shape, output bytes, FLOPs."""
        lines = [
            f"{'node':<24} {'op':<14} {'target':<32} {'shape':<20} {'bytes':>10} {'flops':>12}"
        ]
        for i in self.nodes:
            lines.append(
                f"{i.name[:24]:<24} {i.op:<14} {i.target[:32]:<32} {str(i.shape)[:20]:<20} "
                f"{i.output_bytes:>10} {i.flops:>12}"
            )
        lines.append(f"total flops {self.total_flops}, parameter bytes {self.param_bytes}")
        return "\n".join(lines)


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def node_info(node: fx.Node, root: torch.nn.Module) -> NodeInfo:
    """Build the :class:`NodeInfo` of ``node`` from its ``meta["val"]``."""
    tensors = _tensors(node.meta.get("val")) if node.op != "output" else []
    target = node.target if isinstance(node.target, str) else str(node.target)
    return NodeInfo(
        name=node.name,
        op=node.op,
        target=target,
        shapes=tuple(tuple(int(s) for s in t.shape) for t in tensors),
        dtypes=tuple(t.dtype for t in tensors),
        output_bytes=sum(math.prod(t.shape) * t.element_size() for t in tensors),
        flops=node_flops(node, root),
    )
