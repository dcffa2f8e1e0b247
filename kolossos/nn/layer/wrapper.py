"""Colossal-AI's old import path ``colossalai.nn.layer.wrapper``: a thin alias of
:mod:`kolossos.legacy.nn.wrapper`, resolved lazily (``kolossos.nn`` sits below the legacy API).

Example:
    >>> from kolossos.nn.layer.wrapper import PipelineSharedModuleWrapper
    >>> PipelineSharedModuleWrapper.__module__
    'kolossos.legacy.nn.wrapper'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kolossos._lazy import lazy_attributes

if TYPE_CHECKING:
    from kolossos.legacy.nn.wrapper import PipelineSharedModuleWrapper

__all__ = ["PipelineSharedModuleWrapper"]

__getattr__, __dir__ = lazy_attributes(
    __name__,
    globals(),
    {"PipelineSharedModuleWrapper": ("kolossos.legacy.nn.wrapper", "PipelineSharedModuleWrapper")},
)
