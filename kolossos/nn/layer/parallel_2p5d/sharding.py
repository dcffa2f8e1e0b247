"""How a 2.5D parameter is cut: :class:`TesseractShardSpec`, attached to the parameter, and the
base class of the 2.5D layers (full-state gathering and loading).

A parameter's full (dense) tensor is split into ``q`` pieces along :attr:`~TesseractShardSpec.
col_dim` by the column index ``j`` and, inside each, into ``q`` pieces along
:attr:`~TesseractShardSpec.row_dim` by the row index ``i`` (the two may be the same dimension:
piece ``j * q + i``, or ``None``: not split by that index). Every depth layer holds the same
pieces, so each element is held by :attr:`~TesseractShardSpec.replicas` ranks of the tensor
group. A 1D :class:`~kolossos.nn.layer.parallel_1d.sharding.TPShardSpec` (one dimension, one
group) cannot express this, hence a spec of its own.

Gradient norms: to count each element once, a norm over the tensor group sums
``|g|^p / spec.replicas`` over the tensor group for every marked parameter
(:func:`~kolossos.nn.layer.shard_layout.get_shard_layout`).

The spec satisfies the mode-independent :class:`~kolossos.nn.layer.shard_layout.ShardLayout`
(``gather`` / ``shard`` / ``replicas``).

Example:
    >>> spec = get_2p5d_spec(layer.weight)  # doctest: +SKIP
    >>> full = spec.gather(layer.weight.detach())  # COLLECTIVE  # doctest: +SKIP
    >>> shard = spec.slice(full)  # no communication  # doctest: +SKIP
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kolossos.nn.layer.parallel_1d._comm import all_gather_along
from kolossos.nn.layer.parallel_2p5d.groups import Groups2p5D

__all__ = [
    "ParallelModule2p5D",
    "TesseractShardSpec",
    "get_2p5d_spec",
    "set_2p5d_spec",
]

_SPEC_ATTR = "_kolossos_tp_2p5d_spec"


@dataclass(frozen=True, kw_only=True, eq=False)
class TesseractShardSpec:
    """The layout of one 2.5D parameter shard (see the module docstring)."""

    full_shape: tuple[int, ...]
    """Shape of the full (dense) tensor."""
    row_dim: int | None
    """Dimension of the full tensor split by the row index ``i`` (inside the column split when
    it equals :attr:`col_dim`); ``None``: replicated over the grid's rows."""
    col_dim: int | None
    """Dimension of the full tensor split by the column index ``j``; ``None``: replicated over
    the grid's columns."""
    transposed: bool = False
    """The local shard is the transpose of the piece (2-D tensors only): Colossal-AI's
    ``Linear2p5D`` keeps ``(in, out)`` pieces of the dense ``(out, in)`` weight."""
    groups: Groups2p5D
    """The tesseract the tensor is split over."""

    def __post_init__(self) -> None:
        q, ndim = self.groups.tesseract_dim, len(self.full_shape)
        if self.transposed and ndim != 2:
            raise ValueError(f"TesseractShardSpec: transposed needs a 2-D tensor, got {ndim}-D.")
        for dim, parts in self._splits():
            if not 0 <= dim < ndim:
                raise ValueError(
                    f"TesseractShardSpec: dim {dim} must lie in [0, {ndim}) for full_shape "
                    f"{self.full_shape}."
                )
            if self.full_shape[dim] % parts:
                raise ValueError(
                    f"TesseractShardSpec: full_shape[{dim}]={self.full_shape[dim]} is not "
                    f"divisible by {parts} (q={q})."
                )

    def __deepcopy__(self, memo: dict[int, object]) -> TesseractShardSpec:
        return self  # immutable, and its process groups cannot be copied

    def _splits(self) -> list[tuple[int, int]]:
        """``(dim, number of pieces)`` of every split, the same dimension counted once."""
        q = self.groups.tesseract_dim
        dims = [d for d in (self.col_dim, self.row_dim) if d is not None]
        if len(dims) == 2 and dims[0] == dims[1]:
            return [(dims[0], q * q)]
        return [(d, q) for d in dims]

    @property
    def replicas(self) -> int:
        """How many ranks of the tensor group hold each element (``d``, times ``q`` for each
        index the tensor is not split by)."""
        q = self.groups.tesseract_dim
        unsplit = (self.row_dim is None) + (self.col_dim is None)
        return self.groups.tesseract_dep * q**unsplit

    def shard_shape(self) -> tuple[int, ...]:
        """The shape of the local shard (transposed where :attr:`transposed`)."""
        shape = list(self.full_shape)
        for dim, parts in self._splits():
            shape[dim] //= parts
        return tuple(reversed(shape)) if self.transposed else tuple(shape)

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``full`` (no communication).

        Raises:
            ValueError: ``full`` does not have :attr:`full_shape`.
        """
        if tuple(full.shape) != self.full_shape:
            raise ValueError(
                f"TesseractShardSpec.slice: tensor of shape {tuple(full.shape)} is not the full "
                f"shape {self.full_shape}."
            )
        q, piece = self.groups.tesseract_dim, full
        if self.col_dim is not None:
            piece = piece.chunk(q, dim=self.col_dim)[self.groups.col_index]
        if self.row_dim is not None:
            piece = piece.chunk(q, dim=self.row_dim)[self.groups.row_index]
        return (piece.t() if self.transposed else piece).contiguous()

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The full tensor from every rank's shard. COLLECTIVE over the grid's column then row
        groups (every rank of the tensor group calls it)."""
        if tuple(shard.shape) != self.shard_shape():
            raise ValueError(
                f"TesseractShardSpec.gather: tensor of shape {tuple(shard.shape)} is not a shard "
                f"of {self.full_shape} (expected {self.shard_shape()})."
            )
        piece = shard.detach().t() if self.transposed else shard.detach()
        if self.row_dim is not None:
            piece = all_gather_along(piece, self.row_dim, self.groups.col)
        if self.col_dim is not None:
            piece = all_gather_along(piece, self.col_dim, self.groups.row)
        return piece.contiguous().clone()

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """:meth:`slice` under the :class:`~kolossos.nn.layer.shard_layout.ShardLayout` name:
        this rank's shard of the dense ``full``; no communication."""
        return self.slice(full)


