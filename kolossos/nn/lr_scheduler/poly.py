"""Polynomial decay, with optional linear warm-up."""

from __future__ import annotations

import torch

from kolossos.nn.lr_scheduler._closed_form import ClosedFormLR, ClosedFormWarmupLR, check_steps

__all__ = ["PolynomialLR", "PolynomialWarmupLR"]


def _poly(base_lr: float, end_lr: float, power: float, step: int, period: int) -> float:
    if period <= 0:
        return end_lr
    t = min(max(step, 0), period)
    return (base_lr - end_lr) * (1 - t / period) ** power + end_lr


def _check(end_lr: float, power: float) -> None:
    if end_lr < 0:
        raise ValueError(f"end_lr={end_lr!r}: must be >= 0")
    if power < 0:
        raise ValueError(f"power={power!r}: must be >= 0")


class PolynomialLR(ClosedFormLR):
    """``(base - end_lr) * (1 - min(t, total_steps) / total_steps) ** power + end_lr``.

    Args:
        optimizer: the wrapped optimizer.
        total_steps: steps until ``end_lr``.
        end_lr: final learning rate.
        power: exponent (1: linear).
        last_epoch: index of the last step taken (-1: start from the beginning).

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        >>> sched = PolynomialLR(opt, total_steps=4, end_lr=0.0)
        >>> sched.step(); sched.get_last_lr()
        [0.75]
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        end_lr: float = 0.0001,
        power: float = 1.0,
        last_epoch: int = -1,
    ) -> None:
        check_steps(total_steps)
        _check(end_lr, power)
        self.total_steps, self.end_lr, self.power = int(total_steps), float(end_lr), float(power)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, step: int) -> float:
        """See the class docstring."""
        return _poly(base_lr, self.end_lr, self.power, step, self.total_steps)


class PolynomialWarmupLR(ClosedFormWarmupLR):
    """Linear warm-up (``base * (t + 1) / warmup_steps``), then :class:`PolynomialLR` over the
    remaining ``total_steps - warmup_steps`` steps.

    Args:
        optimizer: the wrapped optimizer.
        total_steps: number of training steps.
        warmup_steps: steps of warm-up.
        end_lr: final learning rate.
        power: exponent (1: linear).
        last_epoch: index of the last step taken (-1: start from the beginning).

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        >>> PolynomialWarmupLR(opt, total_steps=10, warmup_steps=2).get_last_lr()
        [0.5]
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        end_lr: float = 0.0001,
        power: float = 1.0,
        last_epoch: int = -1,
    ) -> None:
        _check(end_lr, power)
        self.end_lr, self.power = float(end_lr), float(power)
        super().__init__(optimizer, total_steps, warmup_steps, last_epoch)

    def after_warmup(self, base_lr: float, step: int, period: int) -> float:
        """See the class docstring."""
        return _poly(base_lr, self.end_lr, self.power, step, period)
