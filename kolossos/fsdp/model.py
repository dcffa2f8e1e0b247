"""``TorchFSDPModel``: the model ``TorchFSDPPlugin`` returns, with FSDP1's state-dict manners.

FSDP2 shards parameters as ``DTensor``\\ s, and the sharded module's own ``state_dict`` holds
them. Colossal-AI's FSDP1-based plugin handed back full tensors (FSDP1's default
``FULL_STATE_DICT``) and took them back in ``load_state_dict``; scripts compare and reload such
dicts. The wrapper keeps those manners: its ``state_dict`` gathers each entry into a full plain
tensor (COLLECTIVE), its ``load_state_dict`` takes full plain tensors (or shards) and keeps this
rank's part. The wrapped module (``model.unwrap()``) is plain FSDP2: its dicts hold ``DTensor``\\ s.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from kolossos.fsdp.checkpoint_io import shard_like
from kolossos.interface import ModelWrapper

__all__ = ["TorchFSDPModel"]


class TorchFSDPModel(ModelWrapper):
    """The model returned by ``TorchFSDPPlugin``: ``module`` is the user's module, sharded in
    place by ``fully_shard`` (its parameters are ``DTensor`` shards).

    Example:
        >>> full = model.state_dict()  # COLLECTIVE: full tensors on every rank  # doctest: +SKIP
        >>> model.load_state_dict(full)  # each rank keeps its shard  # doctest: +SKIP
    """

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Every entry as a full plain tensor on every rank (COLLECTIVE: each sharded entry is
        all-gathered), as FSDP1's ``FULL_STATE_DICT``; ``keep_vars=True`` keeps the ``DTensor``
        parameters themselves."""
        state = super().state_dict(*args, **kwargs)
        if kwargs.get("keep_vars"):
            return state
        out = OrderedDict()
        for name, value in state.items():
            full = getattr(value, "full_tensor", None)
            out[name] = full() if callable(full) else value  # SYNC POINT: all-gather
        return out

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load full plain tensors (or this rank's ``DTensor`` shards): each full value is cut
        to this rank's shard first. No communication."""
        targets = super().state_dict(keep_vars=True)
        placed = {
            name: shard_like(value, targets[name])
            if name in targets and isinstance(value, torch.Tensor)
            else value
            for name, value in state_dict.items()
        }
        return super().load_state_dict(placed, strict=strict, assign=assign)
