"""What every 2D layer shares: the grid, building blocks from full (dense) tensors, and gathering
them back under the dense module's names."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from kolossos.nn.layer.parallel_2d.grid import Groups2D
from kolossos.nn.layer.parallel_2d.sharding import (
    MARK_2D_ATTRS,
    Shard2DSpec,
    gather_2d_full,
    get_2d_spec,
    set_2d_spec,
    slice_2d_shard,
)

__all__ = ["Initializer", "ParallelModule2D", "check_groups", "init_full"]

Initializer = Callable[..., Any]
"""Colossal-AI's ``initializer(tensor, fan_in=..., fan_out=...)``, filling ``tensor`` in place."""


def check_groups(owner: str, groups: object) -> Groups2D:
    """``groups`` if it is a :class:`Groups2D`.

    Raises:
        TypeError: anything else.
    """
    if not isinstance(groups, Groups2D):
        raise TypeError(
            f"{owner}: groups={groups!r} must be a Groups2D(row=..., col=...) holding this rank's "
            "row and column process groups of the SUMMA grid."
        )
    return groups


def init_full(tensor: torch.Tensor, initializer: Initializer | None, **fans: int) -> torch.Tensor:
    """Apply a user ``initializer`` to a full tensor (in place) and return it; ``None`` keeps
    the tensor as it is (the dense module's own initialisation).

    The full tensor is drawn on every rank from the default generator, which ``kolossos.launch``
    seeds alike on every rank, so every rank draws the same full tensor and keeps its block: the
    same matrix as a dense layer initialised after the same seed.

    Raises:
        TypeError: ``initializer`` is not callable.
    """
    if initializer is None:
        return tensor
    if not callable(initializer):
        raise TypeError(
            f"initializer {initializer!r} must be a callable initializer(tensor, fan_in=..., "
            "fan_out=...), or None for the dense layer's initialisation."
        )
    with torch.no_grad():
        initializer(tensor, **fans)
    return tensor


class ParallelModule2D(nn.Module):
    """Base of the 2D layers: owns :attr:`groups`, makes parameters from full tensors, gathers
    them back (:meth:`full_state`) and loads dense state dicts (:meth:`load_full_state`)."""

    groups: Groups2D

    def _init_groups(self, groups: object) -> None:
        self.groups = check_groups(type(self).__name__, groups)
        self.summa_dim = self.groups.q
        self.row_rank, self.col_rank = self.groups.row_index, self.groups.col_index

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        # torch's Parameter.__deepcopy__ drops tensor attributes: carry the block specs over.
        marks = self._param_marks()
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        assert isinstance(new, ParallelModule2D)
        new._restore_param_marks(marks)
        return new

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        # load_state_dict(assign=True) puts new Parameter objects in place: keep the specs.
        marks = self._param_marks()
        super()._load_from_state_dict(*args, **kwargs)
        self._restore_param_marks(marks)

    def _param_marks(self) -> dict[str, dict[str, Any]]:
        return {
            name: {k: v for k, v in vars(p).items() if k in MARK_2D_ATTRS}
            for name, p in self._parameters.items()
            if p is not None
        }

    def _restore_param_marks(self, marks: dict[str, dict[str, Any]]) -> None:
        for name, attrs in marks.items():
            param = self._parameters.get(name)
            if param is not None:
                for key, value in attrs.items():
                    setattr(param, key, value)

    def _block(
        self,
        full: torch.Tensor,
        splits: tuple[tuple[int, str], ...],
        *,
        transposed: bool = False,
    ) -> nn.Parameter:
        """A parameter holding this rank's block of ``full``, with its :class:`Shard2DSpec`."""
        spec = Shard2DSpec(
            full_shape=tuple(full.shape), splits=splits, transposed=transposed, groups=self.groups
        )
        param = nn.Parameter(slice_2d_shard(full.detach(), spec))
        set_2d_spec(param, spec)
        return param

    def full_parameter(self, param: torch.Tensor) -> torch.Tensor:
        """The full value of one of this layer's parameters. COLLECTIVE over the grid when
        ``param`` is a block."""
        spec = get_2d_spec(param)
        if spec is None:
            return param.detach().clone()
        return gather_2d_full(param.detach(), spec)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of this layer (not of its children) at full size, under
        the dense module's names and layouts (``Linear2D.weight`` as ``[out, in]``), ready for
        the dense module's ``load_state_dict``. COLLECTIVE over the grid."""
        state = {name: self.full_parameter(p) for name, p in self.named_parameters(recurse=False)}
        for name, buffer in self.named_buffers(recurse=False):
            state[name] = buffer.detach().clone()
        return state

    def load_full_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a dense state dict (the dense module's names and shapes, e.g. from
        :meth:`full_state` or a Hugging Face checkpoint): each rank copies its block. No
        communication.

        Raises:
            KeyError: a parameter of this layer is missing from ``state``.
            ValueError: a tensor has the wrong full shape.
        """
        with torch.no_grad():
            for name, param in self.named_parameters(recurse=False):
                if name not in state:
                    raise KeyError(
                        f"{type(self).__name__}.load_full_state: no entry {name!r} in the state "
                        f"dict (keys: {sorted(state)})."
                    )
                full = state[name]
                spec = get_2d_spec(param)
                if spec is None:
                    if full.shape != param.shape:
                        raise ValueError(
                            f"{type(self).__name__}.load_full_state: {name!r} has shape "
                            f"{tuple(full.shape)}, expected {tuple(param.shape)}."
                        )
                    param.copy_(full)
                else:
                    param.copy_(slice_2d_shard(full.to(param.device), spec))
