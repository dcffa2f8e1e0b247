"""Colossal-AI's old import path ``colossalai.nn.model``: a thin alias of
:mod:`kolossos.legacy.builder.model_from_config`, resolved lazily (``kolossos.nn`` sits below the
legacy API, so importing this module does not load it).

Example:
    >>> from kolossos.nn.model import ModelFromConfig
    >>> ModelFromConfig.__module__
    'kolossos.legacy.builder.model_from_config'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kolossos._lazy import lazy_attributes

if TYPE_CHECKING:
    from kolossos.legacy.builder.model_from_config import ModelFromConfig

__all__ = ["ModelFromConfig"]

__getattr__, __dir__ = lazy_attributes(
    __name__,
    globals(),
    {"ModelFromConfig": ("kolossos.legacy.builder.model_from_config", "ModelFromConfig")},
)
