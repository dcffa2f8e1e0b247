"""Cosine annealing, with optional linear warm-up and a flat phase."""

from __future__ import annotations

import torch

from kolossos.nn.lr_scheduler._closed_form import (
    ClosedFormLR,
    ClosedFormWarmupLR,
    check_steps,
    cosine,
)

__all__ = [
    "CosineAnnealingLR",
    "CosineAnnealingWarmupLR",
    "FlatAnnealingLR",
    "FlatAnnealingWarmupLR",
]


def _check_pct(pct_start: float) -> None:
    if not 0.0 <= pct_start <= 1.0:
        raise ValueError(f"pct_start={pct_start!r}: must lie in [0, 1]")


class CosineAnnealingLR(ClosedFormLR):
    """``eta_min + (base - eta_min) * (1 + cos(pi * t / total_steps)) / 2``; ``eta_min`` after.

    Args:
        optimizer: the wrapped optimizer.
        total_steps: steps from the initial rate to ``eta_min``.
        eta_min: final learning rate.
        last_epoch: index of the last step taken (-1: start from the beginning).

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        >>> sched = CosineAnnealingLR(opt, total_steps=2)
        >>> sched.step(); sched.get_last_lr()
        [0.5]
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        eta_min: float = 0,
        last_epoch: int = -1,
    ) -> None:
        check_steps(total_steps)
        self.total_steps, self.eta_min = int(total_steps), float(eta_min)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, step: int) -> float:
        """See the class docstring."""
        return cosine(base_lr, self.eta_min, step, self.total_steps)


class CosineAnnealingWarmupLR(ClosedFormWarmupLR):
    """Linear warm-up (``base * (t + 1) / warmup_steps``), then cosine annealing from the base rate
    to ``eta_min`` over the remaining ``total_steps - warmup_steps`` steps.

    Args:
        optimizer: the wrapped optimizer.
        total_steps: number of training steps.
        warmup_steps: steps of warm-up.
        eta_min: final learning rate.
        last_epoch: index of the last step taken (-1: start from the beginning).

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        >>> CosineAnnealingWarmupLR(opt, total_steps=10, warmup_steps=4).get_last_lr()
        [0.25]
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        eta_min: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        self.eta_min = float(eta_min)
        super().__init__(optimizer, total_steps, warmup_steps, last_epoch)

    def after_warmup(self, base_lr: float, step: int, period: int) -> float:
        """See the class docstring."""
        return cosine(base_lr, self.eta_min, step, period)


class FlatAnnealingLR(ClosedFormLR):
    """The base rate for ``int(total_steps * pct_start)`` steps, then cosine annealing to 0.

    Args:
        optimizer: the wrapped optimizer.
        total_steps: number of training steps.
        pct_start: share of the steps kept flat.
        last_epoch: index of the last step taken (-1: start from the beginning).

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        >>> FlatAnnealingLR(opt, total_steps=10, pct_start=0.5).get_last_lr()
        [1.0]
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        pct_start: float = 0.72,
        last_epoch: int = -1,
    ) -> None:
        check_steps(total_steps)
        _check_pct(pct_start)
        self.total_steps = int(total_steps)
        self.flat_steps = int(total_steps * pct_start)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, step: int) -> float:
        """See the class docstring."""
        if step < self.flat_steps:
            return base_lr
        return cosine(base_lr, 0.0, step - self.flat_steps, self.total_steps - self.flat_steps)


class FlatAnnealingWarmupLR(ClosedFormWarmupLR):
    """Linear warm-up, a flat phase of ``int((total_steps - warmup_steps) * pct_start)`` steps,
    then cosine annealing to ``eta_min`` at ``total_steps``.

    Args:
        optimizer: the wrapped optimizer.
        total_steps: number of training steps.
        warmup_steps: steps of warm-up.
        pct_start: share of the steps after warm-up kept flat.
        eta_min: final learning rate.
        last_epoch: index of the last step taken (-1: start from the beginning).

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        >>> FlatAnnealingWarmupLR(opt, total_steps=10, warmup_steps=2).get_last_lr()
        [0.5]
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        pct_start: float = 0.72,
        eta_min: float = 0,
        last_epoch: int = -1,
    ) -> None:
        _check_pct(pct_start)
        self.flat_steps = max(0, int((total_steps - warmup_steps) * pct_start))
        self.eta_min = float(eta_min)
        super().__init__(optimizer, total_steps, warmup_steps, last_epoch)

    def after_warmup(self, base_lr: float, step: int, period: int) -> float:
        """See the class docstring."""
        if step < self.flat_steps:
            return base_lr
        return cosine(base_lr, self.eta_min, step - self.flat_steps, period - self.flat_steps)