def set_2p5d_spec(param: torch.Tensor, spec: TesseractShardSpec) -> None:
    """Attach ``spec`` to ``param``.

    Raises:
        ValueError: ``param``'s shape is not the spec's shard shape.
    """
    if tuple(param.shape) != spec.shard_shape():
        raise ValueError(
            f"set_2p5d_spec: parameter of shape {tuple(param.shape)} does not match the shard "
            f"shape {spec.shard_shape()} of {spec.full_shape}."
        )
    setattr(param, _SPEC_ATTR, spec)


def get_2p5d_spec(tensor: torch.Tensor) -> TesseractShardSpec | None:
    """The :class:`TesseractShardSpec` attached to ``tensor``, or ``None``."""
    spec = getattr(tensor, _SPEC_ATTR, None)
    return spec if isinstance(spec, TesseractShardSpec) else None


class ParallelModule2p5D(nn.Module):
    """Base of the 2.5D layers: owns :attr:`groups`, builds shards from full tensors, gathers
    full state (under the dense layer's names) and loads it back."""

    groups: Groups2p5D

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        marks = self._param_marks()
        memo[id(self.groups)] = self.groups
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        assert isinstance(new, ParallelModule2p5D)
        new._restore_param_marks(marks)  # Parameter.__deepcopy__ drops tensor attributes
        return new

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        marks = self._param_marks()  # load_state_dict(assign=True) replaces the Parameters
        super()._load_from_state_dict(*args, **kwargs)
        self._restore_param_marks(marks)

    def _param_marks(self) -> dict[str, TesseractShardSpec]:
        marks = {}
        for name, param in self._parameters.items():
            spec = None if param is None else get_2p5d_spec(param)
            if spec is not None:
                marks[name] = spec
        return marks

    def _restore_param_marks(self, marks: dict[str, TesseractShardSpec]) -> None:
        for name, spec in marks.items():
            param = self._parameters.get(name)
            if param is not None:
                setattr(param, _SPEC_ATTR, spec)

    def _shard(
        self,
        full: torch.Tensor,
        *,
        row_dim: int | None,
        col_dim: int | None,
        transposed: bool = False,
    ) -> nn.Parameter:
        """A parameter holding this rank's shard of ``full``, with its spec attached."""
        spec = TesseractShardSpec(
            full_shape=tuple(full.shape),
            row_dim=row_dim,
            col_dim=col_dim,
            transposed=transposed,
            groups=self.groups,
        )
        param = nn.Parameter(spec.slice(full.detach()))
        set_2p5d_spec(param, spec)
        return param

    def owned_parameters(self) -> dict[str, nn.Parameter]:
        """Parameters this layer owns (a tied weight belongs to the layer it came from)."""
        tied = getattr(self, "_tied", ())
        return {n: p for n, p in self._parameters.items() if p is not None and n not in tied}

    def full_state(self) -> dict[str, torch.Tensor]:
        """This layer's parameters at full size, by the dense layer's names and layouts.
        COLLECTIVE over the tensor group."""
        state = {}
        for name, param in self.owned_parameters().items():
            spec = get_2p5d_spec(param)
            state[name] = param.detach().clone() if spec is None else spec.gather(param)
        return state

    def load_full_state(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy this rank's shards out of full (dense) tensors, e.g. a dense layer's
        ``state_dict()`` or :meth:`full_state`. No communication.

        Raises:
            KeyError: ``strict`` and a parameter is missing from ``state``, or ``state`` has a
                key this layer does not own.
            ValueError: a tensor of the wrong full shape.
        """
        owned = self.owned_parameters()
        if strict:
            missing, unexpected = set(owned) - set(state), set(state) - set(owned)
            if missing or unexpected:
                raise KeyError(
                    f"{type(self).__name__}.load_full_state: missing {sorted(missing)}, "
                    f"unexpected {sorted(unexpected)}; pass strict=False to load a subset."
                )
        with torch.no_grad():
            for name, param in owned.items():
                if name not in state:
                    continue
                spec = get_2p5d_spec(param)
                full = state[name].to(device=param.device, dtype=param.dtype)
                param.copy_(full if spec is None else spec.slice(full))
