"""Point-to-point layer between pipeline stages: activations forward, gradients backward.

* **Shapes once.** The first activation message of each stream (one stream per receiving virtual
  stage) carries a small fixed-size metadata tensor (structure, dtypes, shapes, which tensors
  need gradients); both ends cache it and later messages are bare tensors. With
  ``enable_metadata_cache=False`` every message carries it (shapes may change between
  micro-batches); with a fixed ``tensor_shape`` (the docs' ``TENSOR_SHAPE``) none does. Gradient
  messages never do: the receiver already knows the shapes of the outputs it sent.
* **Never blocks on a send.** Sends are ``isend`` (several tensors of one message in one
  ``batch_isend_irecv``); their handles are kept until :meth:`PipelineP2P.wait_sends`. A rank
  only ever blocks on a receive, so a schedule whose action orders are acyclic (checked by
  :func:`kolossos.pipeline.simulate.simulate`) cannot deadlock.
* **In order.** Messages between two ranks match in the order they were sent (as with NCCL); the
  executor receives them in the sender's order and buffers early arrivals.

Colossal-AI's object API (:class:`PipelineP2PCommunication`, :func:`create_send_metadata`) lives
in :mod:`kolossos.pipeline.p2p_communication` and is importable from here, as upstream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from kolossos.pipeline.p2p_communication import (
    P2PMetadata,
    PipelineP2PCommunication,
    TensorMetadata,
    create_send_metadata,
)
from kolossos.pipeline.p2p_transport import P2PStats, P2PTransport

__all__ = [
    "P2PMetadata",
    "P2PStats",
    "PipelineP2P",
    "PipelineP2PCommunication",
    "TensorMetadata",
    "TensorSpec",
    "create_send_metadata",
    "decode_metadata",
    "encode_metadata",
]

META_SIZE = 128
_MAGIC = 0x4B50  # "KP"
_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
)  # fmt: skip


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and gradient flag of one tensor of a message."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def encode_metadata(specs: list[TensorSpec], is_tuple: bool) -> torch.Tensor:
    """The fixed-size int64 metadata tensor describing a message.

    Raises:
        ValueError: an unsupported dtype, or too many tensors/dimensions to fit.
    """
    words = [_MAGIC, int(is_tuple), len(specs)]
    for spec in specs:
        if spec.dtype not in _DTYPES:
            raise ValueError(f"pipeline messages cannot carry {spec.dtype}; use one of {_DTYPES}.")
        words += [_DTYPES.index(spec.dtype), int(spec.requires_grad), len(spec.shape), *spec.shape]
    if len(words) > META_SIZE:
        raise ValueError(
            f"a stage output of {len(specs)} tensors needs {len(words)} metadata words (at most "
            f"{META_SIZE}); return fewer tensors between stages."
        )
    return torch.tensor(words + [0] * (META_SIZE - len(words)), dtype=torch.int64)


def decode_metadata(meta: torch.Tensor) -> tuple[list[TensorSpec], bool]:
    """Inverse of :func:`encode_metadata`: ``(specs, is_tuple)``."""
    words = meta.tolist()
    if words[0] != _MAGIC:
        raise RuntimeError(
            "pipeline metadata is corrupt: the stages disagree on the message order (do all "
            "ranks run the same schedule and micro-batch count?)."
        )
    is_tuple, count, pos, specs = bool(words[1]), words[2], 3, []
    for _ in range(count):
        dtype, grad, ndim = words[pos : pos + 3]
        shape = tuple(words[pos + 3 : pos + 3 + ndim])
        specs.append(TensorSpec(shape, _DTYPES[dtype], bool(grad)))
        pos += 3 + ndim
    return specs, is_tuple


def spec_of(t: torch.Tensor) -> TensorSpec:
    """The spec of a tensor about to be sent."""
    return TensorSpec(tuple(t.shape), t.dtype, t.requires_grad)


class PipelineP2P(P2PTransport):
    """Sends and receives of one rank's pipeline messages.

    Args:
        group: the pipeline process group (peers are given as global ranks).
        device: where received tensors are allocated (default: the accelerator's device).
        tensor_shape: a fixed activation shape: no metadata at all (every activation is one
            tensor of this shape and ``tensor_dtype``).
        tensor_dtype: dtype of fixed-shape activations (default float32).
        enable_metadata_cache: send an activation stream's metadata only with its first message.
    """

    def __init__(
        self,
        group: ProcessGroup | None = None,
        *,
        device: torch.device | None = None,
        tensor_shape: tuple[int, ...] | None = None,
        tensor_dtype: torch.dtype = torch.float32,
        enable_metadata_cache: bool = True,
    ) -> None:
        super().__init__(group, device=device)
        self.fixed = None
        if tensor_shape is not None:
            self.fixed = ([TensorSpec(tuple(tensor_shape), tensor_dtype, True)], False)
        self.cache = enable_metadata_cache
        self._sent_streams: set[Any] = set()
        self._recv_meta: dict[Any, tuple[list[TensorSpec], bool]] = {}

    # --- activations --------------------------------------------------------------------------
    def send_activation(
        self, dst: int, stream: Any, tensors: list[torch.Tensor], is_tuple: bool
    ) -> None:
        """Send a stage's outputs to global rank ``dst`` (non-blocking).

        Raises:
            ValueError: with a fixed ``tensor_shape``, an output that does not match it.
        """
        specs = [spec_of(t) for t in tensors]
        if self.fixed is not None:
            want = [(s.shape, s.dtype) for s in self.fixed[0]]
            if [(s.shape, s.dtype) for s in specs] != want:
                raise ValueError(
                    f"stage output {[(s.shape, s.dtype) for s in specs]} does not match the fixed "
                    f"tensor_shape {want}; fix TENSOR_SHAPE (and its dtype) or leave it None to "
                    "negotiate shapes."
                )
        elif not self.cache or stream not in self._sent_streams:
            self.isend(dst, [encode_metadata(specs, is_tuple).to(self.device)])
            self.stats.metadata_sent += 1
            self._sent_streams.add(stream)
        self.isend(dst, [t.detach() for t in tensors])
        self.stats.messages_sent += 1

    def recv_activation(self, src: int, stream: Any) -> tuple[list[torch.Tensor], bool]:
        """Receive a stage's inputs from global rank ``src`` (blocking): ``(tensors,
        is_tuple)``; floating tensors the sender tracked gradients for require gradients."""
        if self.fixed is not None:
            specs, is_tuple = self.fixed
        elif self.cache and stream in self._recv_meta:
            specs, is_tuple = self._recv_meta[stream]
        else:
            meta = torch.empty(META_SIZE, dtype=torch.int64, device=self.device)
            self.recv(src, [meta])
            specs, is_tuple = decode_metadata(meta.cpu())
            self._recv_meta[stream] = (specs, is_tuple)
            self.stats.metadata_received += 1
        out = self._recv_specs(src, specs)
        for t, spec in zip(out, specs, strict=True):
            if spec.requires_grad and t.is_floating_point():
                t.requires_grad_(True)
        return out, is_tuple

    # --- gradients ----------------------------------------------------------------------------
    def send_grad(self, dst: int, grads: list[torch.Tensor]) -> None:
        """Send input gradients to global rank ``dst`` (non-blocking)."""
        self.isend(dst, [g.detach() for g in grads])
        self.stats.messages_sent += 1

    def recv_grad(self, src: int, specs: list[TensorSpec]) -> list[torch.Tensor]:
        """Receive output gradients of the given specs from global rank ``src`` (blocking)."""
        return self._recv_specs(src, specs)

    # --- plumbing -----------------------------------------------------------------------------
    def _recv_specs(self, src: int, specs: list[TensorSpec]) -> list[torch.Tensor]:
        out = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in specs]
        self.recv(src, out)
        self.stats.messages_received += 1
        return out
