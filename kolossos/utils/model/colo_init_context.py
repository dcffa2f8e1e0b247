"""``colossalai.utils.model.colo_init_context``: :class:`ColoInitContext` and
:func:`post_process_colo_init_ctx`, which live in :mod:`kolossos.tensor.colo_init_context` (they
make ColoParameters, a concept of a higher layer) and are resolved on first access."""

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
