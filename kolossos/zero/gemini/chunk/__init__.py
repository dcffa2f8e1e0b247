"""Chunks: parameters packed contiguously, moved, gathered and reduced as one unit."""

from kolossos.zero.gemini.chunk.chunk import Chunk, TensorInfo
from kolossos.zero.gemini.chunk.manager import ChunkManager
from kolossos.zero.gemini.chunk.search import (
    ChunkSearchResult,
    search_chunk_configuration,
    search_chunk_size,
    unique_params,
)
from kolossos.zero.gemini.chunk.state import (
    TRANSITIONS,
    InvalidTransitionError,
    TensorState,
    check_transition,
)

__all__ = [
    "TRANSITIONS",
    "Chunk",
    "ChunkManager",
    "ChunkSearchResult",
    "InvalidTransitionError",
    "TensorInfo",
    "TensorState",
    "check_transition",
    "search_chunk_configuration",
    "search_chunk_size",
    "unique_params",
]
