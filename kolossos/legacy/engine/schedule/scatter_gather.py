"""``scatter_gather_tensors``: under 1D tensor parallelism the activation (and its gradient)
between two pipeline stages is the same on every rank of a tensor-parallel group, so each rank
sends only its ``1/tp`` slice of the flattened tensor to its peer (the same tensor rank of the
next stage), and the receiving group all-gathers the slices into the whole tensor. A tensor whose
size is not a multiple of ``tp`` travels whole (as upstream).

Both ends decide from the whole tensor's shape (sent as metadata, or the fixed ``TENSOR_SHAPE``),
so they always agree on the slice sizes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from kolossos.pipeline.p2p import PipelineP2P, TensorSpec, encode_metadata, spec_of

__all__ = ["ScatterGatherP2P"]


class ScatterGatherP2P(PipelineP2P):
    """:class:`~kolossos.pipeline.p2p.PipelineP2P` that sends ``1/tp`` of each tensor.

    Args:
        group: the pipeline process group.
        tp_group: this rank's 1D tensor-parallel group.
        tp_rank: this rank's position in it.
        tp_size: its size.
        **kwargs: as :class:`~kolossos.pipeline.p2p.PipelineP2P`.
    """

    def __init__(
        self, group: Any, *, tp_group: Any, tp_rank: int, tp_size: int, **kwargs: Any
    ) -> None:
        super().__init__(group, **kwargs)
        self.tp_group, self.tp_rank, self.tp_size = tp_group, tp_rank, tp_size

    def _splits(self, shape: tuple[int, ...]) -> bool:
        return self.tp_size > 1 and math.prod(shape) % self.tp_size == 0

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if not self._splits(tuple(t.shape)):
            return t
        part = t.numel() // self.tp_size
        return t.reshape(-1)[self.tp_rank * part : (self.tp_rank + 1) * part]

    def send_activation(
        self, dst: int, stream: Any, tensors: list[torch.Tensor], is_tuple: bool
    ) -> None:
        """As the parent (metadata of the whole tensors), sending only this rank's slices."""
        specs = [spec_of(t) for t in tensors]
        if self.fixed is not None:
            want = [(s.shape, s.dtype) for s in self.fixed[0]]
            if [(s.shape, s.dtype) for s in specs] != want:
                raise ValueError(
                    f"stage output {[(s.shape, s.dtype) for s in specs]} does not match the "
                    f"fixed tensor_shape {want}; fix TENSOR_SHAPE (and its dtype) or leave it "
                    "None to negotiate shapes."
                )
        elif not self.cache or stream not in self._sent_streams:
            self.isend(dst, [encode_metadata(specs, is_tuple).to(self.device)])
            self.stats.metadata_sent += 1
            self._sent_streams.add(stream)
        self.isend(dst, [self._slice(t) for t in tensors])
        self.stats.messages_sent += 1

    def send_grad(self, dst: int, grads: list[torch.Tensor]) -> None:
        """Send this rank's slices of the input gradients."""
        self.isend(dst, [self._slice(g) for g in grads])
        self.stats.messages_sent += 1

    def _recv_specs(self, src: int, specs: list[TensorSpec]) -> list[torch.Tensor]:
        """Receive the slices of a message and all-gather each into its whole tensor."""
        parts = [
            TensorSpec((math.prod(s.shape) // self.tp_size,), s.dtype, s.requires_grad)
            if self._splits(s.shape)
            else s
            for s in specs
        ]
        received = super()._recv_specs(src, parts)
        return [self._gather(t, s) for t, s in zip(received, specs, strict=True)]

    def _gather(self, received: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
        if not self._splits(spec.shape):
            return received
        pieces = [torch.empty_like(received) for _ in range(self.tp_size)]
        # SYNC POINT: the ranks of a tensor-parallel group run the same schedule, so they receive
        # the same message in the same step and meet in this all-gather.
        dist.all_gather(pieces, received, group=self.tp_group)
        return torch.cat(pieces).view(spec.shape)
