"""Learning-rate schedulers with the names and signatures of ``colossalai.nn.lr_scheduler``.

Every scheduler takes ``(optimizer, total_steps, ...)`` and behaves like a torch scheduler
(``step()``, ``get_last_lr()``, ``state_dict()``). The warm-up/cosine/flat/polynomial/multi-step
ones compute the rate in closed form from the step number.

Example:
    >>> import torch
    >>> from kolossos.nn.lr_scheduler import LinearWarmupLR
    >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    >>> sched = LinearWarmupLR(opt, warmup_steps=50, total_steps=1000)
"""

from __future__ import annotations

from kolossos.nn.lr_scheduler.cosine import (
    CosineAnnealingLR,
    CosineAnnealingWarmupLR,
    FlatAnnealingLR,
    FlatAnnealingWarmupLR,
)
from kolossos.nn.lr_scheduler.linear import LinearWarmupLR
from kolossos.nn.lr_scheduler.multistep import MultiStepLR, MultiStepWarmupLR
from kolossos.nn.lr_scheduler.onecycle import OneCycleLR
from kolossos.nn.lr_scheduler.poly import PolynomialLR, PolynomialWarmupLR
from kolossos.nn.lr_scheduler.torch_schedulers import (
    ExponentialLR,
    LambdaLR,
    MultiplicativeLR,
    StepLR,
)

__all__ = [
    "CosineAnnealingLR",
    "CosineAnnealingWarmupLR",
    "ExponentialLR",
    "FlatAnnealingLR",
    "FlatAnnealingWarmupLR",
    "LambdaLR",
    "LinearWarmupLR",
    "MultiStepLR",
    "MultiStepWarmupLR",
    "MultiplicativeLR",
    "OneCycleLR",
    "PolynomialLR",
    "PolynomialWarmupLR",
    "StepLR",
]
