"""``ColoInitContext``: build a model directly on its device and in its dtype.

In Colossal-AI 0.2-0.3 a model had to be built under ``ColoInitContext`` before ``GeminiDDP``
could wrap it, because the context turned every parameter into a ``ColoParameter``. kolossos'
:class:`~kolossos.zero.gemini.GeminiDDP` wraps any ``nn.Module``, so the context is not needed
any more; it is kept so that the documented scripts run unchanged, and it does what remains
useful of it: tensors created inside it (parameters, buffers, anything else) are allocated on
``device`` (default: this process's accelerator device) with ``dtype`` as the default floating
dtype. Tensor-parallel initialisation (``default_pg`` / ``default_dist_spec``) is not done here:
shard models with ``kolossos.shardformer`` or ``HybridParallelPlugin`` instead.

Example:
    >>> with ColoInitContext(device="cpu"):
    ...     model = torch.nn.Linear(4, 4)
    >>> model.weight.device
    device(type='cpu')
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
import torch.nn as nn

from kolossos.accelerator import get_accelerator

__all__ = ["ColoInitContext", "post_process_colo_init_ctx"]


def _resolve(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return get_accelerator().get_current_device()
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"device={device!r} must be None, a torch.device, a str or an int.")
    if isinstance(device, int):  # the documents pass torch.cuda.current_device(), an index
        return torch.device("cuda", device)
    return torch.device(device)


class ColoInitContext:
    """Allocate the tensors of a model built inside the context on ``device``, in ``dtype``.

    Args:
        device: where to allocate (default: the accelerator's current device).
        dtype: the default floating dtype inside the context (``torch.float`` as in Colossal-AI).
        default_pg: tensor-parallel process group of Colossal-AI 0.2 (not supported: ``None``).
        default_dist_spec: tensor-parallel sharding spec of Colossal-AI 0.2 (``None`` only).

    Raises:
        NotImplementedError: ``default_pg`` or ``default_dist_spec`` is given.
        TypeError: ``dtype`` is not a floating dtype.
    """

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        dtype: torch.dtype = torch.float,
        default_pg: Any = None,
        default_dist_spec: Any = None,
    ) -> None:
        for name, value in (("default_pg", default_pg), ("default_dist_spec", default_dist_spec)):
            if value is not None:
                raise NotImplementedError(
                    f"ColoInitContext({name}=...) (tensor-parallel initialisation) is not "
                    "supported; build the model normally and shard it with kolossos.shardformer "
                    "or HybridParallelPlugin(tp_size=...)."
                )
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype={dtype!r} must be a floating torch.dtype, e.g. torch.float.")
        self.device = _resolve(device)
        self.dtype = dtype
        self._saved: list[tuple[torch.dtype, Any]] = []

    def __enter__(self) -> ColoInitContext:
        placement = torch.device(self.device)  # a device is a context manager of factory calls
        placement.__enter__()
        self._saved.append((torch.get_default_dtype(), placement))
        torch.set_default_dtype(self.dtype)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        dtype, placement = self._saved.pop()
        torch.set_default_dtype(dtype)
        placement.__exit__(exc_type, exc, tb)


def post_process_colo_init_ctx(
    model: nn.Module,
    device: torch.device | str | int | None = None,
    dtype: torch.dtype = torch.float,
) -> nn.Module:
    """Move ``model`` (built inside or outside the context) to ``device`` and its floating
    parameters and buffers to ``dtype``; returns it."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype={dtype!r} must be a floating torch.dtype, e.g. torch.float.")
    return model.to(device=_resolve(device), dtype=dtype)
