"""Model-construction helpers the documents import from ``colossalai.utils.model`` (resolved
lazily from :mod:`kolossos.tensor.colo_init_context`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kolossos._lazy import lazy_attributes

if TYPE_CHECKING:
    from kolossos.tensor.colo_init_context import ColoInitContext, post_process_colo_init_ctx

__all__ = ["ColoInitContext", "post_process_colo_init_ctx"]

_HOME = "kolossos.tensor.colo_init_context"
__getattr__, __dir__ = lazy_attributes(
    __name__,
    globals(),
    {name: (_HOME, name) for name in ("ColoInitContext", "post_process_colo_init_ctx")},
)
