"""Base class of the schedulers whose learning rate is a closed-form function of the step."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["ClosedFormLR", "ClosedFormWarmupLR", "check_steps", "cosine", "warmup"]


def check_steps(total_steps: int, warmup_steps: int = 0) -> None:
    """Raise ``ValueError`` unless ``total_steps >= 1`` and ``warmup_steps >= 0`` are integers.

    ``warmup_steps > total_steps`` is allowed (the tutorials warm up for 50 steps of a 2-epoch
    run): the rate then only rises."""
    if int(total_steps) != total_steps or total_steps < 1:
        raise ValueError(f"total_steps={total_steps!r}: must be a positive integer")
    if int(warmup_steps) != warmup_steps or warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps!r}: must be a non-negative integer")


def warmup(base_lr: float, step: int, warmup_steps: int) -> float:
    """Linear warm-up used by the ``*WarmupLR`` schedulers: ``base_lr * (step + 1) / warmup``."""
    return base_lr * (step + 1) / warmup_steps


def cosine(base_lr: float, eta_min: float, step: int, period: int) -> float:
    """Half a cosine from ``base_lr`` (step 0) to ``eta_min`` (step ``period``), flat after."""
    if period <= 0:
        return eta_min
    t = min(max(step, 0), period)
    return eta_min + (base_lr - eta_min) * (1 + math.cos(math.pi * t / period)) / 2


class ClosedFormLR(LRScheduler):
    """A scheduler whose rate at step ``t`` is ``lr_at(base_lr, t)`` (no recursion: resuming
    from ``last_epoch`` or stepping with an explicit epoch gives the same rates).

    Subclasses set their attributes before calling ``super().__init__`` and define
    :meth:`lr_at`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, last_epoch: int = -1) -> None:
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, step: int) -> float:
        """The learning rate at step ``step`` of a group whose initial rate is ``base_lr``."""
        raise NotImplementedError

    def get_lr(self) -> list[float]:  # type: ignore[override]
        """Rates of every parameter group at ``last_epoch``."""
        return [self.lr_at(float(base), self.last_epoch) for base in self.base_lrs]

    _get_closed_form_lr = get_lr


class ClosedFormWarmupLR(ClosedFormLR):
    """A :class:`ClosedFormLR` that warms up linearly (:func:`warmup`) for ``warmup_steps``
    steps, then follows :meth:`after_warmup` over the remaining ``total_steps - warmup_steps``.

    Subclasses validate and set their own attributes, then call ``super().__init__``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_steps: int,
        last_epoch: int = -1,
    ) -> None:
        check_steps(total_steps, warmup_steps)
        self.total_steps, self.warmup_steps = int(total_steps), int(warmup_steps)
        super().__init__(optimizer, last_epoch)

    def after_warmup(self, base_lr: float, step: int, period: int) -> float:
        """The rate ``step`` steps after the warm-up, of ``period`` steps left in total."""
        raise NotImplementedError

    def lr_at(self, base_lr: float, step: int) -> float:
        """See the class docstring."""
        if step < self.warmup_steps:
            return warmup(base_lr, step, self.warmup_steps)
        period = self.total_steps - self.warmup_steps
        return self.after_warmup(base_lr, step - self.warmup_steps, period)
