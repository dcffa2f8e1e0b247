"""torch's LambdaLR, MultiplicativeLR, StepLR and ExponentialLR with Colossal-AI's signatures
(a leading ``total_steps`` argument, unused by these schedules)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim import lr_scheduler as _torch

__all__ = ["ExponentialLR", "LambdaLR", "MultiplicativeLR", "StepLR"]

Lambda = Callable[[int], float] | list[Callable[[int], float]]


def _need(lr_lambda: Lambda | None) -> Lambda:
    if lr_lambda is None:
        raise ValueError("lr_lambda: give a function of the step (or one per parameter group)")
    return lr_lambda


class LambdaLR(_torch.LambdaLR):
    """``base * lr_lambda(t)``.

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        >>> LambdaLR(opt, 10, lr_lambda=lambda t: 0.5).get_last_lr()
        [0.5]
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        lr_lambda: Lambda | None = None,
        last_epoch: int = -1,
    ) -> None:
        super().__init__(optimizer, _need(lr_lambda), last_epoch=last_epoch)


class MultiplicativeLR(_torch.MultiplicativeLR):
    """The previous rate times ``lr_lambda(t)`` at each step after the first.

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        >>> sched = MultiplicativeLR(opt, 10, lr_lambda=lambda t: 0.5)
        >>> sched.step(); sched.get_last_lr()
        [0.5]
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        lr_lambda: Lambda | None = None,
        last_epoch: int = -1,
    ) -> None:
        super().__init__(optimizer, _need(lr_lambda), last_epoch=last_epoch)


class StepLR(_torch.StepLR):
    """``base * gamma ** (t // step_size)``.

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        >>> sched = StepLR(opt, 10, step_size=1, gamma=0.5)
        >>> sched.step(); sched.get_last_lr()
        [0.5]
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        step_size: int = 1,
        gamma: float = 0.1,
        last_epoch: int = -1,
    ) -> None:
        super().__init__(optimizer, step_size, gamma=gamma, last_epoch=last_epoch)


class ExponentialLR(_torch.ExponentialLR):
    """``base * gamma ** t``.

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        >>> sched = ExponentialLR(opt, 10, gamma=0.5)
        >>> sched.step(); sched.get_last_lr()
        [0.5]
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        gamma: float = 1.0,
        last_epoch: int = -1,
    ) -> None:
        super().__init__(optimizer, gamma, last_epoch=last_epoch)
