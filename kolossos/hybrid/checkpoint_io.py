"""``HybridParallelCheckpointIO``: portable checkpoints of tensor-parallel (+ DDP/ZeRO) training.

Files are the same as every other plugin's: a model checkpoint is a Hugging Face state dict of
*full* tensors (``from_pretrained`` loads it), an optimizer checkpoint is the name-keyed format
of ``docs/checkpoint.md`` with full per-parameter states. So a run saved at ``tp 2 x dp 2``
resumes at ``tp 4``, in one process, or under any other plugin.

Saving, tensor by tensor (peak memory: one full tensor beyond the model):

1. the data-parallel step: with ZeRO the fp32 master of this rank's TP shard is gathered from
   the partitions to data-parallel rank 0; without ZeRO every DP rank already holds it;
2. the tensor-parallel step: the ranks of data-parallel rank 0 gather the shards into the full
   tensor (``gather_tp_full``, which undoes fused blocks and vocabulary padding);
3. global rank 0 writes it (streamed into shard files by the base class).

Loading is local: every rank reads the full tensors and cuts its TP shard (``slice_tp_shard``),
then its ZeRO partition, without communication.

The optimizer wrappers of the engine implement one interface for both steps,
:class:`~kolossos.interface.ParamStateOwner`; the engine's
:class:`~kolossos.interface.ParamOwners` registry finds the one managing a parameter.

With pipeline parallelism the plugin uses the subclass
:class:`~kolossos.hybrid.pipeline_checkpoint_io.PipelineCheckpointIO`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.accelerator import get_accelerator
from kolossos.checkpoint_io.checkpoint_io_base import CheckpointIO
from kolossos.checkpoint_io.optim_format import load_group_hyperparameters
from kolossos.checkpoint_io.param_names import positional_name
from kolossos.checkpoint_io.read_plan import ReadPlan, Selector, narrow_selector
from kolossos.checkpoint_io.state_check import ModelLayout
from kolossos.hybrid.optimizer import HYBRID_OPTIMIZERS
from kolossos.interface import ParamOwners, ParamStateOwner, unwrap_model
from kolossos.nn.layer.parallel_1d.sharding import (
    TPShardSpec,
    gather_tp_full,
    get_tp_spec,
    slice_tp_shard,
    tp_shard_pieces,
)
from kolossos.pipeline.shared import is_pp_duplicate

__all__ = ["HybridParallelCheckpointIO"]


def _full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    spec = get_tp_spec(tensor)
    return spec.full_shape if spec is not None else tuple(tensor.shape)


def _gather(tensor: torch.Tensor, spec: TPShardSpec) -> torch.Tensor:
    """``gather_tp_full`` from wherever ``tensor`` lives (NCCL cannot gather CPU tensors, e.g.
    ZeRO's offloaded masters: they travel through the accelerator and come back)."""
    backend = str(dist.get_backend(spec.group)).lower()
    if tensor.device.type != "cpu" or "gloo" in backend:
        return gather_tp_full(tensor, spec)
    device = get_accelerator().get_current_device()
    return gather_tp_full(tensor.to(device), spec).cpu()


def _is_shard_state(key: str, value: Any, param: torch.Tensor) -> bool:
    """Whether an optimizer state value is laid out like the parameter (so it is sharded)."""
    return key != "step" and isinstance(value, torch.Tensor) and value.shape == param.shape


class HybridParallelCheckpointIO(CheckpointIO):
    """Checkpoint IO of :class:`~kolossos.booster.plugin.HybridParallelPlugin` (module doc).

    Args:
        dp_group: the data-parallel group.
        tp_group: the tensor-parallel group.
        owners: the optimizer managing each parameter's master copy (the engine's registry).
    """

    def __init__(
        self,
        dp_group: dist.ProcessGroup | None,
        tp_group: dist.ProcessGroup | None,
        owners: ParamOwners,
    ) -> None:
        super().__init__(None)  # the whole job synchronises; global rank 0 writes
        self.dp_group = dp_group
        self.tp_group = tp_group
        self.owners = owners

    def _dp_rank(self) -> int:
        return dist.get_rank(self.dp_group) if dist.is_initialized() else 0

    def _tp_rank(self) -> int:
        return dist.get_rank(self.tp_group) if dist.is_initialized() else 0

    # ------------------------------------------------------------------ model
    def _local_value(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """This rank's TP shard at master precision, on DP rank 0 (``None`` elsewhere)."""
        owner = self.owners.owner_of(tensor)
        # ZeRO: a collective of the DP group (every DP rank calls it; DP rank 0 receives)
        value = tensor.detach() if owner is None else owner.full_param(tensor, dst=0)
        return value if self._dp_rank() == 0 else None

    def model_state_items(
        self, model: nn.Module, gather_dtensor: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors in state-dict order (a collective; global rank 0 receives them)."""
        _require_gather(gather_dtensor)
        module = unwrap_model(model)
        state = module.state_dict(keep_vars=True)
        uses: dict[torch.Tensor, int] = {}
        for value in state.values():
            uses[value] = uses.get(value, 0) + 1
        done: dict[torch.Tensor, torch.Tensor | None] = {}  # tied tensors: gathered once
        for name, value in state.items():
            if value not in done:
                local = self._local_value(value)
                spec = get_tp_spec(value)
                # DP rank != 0 took part in the ZeRO gather only; DP rank 0 gathers over TP.
                if local is not None and spec is not None:
                    local = _gather(local, spec)
                done[value] = local
            uses[value] -= 1
            full = done[value] if uses[value] else done.pop(value)  # keep only what recurs
            if full is not None and self.is_writer():
                yield name, full
            del full

    def model_layout(self, model: nn.Module) -> ModelLayout:
        """Names and *full* shapes of the model's state dict (+ tied names)."""
        state = unwrap_model(model).state_dict(keep_vars=True)
        local = ModelLayout.of_state_dict(state)
        return ModelLayout({n: _full_shape(t) for n, t in state.items()}, local.aliases)

    def model_read_plan(self, model: nn.Module) -> ReadPlan:
        """Read only this rank's tensor-parallel slice of each sharded tensor."""
        state = unwrap_model(model).state_dict(keep_vars=True)
        return self._tp_selectors(state.items())

    def _tp_selectors(self, items: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Selector]:
        plan: dict[str, Selector] = {}
        for name, target in items:
            spec = get_tp_spec(target)
            if spec is not None:
                pieces, pad = tp_shard_pieces(spec, self._tp_rank())
                plan[name] = narrow_selector(pieces, pad)
        return plan

    def load_model_piece(self, model: nn.Module, piece: dict[str, torch.Tensor]) -> None:
        """Load this rank's TP shard of each tensor (read as :meth:`model_read_plan` selects,
        or cut here from a full tensor) into the working weights and, at full precision, the
        master copy."""
        module = unwrap_model(model)
        targets = module.state_dict(keep_vars=True)
        self._load_pairs([(name, targets[name]) for name in piece], piece, module)

    def _load_pairs(
        self,
        pairs: list[tuple[str, torch.Tensor]],
        piece: dict[str, torch.Tensor],
        module: nn.Module | None,
    ) -> None:
        """Load ``piece[name]`` into each ``(name, target)``; replicated entries go through
        ``module.load_state_dict`` (buffers, hooks) when ``module`` is given, else are copied."""
        rest = {}
        with torch.no_grad():
            for name, target in pairs:
                full = piece[name]
                spec = get_tp_spec(target)
                value = full
                if spec is not None and tuple(full.shape) == spec.full_shape:
                    value = slice_tp_shard(full, spec, self._tp_rank())
                owner = self.owners.owner_of(target)
                if owner is not None:
                    owner.load_full_param(target, value.to(target.device))
                elif spec is not None or module is None:
                    target.copy_(value)
                else:
                    rest[name] = value
        if rest and module is not None:
            module.load_state_dict(rest, strict=False)

    # ------------------------------------------------------------------ optimizer
    def _owner(self, optimizer: Any) -> ParamStateOwner:
        """``optimizer`` if the engine built it (it owns its parameters' states).

        Raises:
            TypeError: any other optimizer.
        """
        if not isinstance(optimizer, HYBRID_OPTIMIZERS):
            raise TypeError(
                "HybridParallelCheckpointIO saves and loads the optimizer returned by "
                f"booster.boost with HybridParallelPlugin, got {type(optimizer).__name__}."
            )
        owner: ParamStateOwner = optimizer
        return owner

    def optimizer_param_names(self, optimizer: Any) -> list[list[str]]:
        """The model's parameter names (set at ``boost``), else positional names."""
        opt = self._owner(optimizer)
        return [
            [opt.param_name(p) or positional_name(g, j) for j, p in enumerate(group)]
            for g, group in enumerate(opt.groups)
        ]

    def optimizer_param_shapes(
        self, optimizer: Any, names: list[list[str]]
    ) -> dict[str, tuple[int, ...]]:
        """The parameters' full (unsharded) shapes."""
        opt = self._owner(optimizer)
        return {
            name: _full_shape(p)
            for group, group_names in zip(opt.groups, names, strict=True)
            for p, name in zip(group, group_names, strict=True)
        }

    def optimizer_state_items(
        self, optimizer: Any, names: list[list[str]], gather_dtensor: bool
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Each parameter's full states (DP gather, then TP gather; a collective)."""
        _require_gather(gather_dtensor)
        for name, full in self._stage_state_items(optimizer, names):
            if self.is_writer():
                yield name, full

    def _stage_state_items(
        self, optimizer: Any, names: list[list[str]]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Full states of this rank's parameters, yielded on its DP 0 / TP 0 rank (a collective
        of the DP and TP groups); tied copies another stage saves are skipped."""
        opt = self._owner(optimizer)
        dp_root = self._dp_rank() == 0
        for g, i, state in opt.full_param_states(dst=0):
            if not dp_root:
                continue  # no-ZeRO wrappers yield on every DP rank; only DP rank 0 gathers
            param = opt.groups[g][i]
            if is_pp_duplicate(param):
                continue
            spec = get_tp_spec(param)
            full = {
                key: _gather(value, spec)
                if spec is not None and _is_shard_state(key, value, param)
                else value
                for key, value in state.items()
            }
            if self._tp_rank() == 0:
                yield names[g][i], full

    def load_optimizer_state(
        self,
        optimizer: Any,
        names: list[list[str]],
        header: dict[str, Any],
        states: Iterator[tuple[str, dict[str, Any]]],
        mapping: dict[str, str],
    ) -> None:
        """Hyper-parameters per group, then each parameter's states cut to this rank's TP shard
        (and ZeRO partition) as they stream in."""
        opt = self._owner(optimizer)
        load_group_hyperparameters(opt.unwrap(), names, header, mapping)
        position = {n: (g, i) for g, group in enumerate(names) for i, n in enumerate(group)}
        tp_rank = self._tp_rank()

        def sliced() -> Iterator[tuple[int, int, dict[str, Any]]]:
            for name, state in states:
                if name not in mapping:
                    continue
                g, i = position[mapping[name]]
                spec = get_tp_spec(opt.groups[g][i])
                yield g, i, {k: _cut(k, v, spec, tp_rank) for k, v in state.items()}

        opt.load_param_states(sliced())


def _require_gather(gather_dtensor: bool) -> None:
    if not gather_dtensor:
        raise NotImplementedError(
            "gather_dtensor=False (each rank writing its own tensor-parallel shards) is not "
            "supported by HybridParallelCheckpointIO; save with gather_dtensor=True (full "
            "tensors, loadable at any tp_size)."
        )


def _cut(key: str, value: Any, spec: TPShardSpec | None, rank: int) -> Any:
    """This rank's shard of a full optimizer state value (others are replicated)."""
    if (
        spec is None
        or key == "step"
        or not isinstance(value, torch.Tensor)
        or tuple(value.shape) != spec.full_shape
    ):
        return value
    return slice_tp_shard(value, spec, rank)
