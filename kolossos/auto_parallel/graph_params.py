"""How the graph executor (:mod:`~kolossos.auto_parallel.apply_graph`) stores a model's
parameters and buffers on one rank, and what part each use of them reads.

Each read of a parameter in the traced graph is a :class:`ParamUse` decided by its operator's
strategy: ``S`` (this rank's slice along a dimension: a column-parallel weight by output
features, GPT-2's fused ``c_attn`` per head of q, k and v, a row-parallel weight by input
features, a vocabulary-parallel embedding by rows, a column-parallel convolution by output
channels, a channel-sharded BatchNorm's weight and bias), ``B`` (whole, each rank's share of
its gradient: read by a batch-sharded operator) or ``R`` (whole, whole gradient). A parameter
with a single sharded use is stored as that shard (:func:`store_parameters`); any other is the
model's own tensor, its gradient summed over the mesh when some use is sharded or batch-split.
A BatchNorm's running statistics follow its weight: sharded by channel under ``F``
(:func:`buffer_dim`), whole otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx, nn

from kolossos.auto_parallel import graph_comm
from kolossos.auto_parallel.module_graph import OperatorGroup
from kolossos.auto_parallel.shard_dims import as_int, base_name, node_shape
from kolossos.auto_parallel.strategies import Strategy, UnsupportedOperatorError
from kolossos.nn.layer.parallel_1d._comm import all_gather_along

__all__ = ["ParamSpec", "ParamUse", "buffer_dim", "param_use", "split_chunks", "store_parameters"]


@dataclass
class ParamSpec:
    """How one parameter (or buffer) of the original model is stored on this rank."""

    attr: str
    """Attribute of the rewritten graph module holding it."""
    dim: int | None = None
    """The dimension it is sharded on, ``None``: stored whole."""
    chunks: int = 1
    """Sharded per chunk (GPT-2's fused q, k, v: 3)."""
    summed: bool = False
    """Its gradient is summed over the mesh after backward (stored whole, used by a
    batch-sharded operator or by a sharded one)."""

    def gather(self, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """The full tensor from every rank's part (collective)."""
        assert self.dim is not None
        world = dist.get_world_size(group)
        parts = all_gather_along(local, self.dim, group).chunk(world, dim=self.dim)
        per_rank = [p.chunk(self.chunks, dim=self.dim) for p in parts]
        chunks = [torch.cat([r[c] for r in per_rank], dim=self.dim) for c in range(self.chunks)]
        return torch.cat(chunks, dim=self.dim)


@dataclass(frozen=True)
class ParamUse:
    """What one read of a parameter takes."""

    kind: str
    """``S`` this rank's slice, ``B`` whole with a share of the gradient, ``R`` whole."""
    dim: int | None = None
    """The sliced dimension under ``S``."""
    chunks: int = 1
    """Sliced per chunk (GPT-2's fused q, k, v: 3)."""


def split_chunks(
    group: OperatorGroup, nodes: Mapping[str, fx.Node], feature_dims: Mapping[str, int | None]
) -> int:
    """How many equal chunks a column-parallel output is split into (fused q, k, v): the
    number of parts of the group's first split along the output's feature dimension."""
    for name in group.nodes:
        node = nodes[name]
        if base_name(node) not in ("split", "split_with_sizes"):
            continue
        src = node.args[0]
        assert isinstance(src, fx.Node)
        shape = node_shape(src)
        split_dim = as_int(node.args[2]) if len(node.args) > 2 else 0
        if shape is None or feature_dims.get(src.name) != split_dim % len(shape):
            continue
        sizes = node.args[1]
        if isinstance(sizes, list | tuple):
            return len(sizes)
        return shape[split_dim] // as_int(sizes)
    return 1


def param_use(
    group: OperatorGroup,
    strategy: Strategy,
    node: fx.Node,
    placeholder: str,
    chunks: Callable[[], int],
) -> ParamUse:
    """The part of parameter ``placeholder`` that ``node`` (of ``group``, running
    ``strategy``) reads; ``chunks`` counts a column-parallel output's fused chunks.

    Raises:
        UnsupportedOperatorError: a parameter read under ``F`` by an operator without a
            sharded form, or a grouped convolution under ``col``.
    """
    role, base = strategy.name, base_name(node)
    if group.kind == "linear":
        weight_arg = node.args[2] if base == "addmm" else node.args[1]
        weight = isinstance(weight_arg, fx.Node) and placeholder == weight_arg.name
        conv1d = base == "addmm"
        if role == "col":
            dim = (1 if conv1d else 0) if weight else 0
            return ParamUse("S", dim, chunks())
        if role == "row":
            return ParamUse("S", 0 if conv1d else 1) if weight else ParamUse("R")
        return ParamUse("B" if role in ("dp", "sp") else "R")
    if group.kind == "embedding":
        return ParamUse("S", 0) if role == "vocab" else ParamUse("B" if role == "dp" else "R")
    if group.kind == "conv":
        if role == "col":
            groups = node.args[6] if len(node.args) > 6 else 1
            if groups != 1:
                raise UnsupportedOperatorError(
                    f"node {node.name!r} ({node.target}) of operator {group.name!r} is a "
                    f"grouped convolution (groups={groups}); only groups=1 convolutions have "
                    "a column-parallel form (choose dp or rep for it)."
                )
            return ParamUse("S", 0)  # weight [out, in, *kernel] and bias [out] by channel
        return ParamUse("B" if role == "dp" else "R")
    layout = strategy.out_layout
    if layout == "F" and group.kind == "batchnorm":
        return ParamUse("S", 0)  # per-channel weight and bias
    if layout == "F":
        raise UnsupportedOperatorError(
            f"node {node.name!r} ({node.target}) of operator {group.name!r} reads parameter "
            f"{placeholder!r} under a feature-sharded layout; no sharded form exists."
        )
    return ParamUse("B" if layout in ("B", "Q") else "R")  # Q: each rank its tokens' share


def store_parameters(
    model: nn.Module, uses: Mapping[str, set[ParamUse]], rank: int, world: int
) -> tuple[dict[str, torch.Tensor], dict[str, ParamSpec]]:
    """This rank's parameters by attribute (``param{i}``) and their specs by the model's
    names: a parameter with one sharded use stored as its shard (the model's full copy
    freed), any other as the model's own tensor."""
    params: dict[str, torch.Tensor] = {}
    specs: dict[str, ParamSpec] = {}
    for i, (name, param) in enumerate(model.named_parameters()):
        attr = f"param{i}"
        found = uses.get(name, set())
        if len(found) == 1 and next(iter(found)).kind == "S":
            use = next(iter(found))
            specs[name] = ParamSpec(attr, use.dim, use.chunks)
            shard = graph_comm.shard_of(param.detach(), use.dim or 0, use.chunks, rank, world)
            params[attr] = nn.Parameter(shard.clone(), requires_grad=param.requires_grad)
            param.data = param.data.new_empty(0)  # the model's full copy is freed
        else:
            summed = any(u.kind in ("B", "S") for u in found) and world > 1
            specs[name] = ParamSpec(attr, None, 1, summed)
            params[attr] = param
    return params, specs


def buffer_dim(node: fx.Node, reader: Callable[[fx.Node], OperatorGroup | None],
               layout: Callable[[str], str]) -> int | None:  # fmt: skip
    """0 for buffer ``node`` read only by channel-sharded BatchNorms (stored by channel),
    ``None`` for one stored whole; ``reader`` gives a node's operator, ``layout`` an
    operator's output layout.

    Raises:
        UnsupportedOperatorError: a buffer read by a channel-sharded BatchNorm and by another
            operator.
    """
    readers = [g for g in (reader(u) for u in node.users) if g is not None]
    sharded = [g.kind == "batchnorm" and layout(g.name) == "F" for g in readers]
    if not any(sharded):
        return None
    if not all(sharded) or not node_shape(node):
        raise UnsupportedOperatorError(
            f"buffer {node.name!r} is read by a channel-sharded BatchNorm and by another "
            "operator; give them the same layout."
        )
    return 0
