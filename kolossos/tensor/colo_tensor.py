"""``ColoTensor``: a global tensor whose payload is spread over the tensor-parallel group, with
Colossal-AI's spec API on top of PyTorch's ``DTensor``.

A ColoTensor *is* a ``torch.distributed.tensor.DTensor`` (a subclass): its ``shape`` is the
global shape, ``to_local()`` / :meth:`ColoTensor.size_local` give this rank's piece, and every
torch operator on it is computed by DTensor's sharding propagation (matmul, linear, addmm,
embedding, element-wise functions...), so an unmodified model runs on sharded parameters.
Results of operators are plain DTensors (ColoTensor's base class). What ColoTensor adds:

- the legacy spec API: a :class:`~kolossos.tensor.ProcessGroup`, a dist spec
  (:class:`~kolossos.tensor.ShardSpec` / :class:`~kolossos.tensor.ReplicaSpec`) mapped onto
  DTensor placements on the pg's ``"tp"`` mesh, and a :class:`~kolossos.tensor.ComputeSpec`;
- :meth:`set_dist_spec` (in place) and :meth:`to_replicate` / :meth:`redistribute` (out of place),
  both recorded by autograd: backward converts the gradient back;
- the compute-spec output rule: an operator fed by a ``TP1D`` parameter whose
  ``compute_spec.output_replicate`` is on returns a replicated result.

Colossal-AI's ColoTensor reported the *local* shape; kolossos reports the global one (DTensor
semantics), which is what lets model code such as ``x.view(-1, x.size(-1))`` run unchanged.

Example:
    >>> spec = ColoTensorSpec(pg, ShardSpec([-1], [pg.tp_world_size()]))  # doctest: +SKIP
    >>> t = ColoTensor.from_torch_tensor(torch.randn(2, 3, 1), spec)  # doctest: +SKIP
    >>> t.shape, t.size_local()  # tp 2  # doctest: +SKIP
    (torch.Size([2, 3, 2]), torch.Size([2, 3, 1]))
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.utils._pytree import tree_flatten

from kolossos.tensor.compute_spec import ComputePattern, ComputeSpec
from kolossos.tensor.distspec import ReplicaSpec, ShardSpec
from kolossos.tensor.implicit import enable_implicit_replication
from kolossos.tensor.process_group import ProcessGroup
from kolossos.tensor.tensor_spec import ColoTensorSpec

__all__ = ["ColoTensor", "dist_spec_of", "placements_of"]

DistSpec = ReplicaSpec | ShardSpec


def placements_of(dist_spec: DistSpec, pg: ProcessGroup, ndim: int) -> list[Placement]:
    """The DTensor placements on ``pg``'s tp mesh that ``dist_spec`` describes.

    Raises:
        TypeError: ``dist_spec`` is not a dist spec.
        ValueError: a shard count other than the tp size, or a dimension out of range.
    """
    if isinstance(dist_spec, ReplicaSpec):
        return [Replicate()]
    if not isinstance(dist_spec, ShardSpec):
        raise TypeError(f"dist spec {dist_spec!r} must be a ShardSpec or a ReplicaSpec.")
    dim, parts = dist_spec.dims[0], dist_spec.num_partitions[0]
    if parts == 1 or pg.tp_world_size() == 1:
        return [Replicate()]
    if parts != pg.tp_world_size():
        raise ValueError(
            f"{dist_spec} cuts into {parts} pieces but the tp group has {pg.tp_world_size()} "
            f"ranks; use ShardSpec([{dim}], [pg.tp_world_size()])."
        )
    if not -ndim <= dim < ndim:
        raise ValueError(f"{dist_spec}: dim {dim} is out of range for a {ndim}-d tensor.")
    return [Shard(dim % ndim)]


def dist_spec_of(placements: Sequence[Placement], tp_size: int) -> DistSpec:
    """The dist spec of 1-d tp-mesh placements (``Partial`` is not a dist spec)."""
    (placement,) = placements
    if isinstance(placement, Shard):
        return ShardSpec([placement.dim], [tp_size])
    if isinstance(placement, Replicate):
        return ReplicaSpec()
    raise ValueError(f"placement {placement} has no dist spec; redistribute to Replicate first.")


class _AsColo(torch.autograd.Function):
    """A DTensor as a ColoTensor of the same payload; gradients pass through unchanged."""

    @staticmethod
    def forward(ctx: Any, dt: DTensor, cls: type[ColoTensor]) -> ColoTensor:
        return cls._wrap(dt._local_tensor.detach(), dt)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SetSpec(torch.autograd.Function):
    """In-place respec of a non-leaf ColoTensor, recorded by autograd."""

    @staticmethod
    def forward(ctx: Any, t: ColoTensor, placements: list[Placement]) -> ColoTensor:
        ctx.placements = list(t.placements)
        ctx.mesh = t.device_mesh
        plain = DTensor.from_local(t._local_tensor, t.device_mesh, t.placements, run_check=False)
        t._swap(plain.redistribute(t.device_mesh, placements))
        ctx.mark_dirty(t)
        return t

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None]:
        return grad.redistribute(ctx.mesh, ctx.placements), None


class ColoTensor(DTensor):
    """A DTensor on the tp mesh of a :class:`ProcessGroup`, with a dist spec and a compute spec.

    Build one with :meth:`from_torch_tensor` (from this rank's piece) or
    :func:`kolossos.tensor.d_tensor.distribute_tensor` (from the whole tensor).
    """

    _pg: ProcessGroup | None
    compute_spec: ComputeSpec | None

    @classmethod
    def _wrap(cls, local: torch.Tensor, like: DTensor, requires_grad: bool = False) -> Any:
        # model code mixes plain tensors (inputs, masks) with the DTensors ColoTensors make
        enable_implicit_replication()
        out: Any = DTensor.__new__(cls, local, like._spec, requires_grad=requires_grad)
        out._pg = None
        out.compute_spec = None
        return out

    @staticmethod
    def from_torch_tensor(tensor: torch.Tensor, spec: ColoTensorSpec | None = None) -> ColoTensor:
        """A ColoTensor whose piece on this rank is ``tensor`` (its global shape follows from the
        dist spec: ``ShardSpec([-1], [2])`` on a ``(2, 3, 1)`` piece is a ``(2, 3, 2)`` tensor).
        Differentiable: gradients flow back to ``tensor``.

        Raises:
            TypeError: ``spec`` is missing or not a :class:`ColoTensorSpec`.
        """
        if not isinstance(spec, ColoTensorSpec):
            raise TypeError(
                f"ColoTensor.from_torch_tensor(spec={spec!r}): pass a ColoTensorSpec(pg, "
                "dist_spec), e.g. ColoTensorSpec(ProcessGroup(tp_degree=2), ReplicaSpec())."
            )
        if isinstance(tensor, ColoTensor):
            return tensor
        places = placements_of(spec.dist_attr, spec.pg, tensor.dim())
        dt = DTensor.from_local(tensor, spec.pg.tp_mesh, places, run_check=False)
        out = (
            _AsColo.apply(dt, ColoTensor) if tensor.requires_grad else ColoTensor._wrap(tensor, dt)
        )
        out._pg = spec.pg
        out.compute_spec = spec.compute_attr
        return out

    # ---- specs ---------------------------------------------------------------------------------

    @property
    def process_group(self) -> ProcessGroup:
        """The tp x dp layout this tensor lives on.

        Raises:
            RuntimeError: the tensor was made without one (by ``d_tensor.distribute_tensor``).
        """
        if self._pg is None:
            raise RuntimeError(
                "this ColoTensor has no ProcessGroup (it lives on a d_tensor DeviceMesh); use "
                "kolossos.tensor.d_tensor.get_device_mesh(tensor)."
            )
        return self._pg

    def get_process_group(self) -> ProcessGroup:
        """:attr:`process_group`."""
        return self.process_group

    def get_tp_world_size(self) -> int:
        """The size of the tensor-parallel group."""
        return self.process_group.tp_world_size()

    @property
    def dist_spec(self) -> DistSpec:
        """The current dist spec (from the DTensor placements)."""
        return dist_spec_of(self.placements, self.get_tp_world_size())

    def has_compute_spec(self) -> bool:
        """Whether a compute spec is set."""
        return self.compute_spec is not None

    def has_compute_pattern(self, compute_pattern: ComputePattern) -> bool:
        """Whether the compute spec has ``compute_pattern``."""
        return (
            self.compute_spec is not None and self.compute_spec.compute_pattern == compute_pattern
        )

    def is_replicate(self) -> bool:
        """Whether every rank of the tp group holds the whole tensor."""
        return all(isinstance(p, Replicate) for p in self.placements)

    def is_sharded(self) -> bool:
        """Whether the tensor is cut over the tp group."""
        return any(isinstance(p, Shard) for p in self.placements)

    def is_shard_1dcol(self) -> bool:
        """Whether the last dimension is cut (a column split of a ``(in, out)`` weight)."""
        return self.placements == (Shard(self.dim() - 1),)

    def is_shard_1drow(self) -> bool:
        """Whether dimension 0 is cut (a row split)."""
        return self.placements == (Shard(0),)

    def size_local(self, *dim: int) -> Any:
        """This rank's piece's size (Colossal-AI's ``ColoTensor.size()``)."""
        return self._local_tensor.size(*dim)

    def size_global(self, *dim: int) -> Any:
        """The global size (also ``size()`` / ``shape``)."""
        return DTensor.size(self, *dim)

    def numel_global(self) -> int:
        """The number of elements of the global tensor."""
        return math.prod(self.size_global())

    def set_process_group(self, pg: ProcessGroup) -> None:
        """Move a replicated tensor onto ``pg``'s tp mesh (in place; parameters only).

        Raises:
            ValueError: the tensor is sharded (replicate it first).
        """
        if not isinstance(pg, ProcessGroup):
            raise TypeError(f"set_process_group({pg!r}): pass a kolossos.tensor.ProcessGroup.")
        if not self.is_replicate():
            raise ValueError(
                f"set_process_group on a sharded ColoTensor ({self.placements}); call "
                "to_replicate_() first."
            )
        with torch.no_grad():
            local = self._local_tensor
            self._swap(DTensor.from_local(local, pg.tp_mesh, [Replicate()], run_check=False))
        self._pg = pg

    def set_dist_spec(self, dist_spec: DistSpec) -> None:
        """Convert to ``dist_spec`` in place. On a tensor in an autograd graph the conversion
        is recorded (backward converts the gradient back); on a leaf it is a data change."""
        places = placements_of(dist_spec, self.process_group, self.dim())
        if tuple(places) == tuple(self.placements):
            return
        if self.requires_grad and not self.is_leaf and torch.is_grad_enabled():
            _SetSpec.apply(self, places)
            return
        with torch.no_grad():
            plain = DTensor.from_local(
                self._local_tensor, self.device_mesh, self.placements, run_check=False
            )
            self._swap(plain.redistribute(self.device_mesh, places))
            grad = self.grad
            if isinstance(grad, DTensor):
                self.grad = grad.redistribute(self.device_mesh, places)

    def set_tensor_spec(self, dist_spec: DistSpec | None, compute_spec: ComputeSpec | None) -> None:
        """Set the dist spec (converting the payload) and the compute spec; ``None`` keeps one."""
        if dist_spec is not None:
            self.set_dist_spec(dist_spec)
        if compute_spec is not None:
            if not isinstance(compute_spec, ComputeSpec):
                raise TypeError(f"compute_spec={compute_spec!r} must be a ComputeSpec.")
            self.compute_spec = compute_spec

    def redistribute(self, device_mesh: Any = None, placements: Any = None, **kwargs: Any) -> Any:
        """``redistribute(dist_spec, pg=None)`` (Colossal-AI) returns a ColoTensor with
        ``dist_spec`` (on ``pg``'s mesh); ``redistribute(device_mesh, placements)`` is DTensor's.
        Both are differentiable."""
        if not isinstance(device_mesh, (ReplicaSpec, ShardSpec)):
            return DTensor.redistribute(self, device_mesh, placements, **kwargs)
        pg = placements if placements is not None else self.process_group
        source: DTensor = self
        if pg != self.process_group:
            full = DTensor.redistribute(self, self.device_mesh, [Replicate()]).to_local()
            source = DTensor.from_local(full, pg.tp_mesh, [Replicate()], run_check=False)
        moved = DTensor.redistribute(source, pg.tp_mesh, placements_of(device_mesh, pg, self.dim()))
        out = _AsColo.apply(moved, ColoTensor)
        out._pg = pg
        return out

    def to_replicate(self) -> ColoTensor:
        """A replicated copy (all-gather over the tp group), differentiable."""
        return self.redistribute(ReplicaSpec())

    def to_replicate_(self) -> None:
        """Make this tensor replicated in place."""
        self.set_dist_spec(ReplicaSpec())

    # ---- tensor protocol -------------------------------------------------------------------------

    def _swap(self, other: DTensor) -> None:
        self._local_tensor = other._local_tensor
        self._spec = other._spec

    def detach(self) -> Any:
        """A detached ColoTensor of the same payload and specs (``nn.Parameter`` relies on it)."""
        out = type(self)._wrap(self._local_tensor.detach(), self)
        for key, value in self.__dict__.items():  # specs, a d_tensor layout, user marks
            if key not in ("_local_tensor", "_spec"):
                out.__dict__[key] = value
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if id(self) in memo:
            return memo[id(self)]
        local = copy.deepcopy(self._local_tensor, memo)
        out = type(self)._wrap(local, self, requires_grad=self.requires_grad)
        memo[id(self)] = out
        out._pg = self._pg  # process groups are shared, never copied
        out.compute_spec = copy.deepcopy(self.compute_spec, memo)
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]
        return (
            f"{type(self).__name__}(global_shape={tuple(self.shape)}, "
            f"placements={self.placements}, local={self._local_tensor})"
        )

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            ret = func(*args, **kwargs)
        if (
            isinstance(ret, DTensor)
            and not ret.is_leaf
            and any(isinstance(p, (Shard, Partial)) for p in ret.placements)
            and _replicate_output(args, kwargs)
        ):
            ret = ret.redistribute(ret.device_mesh, [Replicate()] * ret.device_mesh.ndim)
        return ret


def _replicate_output(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a TP1D parameter with ``output_replicate`` feeds the operator."""
    flat, _ = tree_flatten((args, kwargs))
    return any(
        isinstance(a, ColoTensor)
        and a.compute_spec is not None
        and a.compute_spec.output_replicate
        and a.is_sharded()
        for a in flat
    )
