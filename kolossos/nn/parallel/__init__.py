"""``kolossos.nn.parallel``: the import path Colossal-AI 0.1.11-0.2 documented for Gemini.

``from colossalai.nn.parallel import GeminiDDP`` becomes ``from kolossos.nn.parallel import
GeminiDDP``; the classes are those of :mod:`kolossos.zero.gemini` (``kolossos.zero`` exports
them too), resolved lazily so that ``kolossos.nn`` does not depend on the ZeRO engines (which
build on ``kolossos.nn``'s optimizers). ``GeminiDDP(model, device=get_current_device(),
placement_policy="auto", pin_memory=True, search_range_mb=32)`` works as documented.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kolossos._lazy import lazy_attributes

if TYPE_CHECKING:
    from kolossos.zero.gemini import GeminiAdamOptimizer, GeminiDDP, GeminiOptimizer

    ZeroDDP = GeminiDDP

#: Colossal-AI 0.1.9-0.1.10's ``ZeroDDP`` is the chunked ZeRO-3 model wrapper, GeminiDDP
_GEMINI = "kolossos.zero.gemini"
_LAZY = {
    "GeminiAdamOptimizer": (_GEMINI, "GeminiAdamOptimizer"),
    "GeminiDDP": (_GEMINI, "GeminiDDP"),
    "GeminiOptimizer": (_GEMINI, "GeminiOptimizer"),
    "ZeroDDP": (_GEMINI, "GeminiDDP"),
}

__all__ = ["GeminiAdamOptimizer", "GeminiDDP", "GeminiOptimizer", "ZeroDDP"]


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
