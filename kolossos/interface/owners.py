"""``ParamOwners``: which optimizer wrapper owns the master copy of each model parameter.

A plugin registers every optimizer it builds and hands the registry to its checkpoint IO, so
saving a model reads fp32 masters instead of rounded working weights, and loading one updates
both. The registry belongs to the plugin instance: two plugins (or two Boosters) in one process
never see each other's entries. References are weak in both directions.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from kolossos.interface.protocols import ParamStateOwner

__all__ = ["ParamOwners"]


class ParamOwners:
    """A weak ``{model parameter: owning optimizer}`` map.

    Example:
        >>> owners = ParamOwners()
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> owners.owner_of(p) is None
        True
    """

    def __init__(self) -> None:
        self._refs: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def register(self, owner: ParamStateOwner, params: Iterable[torch.Tensor]) -> None:
        """Record ``owner`` as the owner of ``params`` (a later registration wins)."""
        ref = weakref.ref(owner)
        for param in params:
            self._refs[param] = ref

    def owner_of(self, tensor: torch.Tensor) -> ParamStateOwner | None:
        """The live owner of ``tensor``, or ``None``."""
        ref = self._refs.get(tensor)
        owner: ParamStateOwner | None = ref() if ref is not None else None
        return owner

    def __call__(self, tensor: torch.Tensor) -> ParamStateOwner | None:
        return self.owner_of(tensor)
