"""``kolossos.nn.parallel``: the import path Colossal-AI 0.1.11-0.2 documented for Gemini.

``from colossalai.nn.parallel import GeminiDDP`` becomes ``from kolossos.nn.parallel import
GeminiDDP``; the classes are those of :mod:`kolossos.zero.gemini` (``kolossos.zero`` exports
them too). ``GeminiDDP(model, device=get_current_device(), placement_policy="auto",
pin_memory=True, search_range_mb=32)`` works as documented.
"""

from kolossos.zero.gemini import GeminiAdamOptimizer, GeminiDDP, GeminiOptimizer

#: Colossal-AI 0.1.9-0.1.10's name of the chunked ZeRO-3 model wrapper
ZeroDDP = GeminiDDP

__all__ = ["GeminiAdamOptimizer", "GeminiDDP", "GeminiOptimizer", "ZeroDDP"]
