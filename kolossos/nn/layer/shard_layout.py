"""One contract for the shard marks of every tensor-parallel mode: :class:`ShardLayout`.

The 1D, 2D, 2.5D and 3D layers each mark their sharded parameters with a spec of their own
(:class:`~kolossos.nn.layer.parallel_1d.sharding.TPShardSpec`,
:class:`~kolossos.nn.layer.parallel_2d.sharding.Shard2DSpec`,
:class:`~kolossos.nn.layer.parallel_2p5d.sharding.TesseractShardSpec`,
:class:`~kolossos.nn.layer.parallel_3d.sharding.Shard3DSpec`), because each mode cuts tensors
differently. Code that only needs to count, gather or cut a shard — the global gradient norm,
checkpoint IO — reads them through this protocol and :func:`get_shard_layout`, without knowing
the mode.

Every layout speaks the *dense* layout: the full tensor is the parameter of the equivalent torch
layer (``nn.Linear``'s ``(out, in)`` weight, ``nn.Embedding``'s ``(num, dim)``), the tensor the
layer's ``full_state()`` returns under the same name, even where the mode stores its blocks
transposed (2D, 2.5D and 3D keep Colossal-AI's ``(in, out)`` linear blocks).

Example:
    >>> layout = get_shard_layout(param)  # doctest: +SKIP
    >>> if layout is not None:  # doctest: +SKIP
    ...     full = layout.gather(param.detach())  # COLLECTIVE: the dense tensor
    ...     assert layout.shard(full).equal(param)  # no communication
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from kolossos.nn.layer.parallel_1d.sharding import get_tp_spec
from kolossos.nn.layer.parallel_2d.sharding import get_2d_spec
from kolossos.nn.layer.parallel_2p5d.sharding import get_2p5d_spec
from kolossos.nn.layer.parallel_3d.sharding import get_3d_spec

__all__ = ["ShardLayout", "get_shard_layout"]


class ShardLayout(Protocol):
    """How one tensor-parallel parameter (or a tensor shaped like it: its gradient, an
    optimizer state) is spread over the ranks of its tensor-parallel group."""

    @property
    def full_shape(self) -> tuple[int, ...]:
        """Shape of the full tensor in the dense layout (as the torch layer's parameter)."""
        ...

    @property
    def replicas(self) -> int:
        """How many ranks of the tensor group hold each element (1: partitioned). Summing a
        per-rank quantity over the group and dividing by this counts each element once."""
        ...

    def shard_shape(self) -> tuple[int, ...]:
        """The shape of this rank's local piece (the parameter's shape)."""
        ...

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full tensor, of :attr:`full_shape`, in the dense layout, from every rank's local
        piece. COLLECTIVE over the layout's groups: every rank of the tensor group calls it, for
        the same tensors in the same order."""
        ...

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local piece (of :meth:`shard_shape`) of a dense ``full`` tensor; no
        communication."""
        ...


_FINDERS: tuple[Callable[[torch.Tensor], ShardLayout | None], ...] = (
    get_tp_spec,
    get_2d_spec,
    get_2p5d_spec,
    get_3d_spec,
)


def get_shard_layout(tensor: torch.Tensor) -> ShardLayout | None:
    """The :class:`ShardLayout` of whichever tensor-parallel mark ``tensor`` carries, or ``None``
    for a tensor no tensor-parallel layer marked (replicated over the tensor group).

    Example:
        >>> get_shard_layout(torch.zeros(2)) is None
        True
    """
    for find in _FINDERS:
        layout = find(tensor)
        if layout is not None:
            return layout
    return None
