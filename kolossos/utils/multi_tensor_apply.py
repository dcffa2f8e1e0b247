"""``multi_tensor_applier``: apply one operation to lists of tensors (Colossal-AI's and apex's
``MultiTensorApply``), with the operations its users pass to it.

Upstream, an op is a compiled CUDA kernel that walks the tensors in chunks of ``chunk_size``
elements; here the ops are ``torch._foreach_*`` calls and plain loops that run on any device.
The call convention is the same: ``multi_tensor_applier(op, noop_flag_buffer, tensor_lists,
*args)`` calls ``op(chunk_size, noop_flag_buffer, tensor_lists, *args)``, and an op sets the
one-element int tensor ``noop_flag_buffer`` to 1 when it meets a non-finite value (without a
host synchronisation).

Example:
    >>> import torch
    >>> flag = torch.zeros(1, dtype=torch.int)
    >>> grads = [torch.ones(3), torch.ones(2)]
    >>> norm, per_tensor = multi_tensor_applier(multi_tensor_l2norm, flag, [grads], True)
    >>> round(norm.item() ** 2), [round(n ** 2) for n in per_tensor.tolist()]
    (5, [3, 2])
    >>> multi_tensor_applier(multi_tensor_scale, flag, [grads, grads], 0.5)  # in place
    >>> grads[0].tolist(), int(flag)
    ([0.5, 0.5, 0.5], 0)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "MultiTensorApply",
    "multi_tensor_applier",
    "multi_tensor_l2norm",
    "multi_tensor_scale",
]

#: the chunk size of Colossal-AI's ``multi_tensor_applier`` (2048 * 32 elements)
DEFAULT_CHUNK_SIZE = 2048 * 32

MultiTensorOp = Callable[..., Any]


class MultiTensorApply:
    """Calls a multi-tensor op with a chunk size: ``self(op, noop_flag, lists, *args)`` is
    ``op(chunk_size, noop_flag, lists, *args)``.

    ``chunk_size`` is the unit of work of upstream's CUDA kernels; it is passed on unchanged and
    does not change any result of the ops of this module (torch's foreach kernels chunk by
    themselves).

    Args:
        chunk_size: elements per chunk (a positive int).

    Raises:
        ValueError: ``chunk_size`` is not a positive int.
    """

    available = True
    """Always ``True``: the ops need no compiled extension (upstream: whether the extension
    loaded)."""
    warned = False

    def __init__(self, chunk_size: int) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"MultiTensorApply(chunk_size={chunk_size!r}) must be an int >= 1.")
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        """Raise if the ops are unavailable: never here (kept for upstream's callers)."""

    def __call__(
        self,
        op: MultiTensorOp,
        noop_flag_buffer: Tensor,
        tensor_lists: Sequence[Sequence[Tensor]],
        *args: Any,
    ) -> Any:
        """Return ``op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)``."""
        self.check_avail()
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(DEFAULT_CHUNK_SIZE)
"""The shared applier, as ``colossalai.utils.multi_tensor_applier``."""


def _check_lists(name: str, tensor_lists: Sequence[Sequence[Tensor]], count: int) -> None:
    if len(tensor_lists) != count:
        raise ValueError(
            f"{name} takes {count} tensor list(s), got {len(tensor_lists)}; see its docstring."
        )
    lengths = {len(t) for t in tensor_lists}
    if len(lengths) > 1:
        raise ValueError(f"{name}: the tensor lists have different lengths {sorted(lengths)}.")


def _flag_if(noop_flag_buffer: Tensor, bad: Tensor) -> None:
    """Set the flag to 1 where ``bad`` (a 0-dim bool tensor), without a host sync."""
    one = torch.ones_like(noop_flag_buffer)
    noop_flag_buffer.copy_(torch.where(bad.to(noop_flag_buffer.device), one, noop_flag_buffer))


def multi_tensor_scale(
    chunk_size: int,
    noop_flag_buffer: Tensor,
    tensor_lists: Sequence[Sequence[Tensor]],
    scale: float,
) -> None:
    """``out[i] = in[i] * scale`` for ``tensor_lists = [ins, outs]`` (``outs`` may be ``ins``,
    and may have another dtype: fp32 master gradients into fp16 model gradients and back).

    Sets ``noop_flag_buffer`` to 1 if an input holds ``inf`` or ``nan`` (the scaled values are
    still written, as upstream's kernel does).

    Raises:
        ValueError: not two lists of the same length, or a pair of different sizes.
    """
    del chunk_size  # upstream's launch granularity; no effect on the result (see MultiTensorApply)
    _check_lists("multi_tensor_scale", tensor_lists, 2)
    ins, outs = tensor_lists
    if not ins:
        return
    bad = torch.zeros((), dtype=torch.bool, device=noop_flag_buffer.device)
    for src, dst in zip(ins, outs, strict=True):
        if src.numel() != dst.numel():
            raise ValueError(
                f"multi_tensor_scale: input of {src.numel()} elements paired with an output of "
                f"{dst.numel()}; pair tensors of the same size."
            )
        bad |= ~torch.isfinite(src).all().to(bad.device)
        dst.copy_((src * scale).reshape(dst.shape))
    _flag_if(noop_flag_buffer, bad)


def multi_tensor_l2norm(
    chunk_size: int,
    noop_flag_buffer: Tensor,
    tensor_lists: Sequence[Sequence[Tensor]],
    per_tensor: bool = False,
) -> tuple[Tensor, Tensor]:
    """The L2 norm of all tensors of ``tensor_lists = [tensors]`` together, in fp32.

    Returns:
        ``(norm, per_tensor_norms)``: ``norm`` is a one-element fp32 tensor; with
        ``per_tensor``, ``per_tensor_norms`` holds each tensor's norm (fp32, one per tensor),
        else it is empty. Sets ``noop_flag_buffer`` to 1 when the norm is not finite.

    Raises:
        ValueError: not exactly one list of tensors.
    """
    del chunk_size  # upstream's launch granularity; no effect on the result (see MultiTensorApply)
    _check_lists("multi_tensor_l2norm", tensor_lists, 1)
    (tensors,) = tensor_lists
    device = tensors[0].device if tensors else noop_flag_buffer.device
    if not tensors:
        return torch.zeros(1, device=device), torch.zeros(0, device=device)
    norms = torch.stack(
        [n.to(device) for n in torch._foreach_norm(list(tensors), 2, dtype=torch.float32)]
    )
    total = torch.linalg.vector_norm(norms).reshape(1)
    _flag_if(noop_flag_buffer, ~torch.isfinite(total[0]))
    return total, norms if per_tensor else torch.zeros(0, device=device)
