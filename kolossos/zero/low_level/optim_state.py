"""State (de)serialisation of :class:`LowLevelZeroOptimizer`: between this rank's partitions and
full per-parameter tensors (a mixin, to keep the optimizer module about training).

* ``full_param`` / ``full_param_states`` gather one parameter's fp32 master value or optimizer
  states from the ranks owning its pieces (a collective; used by checkpoint IO and
  ``state_dict``);
* ``load_full_param`` / ``load_param_states`` cut full values into this rank's partitions
  (no communication: every rank reads the full values);
* ``state_dict`` / ``load_state_dict``: torch's positional format with full states, so a plain
  optimizer over the model loads it, and vice versa.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from kolossos.amp import DynamicGradScaler
from kolossos.zero.low_level import state_io
from kolossos.zero.low_level.comm import Communicator
from kolossos.zero.low_level.offload import MasterWeights
from kolossos.zero.low_level.partition import FlatLayout, ParamSpan

__all__ = ["PartitionedStateMixin"]


class PartitionedStateMixin:
    """State methods of :class:`~kolossos.zero.low_level.LowLevelZeroOptimizer`."""

    optim: Optimizer
    comm: Communicator
    layouts: list[FlatLayout]
    groups: list[list[torch.nn.Parameter]]
    masters: MasterWeights
    spans: dict[torch.Tensor, tuple[int, ParamSpan]]
    scaler: DynamicGradScaler | None

    def sync_master_weights(self) -> None:
        """Let the fp32 masters follow working weights changed from outside (e.g. after
        ``model.load_state_dict``); masters already matching keep their precision."""
        self.masters.follow_working()

    @torch.no_grad()
    def load_full_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Set a managed parameter from its full value: the working weights (in their dtype) and
        this rank's slice of the fp32 master (at full precision)."""
        g, span = self.spans[param]
        param.copy_(value.reshape(param.shape))
        piece = state_io.local_piece(self.layouts[g], self.comm.rank, span)
        if piece is not None and not self.masters.aliased[g]:
            at, off, n = piece
            self.masters.params[g].data[at : at + n].copy_(value.reshape(-1)[off : off + n])

    def full_param(self, param: torch.Tensor, dst: int | None) -> torch.Tensor | None:
        """A managed parameter's full fp32 master value on rank ``dst`` (``None``: all ranks);
        a collective of the data-parallel group."""
        g, span = self.spans[param]
        master = self.masters.params[g].detach()
        return state_io.gather_span(self.comm, self.layouts[g], master, span, dst)

    def full_param_states(self, dst: int | None) -> Iterator[tuple[int, int, dict[str, Any]]]:
        """Yield ``(group, index, full state)`` per managed parameter with state; a collective
        (every rank iterates). ``dst``: the receiving rank (others yield nothing), ``None``:
        all."""
        for g, layout in enumerate(self.layouts):
            master = self.masters.params[g]
            state = self.optim.state.get(master, {})
            if not state:
                continue
            for span in layout.spans:
                full: dict[str, Any] = {}
                for key, value in state.items():
                    if state_io.is_partitioned(value, master):
                        full[key] = state_io.gather_span(self.comm, layout, value, span, dst)
                    else:
                        full[key] = value.clone() if isinstance(value, torch.Tensor) else value
                if dst is None or self.comm.rank == dst:
                    yield g, span.index, full

    def load_param_states(self, items: Iterable[tuple[int, int, Mapping[str, Any]]]) -> None:
        """Replace the wrapped optimizer's states by full per-parameter states
        ``(group, index, state)``, each cut to this rank's partition (no communication)."""
        builders: dict[int, state_io.PartitionStateBuilder] = {}
        for g, i, state in items:
            if g not in builders:
                master = self.masters.params[g].detach()
                builders[g] = state_io.PartitionStateBuilder(
                    self.layouts[g], self.comm.rank, master
                )
            builders[g].add(i, state)
        self.optim.state.clear()
        for g, builder in builders.items():
            self.optim.state[self.masters.params[g]] = builder.state

    def state_dict(self) -> dict[str, Any]:
        """A torch-style state dict with *full* per-parameter states, keyed by position over
        :meth:`parameters` (loadable into a plain optimizer over the model), plus the loss
        scaler. As in Colossal-AI, the gathered states are on the CPU (``step`` stays where
        the optimizer keeps it). A collective: call it on every rank."""
        sizes = [len(group) for group in self.groups]
        offsets = [sum(sizes[:g]) for g in range(len(sizes))]
        state = {offsets[g] + i: _states_to_cpu(s) for g, i, s in self.full_param_states(None)}
        groups = state_io.positional_groups(self.optim.param_groups, sizes)
        out: dict[str, Any] = {"state": state, "param_groups": groups}
        if self.scaler is not None:
            out["loss_scaler"] = self.scaler.state_dict()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (or from a plain optimizer over the same
        parameters): hyper-parameters per group, states cut to this rank's partitions."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g) for g in self.groups]:
            raise ValueError(
                "the state dict's param groups do not match this optimizer's (group count or "
                "sizes differ); load a state dict of the same optimizer layout."
            )
        position = {
            k: (g, i) for g, group in enumerate(groups) for i, k in enumerate(group["params"])
        }
        for group, saved in zip(self.optim.param_groups, groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        saved_state = state_dict["state"]
        self.load_param_states((*position[k], v) for k, v in saved_state.items() if k in position)
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])


def _states_to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its tensors other than ``step`` moved to the CPU."""
    return {
        k: v.cpu() if isinstance(v, torch.Tensor) and k != "step" else v for k, v in state.items()
    }
