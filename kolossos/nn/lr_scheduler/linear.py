"""Linear warm-up followed by linear decay."""

from __future__ import annotations

import torch

from kolossos.nn.lr_scheduler._closed_form import ClosedFormLR, check_steps

__all__ = ["LinearWarmupLR"]


class LinearWarmupLR(ClosedFormLR):
    """Rises linearly for ``warmup_steps`` steps, then decays linearly to 0 at ``total_steps``.

    At step ``t``: ``base * (t + 1) / (warmup_steps + 1)`` while ``t < warmup_steps``, then
    ``base * (total_steps - t) / (total_steps - warmup_steps)``, never below 0.

    Args:
        optimizer: the wrapped optimizer.
        total_steps: number of training steps.
        warmup_steps: steps of warm-up.
        last_epoch: index of the last step taken (-1: start from the beginning).

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=1.0)
        >>> sched = LinearWarmupLR(opt, total_steps=10, warmup_steps=1)
        >>> sched.get_last_lr()
        [0.5]
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        last_epoch: int = -1,
    ) -> None:
        check_steps(total_steps, warmup_steps)
        self.total_steps, self.warmup_steps = int(total_steps), int(warmup_steps)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, step: int) -> float:
        """See the class docstring."""
        if step < self.warmup_steps:
            return base_lr * (step + 1) / (self.warmup_steps + 1)
        if self.total_steps == self.warmup_steps:
            return 0.0
        remaining = max(self.total_steps - step, 0)
        return base_lr * remaining / (self.total_steps - self.warmup_steps)
