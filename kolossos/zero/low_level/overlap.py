"""``overlap_allgather``: the updated partitions are gathered back into the working weights
asynchronously after the step, bucket by bucket, and each module waits, in a forward pre-hook,
only for the buckets holding its own parameters. The gathers of the later layers thus run while
the first layers already compute.

Buckets are runs of whole consecutive parameters of one group's flat buffer (about
``bucket_numel`` elements, a larger parameter alone); a bucket is gathered by one broadcast per
owner of the flat range it covers (partitions are contiguous, so usually one or two). Every rank
issues the same broadcasts in the same order. Anything that reads the weights outside a forward
must call :meth:`ParamGatherer.wait_all` first (the optimizer does before its next step and its
state dicts; the model's ``state_dict`` / ``load_state_dict`` pre-hooks do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from kolossos.zero.low_level.comm import Communicator, Handle
from kolossos.zero.low_level.partition import FlatLayout

__all__ = ["ParamGatherer", "plan_gather_buckets"]


def plan_gather_buckets(layout: FlatLayout, bucket_numel: int) -> list[tuple[int, int]]:
    """Flat ranges ``[start, stop)`` of whole consecutive parameters, each about
    ``bucket_numel`` elements (at least one parameter)."""
    buckets: list[tuple[int, int]] = []
    start = None
    for span in layout.spans:
        if start is None:
            start = span.offset
        if span.stop - start >= bucket_numel:
            buckets.append((start, span.stop))
            start = None
    if start is not None:
        buckets.append((start, layout.numel))
    return buckets


class ParamGatherer:
    """Asynchronous bucketed partition gathers, waited on per module (module doc).

    Args:
        comm: the data-parallel communicator.
        groups: the parameters of each group, in flat-buffer order.
        layouts: each group's flat layout.
        flat_work: each group's flat working buffer (the parameters are views of it).
        bucket_numel: the target bucket size in elements.
    """

    def __init__(
        self,
        comm: Communicator,
        groups: Sequence[Sequence[torch.Tensor]],
        layouts: Sequence[FlatLayout],
        flat_work: Sequence[torch.Tensor],
        bucket_numel: int,
    ) -> None:
        self.comm = comm
        self.buckets: list[tuple[int, int, int]] = []  # (group, start, stop)
        self.bucket_of: dict[torch.Tensor, int] = {}
        for g, (params, layout) in enumerate(zip(groups, layouts, strict=True)):
            for start, stop in plan_gather_buckets(layout, max(1, bucket_numel)):
                index = len(self.buckets)
                self.buckets.append((g, start, stop))
                for span, _, _ in layout.spans_in(start, stop):
                    self.bucket_of[params[span.index]] = index
        self.layouts, self.flat_work = list(layouts), list(flat_work)
        self.pending: dict[int, Handle] = {}
        self.hooks: list[RemovableHandle] = []
        #: buckets waited on by a forward pre-hook / by wait_all (for tests and profiling)
        self.waited_in_forward = 0
        self.waited_outside = 0

    @property
    def hooked(self) -> bool:
        """Whether forward pre-hooks wait for the gathers (:meth:`install`)."""
        return bool(self.hooks)

    def launch(self) -> None:
        """Start every bucket's gather (COLLECTIVE, asynchronous: same order on all ranks)."""
        self.wait_all()
        for index, (g, start, stop) in enumerate(self.buckets):
            self.pending[index] = self.comm.gather_range(self.flat_work[g], self.layouts[g],
                                                         start, stop)  # fmt: skip

    def _wait(self, indices: Sequence[int], in_forward: bool) -> None:
        for index in indices:
            handle = self.pending.pop(index, None)
            if handle is not None:
                handle.wait()  # SYNC POINT: this bucket's weights are now current
                if in_forward:
                    self.waited_in_forward += 1
                else:
                    self.waited_outside += 1

    def wait_all(self) -> None:
        """Wait for every gather still in flight."""
        self._wait(sorted(self.pending), in_forward=False)

    def install(self, model: nn.Module) -> None:
        """Forward pre-hooks on every module holding managed parameters directly (each waits
        for its buckets), and state-dict pre-hooks on ``model`` (wait for all)."""
        for module in model.modules():
            indices = sorted(
                {self.bucket_of[p] for p in module.parameters(recurse=False) if p in self.bucket_of}
            )
            if indices:
                self.hooks.append(module.register_forward_pre_hook(self._pre_hook(indices)))
        self.hooks.append(model.register_state_dict_pre_hook(self._wait_all_hook))
        self.hooks.append(model.register_load_state_dict_pre_hook(self._wait_all_hook))

    def _pre_hook(self, indices: list[int]) -> Any:
        def wait(module: nn.Module, args: Any) -> None:
            if self.pending:
                self._wait(indices, in_forward=True)

        return wait

    def _wait_all_hook(self, *args: Any) -> None:
        self.wait_all()
