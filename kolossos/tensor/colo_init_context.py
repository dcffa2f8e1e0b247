"""``ColoInitContext``: build a model directly on its device and in its dtype, optionally as
tensor-parallel :class:`~kolossos.tensor.ColoParameter` objects.

In Colossal-AI 0.2-0.3 a model had to be built under ``ColoInitContext`` before ``GeminiDDP``
could wrap it, because the context turned every parameter into a ``ColoParameter``. kolossos'
:class:`~kolossos.zero.gemini.GeminiDDP` wraps any ``nn.Module``, so without tensor-parallel
arguments the context only does what remains useful of it: tensors created inside it
(parameters, buffers, anything else) are allocated on ``device`` (default: this process's
accelerator device) with ``dtype`` as the default floating dtype.

With ``default_pg`` (a :class:`~kolossos.tensor.ProcessGroup`), every parameter registered on a
module inside the context becomes a :class:`~kolossos.tensor.ColoParameter` on ``default_pg``,
replicated over its tensor-parallel group, or cut by ``default_dist_spec`` (e.g.
``ShardSpec([-1], [tp])``, the documents' ``--shardinit``). Parameters are made whole first,
then cut (Colossal-AI allocated only the piece).

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
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.utils.hooks import RemovableHandle

from kolossos.accelerator import get_accelerator
from kolossos.tensor.colo_parameter import ColoParameter
from kolossos.tensor.distspec import ReplicaSpec, ShardSpec
from kolossos.tensor.process_group import ProcessGroup
from kolossos.tensor.tensor_spec import ColoTensorSpec

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
    """Allocate the tensors of a model built inside the context on ``device``, in ``dtype``;
    with ``default_pg``, make its parameters ColoParameters.

    Args:
        device: where to allocate (default: the accelerator's current device).
        dtype: the default floating dtype inside the context (``torch.float`` as in Colossal-AI).
        default_pg: the tensor-parallel x data-parallel layout of the parameters (``None``:
            plain parameters).
        default_dist_spec: the dist spec of every parameter (``None``: replicated); needs
            ``default_pg``.

    Raises:
        TypeError: ``dtype`` is not a floating dtype, ``default_pg`` is not a ``ProcessGroup``
            or ``default_dist_spec`` not a dist spec.
        ValueError: ``default_dist_spec`` without ``default_pg``.
    """

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        dtype: torch.dtype = torch.float,
        default_pg: ProcessGroup | None = None,
        default_dist_spec: ShardSpec | ReplicaSpec | None = None,
    ) -> None:
        if default_pg is not None and not isinstance(default_pg, ProcessGroup):
            raise TypeError(
                f"ColoInitContext(default_pg={default_pg!r}): pass a kolossos.tensor."
                "ProcessGroup, e.g. ProcessGroup(tp_degree=2), or None."
            )
        if default_dist_spec is not None:
            if not isinstance(default_dist_spec, (ShardSpec, ReplicaSpec)):
                raise TypeError(
                    f"ColoInitContext(default_dist_spec={default_dist_spec!r}): pass a ShardSpec, "
                    "a ReplicaSpec or None."
                )
            if default_pg is None:
                raise ValueError(
                    "ColoInitContext(default_dist_spec=...) needs default_pg (the group the "
                    "spec cuts over); pass default_pg=ProcessGroup(tp_degree=...)."
                )
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype={dtype!r} must be a floating torch.dtype, e.g. torch.float.")
        self.device = _resolve(device)
        self.dtype = dtype
        self.default_pg = default_pg
        self.default_dist_spec = default_dist_spec
        self._saved: list[tuple[torch.dtype, Any, RemovableHandle | None]] = []

    def _to_colo(self, module: nn.Module, name: str, param: nn.Parameter | None) -> Any:
        if param is None or isinstance(param, ColoParameter) or self.default_pg is None:
            return None
        colo = ColoParameter(
            param.detach(), requires_grad=param.requires_grad, spec=ColoTensorSpec(self.default_pg)
        )
        if self.default_dist_spec is not None:
            colo.set_dist_spec(self.default_dist_spec)
        return colo

    def __enter__(self) -> ColoInitContext:
        placement = torch.device(self.device)  # a device is a context manager of factory calls
        placement.__enter__()
        handle = None
        if self.default_pg is not None:
            handle = register_module_parameter_registration_hook(self._to_colo)
        self._saved.append((torch.get_default_dtype(), placement, handle))
        torch.set_default_dtype(self.dtype)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        dtype, placement, handle = self._saved.pop()
        if handle is not None:
            handle.remove()
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
