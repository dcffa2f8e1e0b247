"""What every 3D layer shares: its groups, building parameter shards from full tensors (or from
a Colossal-AI style initializer), and gathering / loading the dense state."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kolossos.nn.layer.parallel_3d.groups import Groups3D
from kolossos.nn.layer.parallel_3d.sharding import (
    MARK_ATTR_3D,
    Shard3DSpec,
    gather_3d_full,
    get_3d_spec,
    set_3d_spec,
    slice_3d_shard,
)

__all__ = ["Initializer", "ParallelModule3D", "Splits", "check_groups"]

Initializer = Callable[..., Any]
"""``initializer(tensor, fan_in=..., fan_out=...)`` filling ``tensor`` in place
(Colossal-AI's ``colossalai.nn.init`` style)."""

Splits = tuple[tuple[int, str], ...]
"""``(dim, role)`` pairs, outermost first; ``role`` names a :class:`Groups3D` group."""


def check_groups(owner: str, groups: object) -> Groups3D:
    """``groups`` if it is a :class:`Groups3D`.

    Raises:
        TypeError: it is not.
    """
    if not isinstance(groups, Groups3D):
        raise TypeError(
            f"{owner}: groups={groups!r} must be a Groups3D (kolossos.nn.layer.parallel_3d."
            "build_groups_3d(), or the previous layer's output_groups)."
        )
    return groups


class ParallelModule3D(nn.Module):
    """Base of the 3D layers.

    Attributes:
        groups: the groups of the input's layout.
        output_groups: the groups of the output's layout (:meth:`Groups3D.swapped` after a
            linear layer, else :attr:`groups`).
    """

    groups: Groups3D
    output_groups: Groups3D

    def _init_groups(self, groups: object, *, swaps: bool = False) -> Groups3D:
        self.groups = check_groups(type(self).__name__, groups)
        self.output_groups = self.groups.swapped() if swaps else self.groups
        self.depth = self.groups.depth
        return self.groups

    # ------------------------------------------------------------------ building
    def _spec(
        self, stored_shape: tuple[int, ...], splits: Splits, transposed: bool = False
    ) -> Shard3DSpec:
        groups = self.groups
        replicas = groups.size
        for _, role in splits:
            replicas //= dist.get_world_size(getattr(groups, role))
        pairs = tuple((dim, getattr(groups, role)) for dim, role in splits)
        dense = tuple(reversed(stored_shape)) if transposed else stored_shape
        return Shard3DSpec(full_shape=dense, splits=pairs, replicas=replicas, transposed=transposed)

    def _shard(
        self,
        full: torch.Tensor,
        splits: Splits,
        requires_grad: bool = True,
        *,
        transposed: bool = False,
    ) -> nn.Parameter:
        """A parameter holding this rank's block of ``full`` (in the stored layout: the dense
        tensor's transpose when ``transposed``), with its spec attached."""
        spec = self._spec(tuple(full.shape), splits, transposed)
        param = nn.Parameter(slice_3d_shard(full.detach(), spec), requires_grad=requires_grad)
        set_3d_spec(param, spec)
        return param

    def _initialized(
        self,
        full_shape: tuple[int, ...],
        splits: Splits,
        initializer: Initializer,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        **fans: int,
    ) -> nn.Parameter:
        """A parameter holding this rank's block of a full tensor filled by ``initializer``
        (Colossal-AI's ``initializer(tensor, fan_in=..., fan_out=...)``) from the default
        generator: the same seed gives the same full tensor on every rank and in every mode,
        as the dense layer would get; no communication.

        Raises:
            TypeError: ``initializer`` is not callable.
        """
        full = self._initial_full(full_shape, initializer, device, dtype, **fans)
        return self._shard(full, splits)

    def _initial_full(
        self,
        full_shape: tuple[int, ...],
        initializer: Initializer,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        **fans: int,
    ) -> torch.Tensor:
        """The full tensor :meth:`_initialized` cuts its block from.

        Raises:
            TypeError: ``initializer`` is not callable.
        """
        if not callable(initializer):
            raise TypeError(
                f"{type(self).__name__}: initializer {initializer!r} must be a callable "
                "initializer(tensor, fan_in=..., fan_out=...)."
            )
        full = torch.empty(full_shape, device=device, dtype=dtype)
        with torch.no_grad():
            initializer(full, **fans)
        return full

    # ------------------------------------------------------------------ dense state
    def _to_dense(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """A gathered parameter in the dense layer's layout (subclasses transpose here)."""
        return full

    def _from_dense(self, name: str, dense: torch.Tensor) -> torch.Tensor:
        """A dense layer's tensor in this layer's stored layout (inverse of :meth:`_to_dense`)."""
        return dense

    def full_parameter(self, name: str) -> torch.Tensor:
        """The full value of parameter ``name`` in the dense layer's layout. COLLECTIVE over the
        cube when the parameter is split."""
        param = self.get_parameter(name)
        spec = get_3d_spec(param)
        full = param.detach().clone() if spec is None else gather_3d_full(param.detach(), spec)
        return self._to_dense(name, full)

    def full_weight(self) -> torch.Tensor:
        """The full weight in the dense layer's layout. COLLECTIVE over the cube."""
        return self.full_parameter("weight")

    def full_state(self) -> dict[str, torch.Tensor]:
        """This layer's parameters and buffers (not its children's) at full size under the
        dense layer's names and layouts, loadable by the dense layer. COLLECTIVE over the cube.
        """
        state = {
            name: self.full_parameter(name) for name, _ in self.named_parameters(recurse=False)
        }
        for name, buffer in self.named_buffers(recurse=False):
            state[name] = buffer.detach().clone()
        return state

    @torch.no_grad()
    def load_full_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy this rank's blocks out of a dense state (the dense layer's names, e.g. an
        ``nn.Linear``'s ``state_dict()``); no communication.

        Raises:
            KeyError: a parameter is missing from ``state``.
            ValueError: a tensor does not have the full shape.
        """
        for name, param in self.named_parameters(recurse=False):
            if name not in state:
                raise KeyError(f"{type(self).__name__}.load_full_state: no {name!r} in the state.")
            value = self._from_dense(name, state[name].to(param.device, param.dtype))
            spec = get_3d_spec(param)
            param.copy_(value if spec is None else slice_3d_shard(value, spec))

    # ------------------------------------------------------------------ copies
    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        # torch's Parameter.__deepcopy__ drops tensor attributes: carry the specs over.
        specs = {n: get_3d_spec(p) for n, p in self._parameters.items() if p is not None}
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        new._put_specs(specs)
        return new

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        # load_state_dict(assign=True) puts new Parameter objects in place: keep the specs.
        specs = {n: get_3d_spec(p) for n, p in self._parameters.items() if p is not None}
        super()._load_from_state_dict(*args, **kwargs)
        self._put_specs(specs)

    def _put_specs(self, specs: Mapping[str, Shard3DSpec | None]) -> None:
        for name, spec in specs.items():
            param = self._parameters.get(name)
            if param is not None and spec is not None:
                setattr(param, MARK_ATTR_3D, spec)
