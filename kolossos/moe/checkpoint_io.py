"""``MoeCheckpointIO``: model checkpoints of expert-parallel training in the Hugging Face layout.

A model checkpoint holds *all* experts as Hugging Face stores them (Mixtral / Qwen2-MoE fused
tensors ``...mlp.experts.gate_up_proj [E, 2I, H]`` and ``...down_proj [E, H, I]``), so
``from_pretrained`` loads it and a run at any ``ep_size`` (or none) resumes from it:

* saving: an expert tensor's master value is gathered from its ZeRO partitions to the first rank
  of its expert data-parallel group, then the ranks of the first expert-parallel group
  concatenate their experts along dim 0 (``all_gather``), in global expert order, and global rank
  0 writes the result. Dense tensors follow :class:`~kolossos.hybrid.HybridParallelCheckpointIO`.
* loading: every rank reads the full tensor and keeps rows ``[ep_rank * E_local, ...)``.

Optimizer checkpoints with expert parallelism are not implemented (a clear error).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.checkpoint_io.state_check import ModelLayout
from kolossos.hybrid.checkpoint_io import HybridParallelCheckpointIO
from kolossos.interface import ParamOwners, unwrap_model
from kolossos.moe.params import moe_info_of

__all__ = ["MoeCheckpointIO"]

_NO_OPTIM = (
    "optimizer checkpoints with expert parallelism are not implemented in this version; save "
    "and load the model (booster.save_model / load_model), which keeps the experts in the "
    "Hugging Face layout at any ep_size."
)


def _full_expert_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    info = moe_info_of(tensor)
    if info is None:
        return tuple(tensor.shape)
    return (tensor.shape[0] * info.ep_size, *tensor.shape[1:])


class MoeCheckpointIO(HybridParallelCheckpointIO):
    """Checkpoint IO of :class:`~kolossos.booster.plugin.MoeHybridParallelPlugin` (module doc).

    Args:
        dp_group: the data-parallel group.
        tp_group: the tensor-parallel group (one rank).
        owners: the optimizer managing each parameter (the engine's registry).
        moe_info: this rank's expert-parallel layout.
    """

    def __init__(
        self,
        dp_group: dist.ProcessGroup | None,
        tp_group: dist.ProcessGroup | None,
        owners: ParamOwners,
        moe_info: Any,
    ) -> None:
        super().__init__(dp_group, tp_group, owners)
        self.moe_info = moe_info

    def _local_value(self, tensor: torch.Tensor) -> torch.Tensor | None:
        info = moe_info_of(tensor)
        if info is None:
            return super()._local_value(tensor)
        owner = self.owners.owner_of(tensor)
        # ZeRO: a collective of the expert DP group; its rank 0 receives the master value
        value = tensor.detach() if owner is None else owner.full_param(tensor, dst=0)
        if info.dp_group is not None and dist.get_rank(info.dp_group) != 0:
            return None
        assert value is not None
        if info.ep_group is not None:  # COLLECTIVE over the first expert-parallel group
            parts = [torch.empty_like(value) for _ in range(info.ep_size)]
            dist.all_gather(parts, value.contiguous(), group=info.ep_group)
            value = torch.cat(parts, dim=0)
        return value if self._dp_rank() == 0 else None

    def model_layout(self, model: nn.Module) -> ModelLayout:
        """Names and full shapes (all experts) of the model's state dict."""
        layout = super().model_layout(model)
        state = unwrap_model(model).state_dict(keep_vars=True)
        shapes = {
            n: _full_expert_shape(state[n]) if n in state and moe_info_of(state[n]) else s
            for n, s in layout.shapes.items()
        }
        return ModelLayout(shapes, layout.aliases)

    def load_model_piece(self, model: nn.Module, piece: dict[str, torch.Tensor]) -> None:
        """Keep this rank's experts of each full expert tensor, then load as the hybrid IO."""
        targets = unwrap_model(model).state_dict(keep_vars=True)
        cut = dict(piece)
        for name, value in piece.items():
            info = moe_info_of(targets[name])
            if info is not None and value.shape[0] != targets[name].shape[0]:
                per = targets[name].shape[0]
                cut[name] = value[info.ep_rank * per : (info.ep_rank + 1) * per]
        super().load_model_piece(model, cut)

    def optimizer_state_items(
        self, optimizer: Any, names: list[list[str]], gather_dtensor: bool
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        raise NotImplementedError(_NO_OPTIM)

    def load_optimizer_state(
        self,
        optimizer: Any,
        names: list[list[str]],
        header: dict[str, Any],
        states: Iterator[tuple[str, dict[str, Any]]],
        mapping: dict[str, str],
    ) -> None:
        raise NotImplementedError(_NO_OPTIM)
