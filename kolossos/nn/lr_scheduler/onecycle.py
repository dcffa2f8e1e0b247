"""The 1cycle policy (Smith and Topin, 2017) with the optimizer's rates as the peaks."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.lr_scheduler import OneCycleLR as _TorchOneCycleLR

__all__ = ["OneCycleLR"]


class OneCycleLR(_TorchOneCycleLR):
    """``torch.optim.lr_scheduler.OneCycleLR`` whose ``max_lr`` is each group's current rate.

    The rate rises from ``max_lr / div_factor`` to ``max_lr`` over ``pct_start`` of the steps,
    then anneals to ``max_lr / div_factor / final_div_factor``; momentum (or Adam's beta1)
    cycles inversely when ``cycle_momentum``.

    Args:
        optimizer: the wrapped optimizer; its groups' ``lr`` become the peaks.
        total_steps: steps in the cycle.
        pct_start: share of the steps spent rising.
        anneal_strategy: ``"cos"`` or ``"linear"``.
        cycle_momentum: cycle momentum inversely to the rate.
        base_momentum: momentum at the peak rate.
        max_momentum: momentum at the start and end.
        div_factor: initial rate = ``max_lr / div_factor``.
        final_div_factor: final rate = initial rate / ``final_div_factor``.
        last_epoch: index of the last step taken (-1: start from the beginning).
        **kwargs: passed on to torch (``three_phase``).

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0, momentum=0.9)
        >>> [round(lr, 6) for lr in OneCycleLR(opt, total_steps=10).get_last_lr()]
        [0.04]
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        pct_start: float = 0.3,
        anneal_strategy: str = "cos",
        cycle_momentum: bool = True,
        base_momentum: float = 0.85,
        max_momentum: float = 0.95,
        div_factor: float = 25.0,
        final_div_factor: float = 10000.0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        if last_epoch == -1:
            max_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        else:  # resuming: torch keeps the peaks in each group
            max_lrs = [float(group["max_lr"]) for group in optimizer.param_groups]
        super().__init__(
            optimizer,
            max_lrs,
            total_steps=total_steps,
            pct_start=pct_start,
            anneal_strategy=anneal_strategy,  # type: ignore[arg-type]
            cycle_momentum=cycle_momentum,
            base_momentum=base_momentum,
            max_momentum=max_momentum,
            div_factor=div_factor,
            final_div_factor=final_div_factor,
            last_epoch=last_epoch,
            **kwargs,
        )
