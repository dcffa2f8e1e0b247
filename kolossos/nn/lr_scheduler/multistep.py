"""Step decay at milestones, with optional linear warm-up."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import torch

from kolossos.nn.lr_scheduler._closed_form import ClosedFormLR, ClosedFormWarmupLR, check_steps

__all__ = ["MultiStepLR", "MultiStepWarmupLR"]


def _milestones(milestones: Sequence[int] | None) -> list[int]:
    if milestones is None or len(milestones) == 0:
        raise ValueError("milestones: give the steps at which to decay, e.g. milestones=[30, 60]")
    return sorted(int(m) for m in milestones)


class MultiStepLR(ClosedFormLR):
    """``base * gamma ** (number of milestones <= t)``.

    Args:
        optimizer: the wrapped optimizer.
        total_steps: number of training steps (accepted for Colossal-AI compatibility).
        milestones: steps at which the rate is multiplied by ``gamma``.
        gamma: decay factor.
        last_epoch: index of the last step taken (-1: start from the beginning).

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        >>> sched = MultiStepLR(opt, total_steps=10, milestones=[1], gamma=0.5)
        >>> sched.step(); sched.get_last_lr()
        [0.5]
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        milestones: Sequence[int] | None = None,
        gamma: float = 0.1,
        last_epoch: int = -1,
    ) -> None:
        check_steps(total_steps)
        self.total_steps, self.milestones, self.gamma = (
            int(total_steps),
            _milestones(milestones),
            float(gamma),
        )
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, step: int) -> float:
        """See the class docstring."""
        return base_lr * self.gamma ** bisect_right(self.milestones, step)


class MultiStepWarmupLR(ClosedFormWarmupLR):
    """Linear warm-up (``base * (t + 1) / warmup_steps``), then ``base * gamma ** k`` with ``k``
    the number of milestones ``m`` with ``warmup_steps <= m <= t`` (milestones inside the
    warm-up are dropped, as in Colossal-AI).

    Args:
        optimizer: the wrapped optimizer.
        total_steps: number of training steps.
        warmup_steps: steps of warm-up.
        milestones: steps at which the rate is multiplied by ``gamma``.
        gamma: decay factor.
        last_epoch: index of the last step taken (-1: start from the beginning).

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        >>> MultiStepWarmupLR(opt, 10, warmup_steps=2, milestones=[5]).get_last_lr()
        [0.5]
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        milestones: Sequence[int] | None = None,
        gamma: float = 0.1,
        last_epoch: int = -1,
    ) -> None:
        self.milestones = [m for m in _milestones(milestones) if m >= warmup_steps]
        self.gamma = float(gamma)
        super().__init__(optimizer, total_steps, warmup_steps, last_epoch)

    def after_warmup(self, base_lr: float, step: int, period: int) -> float:
        """See the class docstring (milestones count from the start, warm-up included)."""
        return base_lr * self.gamma ** bisect_right(self.milestones, self.warmup_steps + step)
