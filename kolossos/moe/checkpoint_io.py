"""``MoeCheckpointIO``: model checkpoints of expert-parallel training in the Hugging Face layout.

A model checkpoint holds *all* experts as Hugging Face stores them (Mixtral / Qwen2-MoE fused
tensors ``...mlp.experts.gate_up_proj [E, 2I, H]`` and ``...down_proj [E, H, I]``), so
``from_pretrained`` loads it and a run at any ``ep_size`` (or none) resumes from it:

* saving: an expert tensor's master value is gathered from its ZeRO partitions to the first rank
  of its expert data-parallel group, then the ranks of the first expert-parallel group
  concatenate their experts along dim 0 (``all_gather``), in global expert order, and global rank
  0 writes the result. Dense tensors follow :class:`~kolossos.hybrid.HybridParallelCheckpointIO`.
* loading: every rank reads the full tensor and keeps rows ``[ep_rank * E_local, ...)``.

Optimizer checkpoints are keyed by parameter name with full shapes, so they reshard like the
model: an expert's states (``exp_avg`` ... of shape ``[E_local, ...]``) are gathered from the
ZeRO partitions of its expert DP group and concatenated over the first expert-parallel group
into ``[E, ...]``; loading keeps this rank's rows and hands each parameter's states to the
optimizer that owns it (the one optimizer with ``zero_stage=0``; the dense or the expert ZeRO
optimizer). With pipeline stages (``pp_size > 1``) model and optimizer checkpoints are refused
(``NotImplementedError``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.checkpoint_io.optim_format import load_group_hyperparameters
from kolossos.checkpoint_io.state_check import ModelLayout
from kolossos.hybrid.checkpoint_io import HybridParallelCheckpointIO
from kolossos.interface import ParamOwners, ParamStateOwner, unwrap_model
from kolossos.moe.hybrid_optimizer import MoeDDPOptimizer, MoeZeroOptimizer
from kolossos.moe.params import moe_info_of

__all__ = ["MoeCheckpointIO"]

_NO_PIPELINE = (
    "checkpoints of MoeHybridParallelPlugin with pp_size > 1 are not implemented; save and load "
    "at pp_size=1 (expert x data parallelism, any ep_size)."
)

#: (owner, its parameters' names group by group, for each of its groups the user's group)
_Part = tuple[ParamStateOwner, list[list[str]], list[int]]


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
        pipelined: bool = False,
    ) -> None:
        super().__init__(dp_group, tp_group, owners)
        self.moe_info = moe_info
        self.pipelined = pipelined

    def _refuse_pipeline(self) -> None:
        if self.pipelined:
            raise NotImplementedError(_NO_PIPELINE)

    def model_state_items(
        self, model: nn.Module, gather_dtensor: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors, experts in the Hugging Face layout (a collective; rank 0 receives).

        Raises:
            NotImplementedError: with pipeline stages.
        """
        self._refuse_pipeline()
        return super().model_state_items(model, gather_dtensor)

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
        self._refuse_pipeline()
        targets = unwrap_model(model).state_dict(keep_vars=True)
        cut = dict(piece)
        for name, value in piece.items():
            info = moe_info_of(targets[name])
            if info is not None and value.shape[0] != targets[name].shape[0]:
                per = targets[name].shape[0]
                cut[name] = value[info.ep_rank * per : (info.ep_rank + 1) * per]
        super().load_model_piece(model, cut)

    # ------------------------------------------------------------------ optimizer
    def _parts(self, optimizer: Any) -> list[_Part]:
        """The optimizers owning the parameters' states, with names and user groups.

        Raises:
            NotImplementedError: with pipeline stages.
            TypeError: not an optimizer returned by ``booster.boost`` with this plugin.
        """
        self._refuse_pipeline()
        owners: list[tuple[ParamStateOwner, list[int]]]
        if isinstance(optimizer, MoeDDPOptimizer):
            owners = [(optimizer.base, list(range(len(optimizer.base.groups))))]
        elif isinstance(optimizer, MoeZeroOptimizer):
            dense = optimizer.dense
            owners = [(dense, list(range(len(dense.groups)))), (optimizer.expert, optimizer.origin)]
        else:
            raise TypeError(
                "MoeCheckpointIO saves and loads the optimizer returned by booster.boost with "
                f"MoeHybridParallelPlugin, got {type(optimizer).__name__}."
            )
        parts = []
        for owner, user_groups in owners:
            names = [
                [
                    owner.param_name(p) or f"{type(owner).__name__}.{g}.{j}"
                    for j, p in enumerate(group)
                ]
                for g, group in enumerate(owner.groups)
            ]
            parts.append((owner, names, user_groups))
        return parts

    def optimizer_param_names(self, optimizer: Any) -> list[list[str]]:
        """Parameter names per user group: dense and expert parameters alike."""
        parts = self._parts(optimizer)
        out: list[list[str]] = [[] for _ in optimizer.unwrap().param_groups]
        for _, names, user_groups in parts:
            for group_names, g in zip(names, user_groups, strict=True):
                out[g].extend(group_names)
        return out

    def optimizer_param_shapes(
        self, optimizer: Any, names: list[list[str]]
    ) -> dict[str, tuple[int, ...]]:
        """Full shapes: experts with all ``E`` experts on dim 0."""
        return {
            name: _full_expert_shape(p)
            for owner, owner_names, _ in self._parts(optimizer)
            for group, group_names in zip(owner.groups, owner_names, strict=True)
            for p, name in zip(group, group_names, strict=True)
        }

    def optimizer_state_items(
        self, optimizer: Any, names: list[list[str]], gather_dtensor: bool
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Each parameter's full state (a collective: ZeRO gathers, then the experts over the
        first expert-parallel group); yielded on the writer."""
        for owner, owner_names, _ in self._parts(optimizer):
            for g, i, state in owner.full_param_states(dst=0):
                param = owner.groups[g][i]
                info = moe_info_of(param)
                if info is None:
                    if self._dp_rank() == 0 and self.is_writer():
                        yield owner_names[g][i], state
                    continue
                if info.dp_group is not None and dist.get_rank(info.dp_group) != 0:
                    continue  # only the first expert-parallel group gathers
                full = {k: self._gather_experts(v, param, k) for k, v in state.items()}
                if self.is_writer():
                    yield owner_names[g][i], full

    @staticmethod
    def _gather_experts(value: Any, param: torch.Tensor, key: str) -> Any:
        """``value`` concatenated over the expert-parallel group when it is per expert."""
        info = moe_info_of(param)
        if not _per_expert(value, param, key) or info is None or info.ep_group is None:
            return value
        parts = [torch.empty_like(value) for _ in range(info.ep_size)]
        dist.all_gather(parts, value.contiguous(), group=info.ep_group)  # SYNC POINT
        return torch.cat(parts, dim=0)

    def load_optimizer_state(
        self,
        optimizer: Any,
        names: list[list[str]],
        header: dict[str, Any],
        states: Iterator[tuple[str, dict[str, Any]]],
        mapping: dict[str, str],
    ) -> None:
        """Hyper-parameters per user group, then each parameter's state (experts cut to this
        rank's rows) to the optimizer owning it (no communication)."""
        parts = self._parts(optimizer)
        load_group_hyperparameters(optimizer.unwrap(), names, header, mapping)
        position = {
            name: (k, g, i)
            for k, (_, owner_names, _) in enumerate(parts)
            for g, group_names in enumerate(owner_names)
            for i, name in enumerate(group_names)
        }
        items: list[list[tuple[int, int, dict[str, Any]]]] = [[] for _ in parts]
        for name, state in states:
            if name not in mapping:
                continue
            k, g, i = position[mapping[name]]
            param = parts[k][0].groups[g][i]
            items[k].append((g, i, {key: _cut_experts(v, param, key) for key, v in state.items()}))
        for (owner, _, _), owned in zip(parts, items, strict=True):
            owner.load_param_states(owned)


def _per_expert(value: Any, param: torch.Tensor, key: str) -> bool:
    """Whether an optimizer state value has one row block per local expert."""
    return (
        key != "step"
        and isinstance(value, torch.Tensor)
        and value.dim() > 0
        and value.shape[1:] == param.shape[1:]
        and value.dim() == param.dim()
    )


def _cut_experts(value: Any, param: torch.Tensor, key: str) -> Any:
    """This rank's rows of a full (all experts) state value."""
    info = moe_info_of(param)
    if info is None or not _per_expert(value, param, key) or value.shape[0] == param.shape[0]:
        return value
    per = param.shape[0]
    return value[info.ep_rank * per : (info.ep_rank + 1) * per]
