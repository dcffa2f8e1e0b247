"""bf16 gradients for fp32 masters, widened inside kolossos' Adam update (both ZeRO engines).

A ZeRO engine training in bf16 reduces its gradients in bf16. Copying them to fp32 for the step
costs 4 bytes per parameter of the rank's share at the step's peak, and a pass over memory.
kolossos' Adams (``HybridAdam``, ``CPUAdam``, ``FusedAdam``) widen a gradient narrower than its
states inside the update instead, a piece at a time (cache-sized on the CPU, 16 Mi elements on
an accelerator), so the engines hand them the bf16 gradients as they are: the values are the
same (bf16 to fp32 is exact) and so is the update.

Clipping must then not scale the bf16 gradients in place, which would round the products to
bf16. :class:`DeferredClip` scales fp32 gradients in place as before and keeps the factor of the
bf16 ones for the update, which multiplies it in after widening: the same fp32 products.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import torch
from torch.optim import Optimizer

from kolossos.nn.optimizer._adam_base import AdamBase

__all__ = ["DeferredClip", "allow_narrow_grads", "narrow_grads_supported", "takes_narrow_grads"]


def narrow_grads_supported(
    optim: Optimizer, masters: Sequence[torch.Tensor], working_dtype: torch.dtype
) -> bool:
    """Whether ``optim`` can step every one of the fp32 ``masters`` with bf16 gradients
    (:func:`takes_narrow_grads` for each)."""
    return _narrow_update(optim, working_dtype) and all(
        takes_narrow_grads(optim, m, working_dtype) for m in masters
    )


def takes_narrow_grads(optim: Optimizer, master: torch.Tensor, working_dtype: torch.dtype) -> bool:
    """Whether ``optim`` can step the fp32 ``master`` with a bf16 gradient: bf16 working
    weights, one of kolossos' Adams not streaming this master's states from NVMe, and torch
    2.10 or later (a ``.grad`` of another dtype than its tensor's)."""
    return (
        _narrow_update(optim, working_dtype)
        and isinstance(optim, AdamBase)  # (checked there too; narrows the type here)
        and master.dtype == torch.float32
        and not optim.is_streamed(master)
    )


def _narrow_update(optim: Optimizer, working_dtype: torch.dtype) -> bool:
    return (
        working_dtype == torch.bfloat16
        and isinstance(optim, AdamBase)
        and hasattr(torch.Tensor, "grad_dtype")
    )


def allow_narrow_grads(masters: Iterable[torch.Tensor]) -> None:
    """Let every master take a ``.grad`` of another dtype (leaf tensors, before any gradient)."""
    for master in masters:
        master.grad_dtype = None


class DeferredClip:
    """Clipping for gradients of which some may be bf16 (module doc).

    Args:
        enabled: the engine hands bf16 gradients to the update (:func:`narrow_grads_supported`);
            ``False`` scales every gradient in place.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.factor: torch.Tensor | None = None
        """the clipping factor not yet applied to the bf16 gradients"""

    @classmethod
    def for_update(
        cls, optim: Optimizer, masters: Sequence[torch.Tensor], working_dtype: torch.dtype
    ) -> DeferredClip:
        """Enabled when :func:`narrow_grads_supported`; the masters then accept bf16 grads."""
        enabled = narrow_grads_supported(optim, masters, working_dtype)
        if enabled:
            allow_narrow_grads(masters)
        return cls(enabled)

    def takes(self, grad: torch.Tensor, master: torch.Tensor) -> bool:
        """Whether the update takes ``grad`` for ``master`` as it is: on the master's device and
        of its dtype, or (when enabled) bf16."""
        return grad.device == master.device and (grad.dtype == master.dtype or self.enabled)

    def scale(self, grads: Iterable[torch.Tensor | None], coef: torch.Tensor) -> None:
        """Clip ``grads`` by ``coef``: fp32 ones (all when disabled) in place, bf16 ones later."""
        deferred = False
        for g in grads:
            if g is None:
                continue
            if self.enabled and g.dtype != torch.float32:
                deferred = True
            else:
                g.mul_(coef.to(g.device))
        if deferred:
            self.factor = coef if self.factor is None else self.factor * coef

    def widen(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` with the pending factor applied: a bf16 one widened to fp32 and scaled (a
        new tensor), an fp32 one as it is. For code that must see the clipped values before
        the update (clipping by value, a backward that adds to the gradients)."""
        if self.factor is None or grad.dtype == torch.float32:
            return grad
        return grad.float().mul_(self.factor.to(grad.device))

    def apply(self, grads: list[torch.Tensor | None]) -> None:
        """Apply the pending factor now: each entry of ``grads`` replaced by :meth:`widen`."""
        if self.factor is not None:
            grads[:] = [None if g is None else self.widen(g) for g in grads]
            self.clear()

    def clear(self) -> None:
        """Forget the pending factor (the gradients it was for are gone, or it was applied)."""
        self.factor = None

    def stepping(self, optim: Optimizer) -> contextlib.AbstractContextManager[None]:
        """The update's context: the pending factor goes to the optimizer (and is cleared)."""
        factor, self.factor = self.factor, None
        if factor is None:
            return contextlib.nullcontext()
        assert isinstance(optim, AdamBase), "only kolossos' Adams are given bf16 gradients"
        return optim.narrow_grads_scaled(factor)
