"""Let Gemini release chunk payloads during forward although autograd saved views of them.

``nn.Linear`` saves ``weight.t()`` for its backward — a view of the gathered chunk payload, which
keeps the whole payload alive however often the chunk is "released" — so without this every
chunk used in a forward stays in memory until backward reaches it: the whole model gathered at
once. While a GeminiDDP forward runs, :func:`payload_saving_hooks` replaces each saved tensor that
views a gathered payload by where it lies in the chunk (:class:`PayloadView`), and rebuilds the view
on the chunk's payload when backward needs it — gathered again by then by the pre-backward hook
of the module that owns the parameters (or here, as a fallback; every rank runs the same graph,
so the collective matches).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from kolossos.zero.gemini.chunk import Chunk, ChunkManager

__all__ = ["PayloadView", "payload_saving_hooks"]


@dataclass(frozen=True)
class PayloadView:
    """A saved tensor as a view of a chunk's payload."""

    chunk: Chunk
    """The chunk whose payload the tensor viewed."""
    size: tuple[int, ...]
    """The view's shape."""
    stride: tuple[int, ...]
    """The view's strides."""
    offset: int
    """The view's storage offset (elements of the payload)."""


def payload_saving_hooks(manager: ChunkManager) -> AbstractContextManager[Any]:
    """``saved_tensors_hooks`` saving views of gathered payloads by position (module doc)."""

    def pack(tensor: torch.Tensor) -> Any:
        if not isinstance(tensor, torch.Tensor) or tensor.device != manager.compute_device:
            return tensor
        try:
            ptr = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return tensor
        for chunk in manager.accessed_chunks:
            payload = chunk.payload
            if (
                payload is not None
                and not chunk.keep_gathered
                and payload.untyped_storage().data_ptr() == ptr
                and tensor.dtype == payload.dtype
            ):
                return PayloadView(
                    chunk, tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset())
                )
        return tensor

    def unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, PayloadView):
            return saved
        chunk = saved.chunk
        if chunk.payload is None:
            manager.gather(chunk)  # COLLECTIVE fallback: the same on every rank
        chunk.wait()
        assert chunk.payload is not None
        return chunk.payload.as_strided(saved.size, saved.stride, saved.offset)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
