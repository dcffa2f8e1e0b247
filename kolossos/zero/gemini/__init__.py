"""Gemini: chunk-based ZeRO-3 (:class:`GeminiDDP`, :class:`GeminiOptimizer`) with placement of
chunks between device and host (:mod:`kolossos.zero.gemini.placement`).

Colossal-AI's names are importable from here and from its module paths:
``gemini_mgr.GeminiManager``, ``chunk`` (``Chunk``, ``ChunkManager``, ``TensorInfo``,
``TensorState``, ``search_chunk_configuration``, ``init_chunk_manager``) and
``utils.get_static_torch_model``.
"""

from kolossos.zero.gemini.chunk import (
    Chunk,
    ChunkManager,
    ChunkSearchResult,
    TensorInfo,
    TensorState,
    init_chunk_manager,
    search_chunk_configuration,
)
from kolossos.zero.gemini.gemini_ddp import GeminiDDP
from kolossos.zero.gemini.gemini_mgr import GeminiManager
from kolossos.zero.gemini.gemini_optimizer import GeminiAdamOptimizer, GeminiOptimizer
from kolossos.zero.gemini.utils import get_static_torch_model

__all__ = [
    "Chunk",
    "ChunkManager",
    "ChunkSearchResult",
    "GeminiAdamOptimizer",
    "GeminiDDP",
    "GeminiManager",
    "GeminiOptimizer",
    "TensorInfo",
    "TensorState",
    "get_static_torch_model",
    "init_chunk_manager",
    "search_chunk_configuration",
]
