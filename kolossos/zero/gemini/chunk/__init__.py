"""Chunks: parameters packed contiguously, moved, gathered and reduced as one unit.

Colossal-AI's names live at its module paths: ``chunk.Chunk``, ``chunk.ChunkFullError``,
``chunk.TensorInfo``, ``chunk.TensorState`` (:mod:`.chunk`), ``manager.ChunkManager``,
``search_utils.search_chunk_configuration`` / ``classify_params_by_dp_degree`` and
``utils.init_chunk_manager``, all re-exported here.
"""

from kolossos.zero.gemini.chunk.chunk import Chunk, ChunkFullError, TensorInfo
from kolossos.zero.gemini.chunk.manager import ChunkManager
from kolossos.zero.gemini.chunk.search import (
    ChunkSearchResult,
    find_chunk_configuration,
    search_chunk_size,
    tied_params,
    unique_params,
)
from kolossos.zero.gemini.chunk.search_utils import (
    classify_params_by_dp_degree,
    flat_chunk_config,
    search_chunk_configuration,
)
from kolossos.zero.gemini.chunk.state import (
    TRANSITIONS,
    InvalidTransitionError,
    TensorState,
    check_transition,
)
from kolossos.zero.gemini.chunk.utils import init_chunk_manager

__all__ = [
    "TRANSITIONS",
    "Chunk",
    "ChunkFullError",
    "ChunkManager",
    "ChunkSearchResult",
    "InvalidTransitionError",
    "TensorInfo",
    "TensorState",
    "check_transition",
    "classify_params_by_dp_degree",
    "find_chunk_configuration",
    "flat_chunk_config",
    "init_chunk_manager",
    "search_chunk_configuration",
    "search_chunk_size",
    "tied_params",
    "unique_params",
]
