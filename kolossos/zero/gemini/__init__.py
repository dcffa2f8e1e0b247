"""Gemini: chunk-based ZeRO-3 (:class:`GeminiDDP`, :class:`GeminiOptimizer`) with placement of
chunks between device and host (:mod:`kolossos.zero.gemini.placement`)."""

from kolossos.zero.gemini.chunk import (
    Chunk,
    ChunkManager,
    ChunkSearchResult,
    TensorState,
    search_chunk_configuration,
)
from kolossos.zero.gemini.gemini_ddp import GeminiDDP
from kolossos.zero.gemini.gemini_optimizer import GeminiAdamOptimizer, GeminiOptimizer

__all__ = [
    "Chunk",
    "ChunkManager",
    "ChunkSearchResult",
    "GeminiAdamOptimizer",
    "GeminiDDP",
    "GeminiOptimizer",
    "TensorState",
    "search_chunk_configuration",
]
