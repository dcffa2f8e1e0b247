"""ZeRO: sharding optimizer states, gradients (and parameters) over data-parallel ranks.

``kolossos.zero.low_level`` holds stages 1 and 2 (:class:`LowLevelZeroOptimizer`, used by
``LowLevelZeroPlugin``); ``kolossos.zero.gemini`` holds stage 3 with chunks and heterogeneous
memory (:class:`GeminiDDP`, :class:`GeminiOptimizer`, used by ``GeminiPlugin``). The names
below are those Colossal-AI 0.3 exports from ``colossalai.zero`` (``ZeroDDP`` and
``ZeroOptimizer`` are its older names of the Gemini classes); see ``docs/gemini.md``.
"""

from kolossos.tensor.colo_init_context import ColoInitContext, post_process_colo_init_ctx
from kolossos.zero.gemini import (
    GeminiAdamOptimizer,
    GeminiDDP,
    GeminiOptimizer,
    get_static_torch_model,
)
from kolossos.zero.low_level import LowLevelZeroModel, LowLevelZeroOptimizer
from kolossos.zero.wrapper import zero_model_wrapper, zero_optim_wrapper

ZeroDDP = GeminiDDP
ZeroOptimizer = GeminiOptimizer

__all__ = [
    "ColoInitContext",
    "GeminiAdamOptimizer",
    "GeminiDDP",
    "GeminiOptimizer",
    "LowLevelZeroModel",
    "LowLevelZeroOptimizer",
    "ZeroDDP",
    "ZeroOptimizer",
    "get_static_torch_model",
    "post_process_colo_init_ctx",
    "zero_model_wrapper",
    "zero_optim_wrapper",
]
