"""The model's own key/value cache, passed between decoding steps.

Hugging Face causal LMs create a ``DynamicCache`` when called with ``use_cache=True`` and return
it with the output; it is handed back on the next step. transformers 5 names that argument and
output field ``cache``; transformers 4 named them ``past_key_values``.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

__all__ = ["cache_keyword"]


def cache_keyword(model: nn.Module) -> str:
    """The name of the KV cache in ``model``'s forward arguments and outputs.

    Read from the forward signature once per engine: the name changed between transformers 4
    and 5, which kolossos both supports.
    """
    parameters: dict[str, Any] = dict(inspect.signature(model.forward).parameters)
    return "cache" if "cache" in parameters else "past_key_values"
