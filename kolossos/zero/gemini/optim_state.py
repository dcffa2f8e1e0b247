"""Full optimizer states of a :class:`GeminiOptimizer`, gathered chunk by chunk, and loading
them back into each rank's slices (used by checkpoint IO)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.nn.optimizer._adam_base import AdamBase
from kolossos.zero.gemini.chunk import Chunk
from kolossos.zero.gemini.full_tensors import gather_chunk_vector, local_range

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from kolossos.zero.gemini.chunk import ChunkManager

__all__ = ["ShardedStateIO"]


class ShardedStateIO:
    """Mixin of :class:`~kolossos.zero.gemini.gemini_optimizer.GeminiOptimizer`."""

    optim: Optimizer
    manager: ChunkManager
    slices: list[tuple[Chunk, int, int, nn.Parameter, nn.Parameter]]
    _names: dict[nn.Parameter, str]

    def _view_state(self, view: nn.Parameter | None) -> dict[str, Any]:
        """The optimizer state of one master view, NVMe-streamed parts read back from disk."""
        if view is None:
            return {}
        state = dict(self.optim.state.get(view, {}))
        if state and isinstance(self.optim, AdamBase):
            state.update(self.optim.streamed_state(view))
        return state

    def _state_keys(self) -> tuple[list[str], list[str]]:
        """(per-element state names, scalar state names), the same on every rank
        (COLLECTIVE when distributed: ranks may hold states of different parameters)."""
        elem: set[str] = set()
        scalar: set[str] = set()
        for *_, view in self.slices:
            for key, value in self._view_state(view).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    elem.add(key)
                elif isinstance(value, (torch.Tensor, int, float)):
                    scalar.add(key)
        if dist.is_initialized() and self.manager.world_size > 1:
            everyone: list[Any] = [None] * self.manager.world_size
            dist.all_gather_object(everyone, (sorted(elem), sorted(scalar)), self.manager.group)
            elem = {k for e, _ in everyone for k in e}
            scalar = {k for _, s in everyone for k in s}
        return sorted(elem), sorted(scalar)

    def full_state_items(
        self, names: Iterable[str] | None = None
    ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """``(parameter name, {"step": ..., "exp_avg": full, ...})`` for every stepped parameter
        (those in ``names`` when given), chunk by chunk. COLLECTIVE on every rank with the same
        ``names``. Full tensors are fp32 views into one chunk's gathered buffer: copy what you
        keep. Parameters without any state (never stepped) are left out."""
        wanted = None if names is None else set(names)
        elem, scalar = self._state_keys()
        by_chunk: dict[int, dict[nn.Parameter, nn.Parameter]] = {}
        for chunk, _, _, p, view in self.slices:
            by_chunk.setdefault(chunk.chunk_id, {})[p] = view
        for chunk in self.manager:
            infos = [i for i in chunk.tensors if wanted is None or self._name(i.param) in wanted]
            if not infos:
                continue
            views = by_chunk.get(chunk.chunk_id, {})
            states = {p: self._view_state(view) for p, view in views.items()}
            fulls = {key: self._gather_state(chunk, states, key) for key in elem}
            scalars = torch.zeros(len(infos), 1 + len(scalar), dtype=torch.float64)
            for row, info in enumerate(infos):
                state = states.get(info.param, {})
                scalars[row, 0] = 1.0 if state else 0.0
                for col, key in enumerate(scalar, start=1):
                    if key in state:
                        scalars[row, col] = float(state[key])
            scalars = self._max_over_ranks(scalars)
            for row, info in enumerate(infos):
                if scalars[row, 0] == 0:
                    continue
                entry = {k: scalars[row, c].to(torch.float32) for c, k in enumerate(scalar, 1)}
                for key, full in fulls.items():
                    entry[key] = full[info.offset : info.offset + info.numel].view(info.shape)
                yield self._name(info.param), entry

    def _name(self, p: nn.Parameter) -> str:
        return self._names[p]

    def _gather_state(
        self, chunk: Chunk, states: dict[nn.Parameter, dict[str, Any]], key: str
    ) -> torch.Tensor:
        assert chunk.master is not None
        local = torch.zeros(chunk.shard_size, dtype=torch.float32, device=chunk.master.device)
        for info in chunk.tensors:
            span = local_range(chunk, info)
            value = states.get(info.param, {}).get(key)
            if span is not None and isinstance(value, torch.Tensor):
                local[span[0] : span[1]].copy_(value.reshape(-1))
        return gather_chunk_vector(chunk, local).cpu()

    def _max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and self.manager.world_size > 1:
            device = "cpu" if dist.get_backend(self.manager.group) == "gloo" else None
            moved = values.to(device or self.manager.compute_device)
            dist.all_reduce(moved, op=dist.ReduceOp.MAX, group=self.manager.group)
            return moved.cpu()
        return values

    def load_full_states(self, items: Iterable[tuple[str, dict[str, Any]]]) -> set[str]:
        """Each rank keeps its slice of each parameter's full states (not collective); the
        wrapped optimizer's own ``load_state_dict`` casts them to its layout. Returns the
        parameter names consumed."""
        by_name = {self._name(p): (chunk, b, e, view) for chunk, b, e, p, view in self.slices}
        known = set(self._names.values())
        index = {
            view: i
            for i, view in enumerate(v for g in self.optim.param_groups for v in g["params"])
        }
        sd = self.optim.state_dict()
        consumed: set[str] = set()
        for name, entry in items:
            if name not in known:
                continue
            consumed.add(name)
            if name not in by_name:  # this rank holds no slice of it
                continue
            chunk, begin, end, view = by_name[name]
            info = self.manager.locate(next(p for p, n in self._names.items() if n == name))[1]
            lo = chunk.shard_begin + begin - info.offset
            state: dict[str, Any] = {}
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    flat = value.detach().reshape(-1)[lo : lo + end - begin]
                    state[key] = flat.to(device=view.device, dtype=torch.float32).clone()
                else:
                    state[key] = value
            sd["state"][index[view]] = state
        self.optim.load_state_dict(sd)
        return consumed
