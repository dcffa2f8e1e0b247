"""kolossos.nn.lr_scheduler: every schedule against its closed form, step by step, plus the
call forms the documentation uses, resuming from a state dict and argument validation."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kolossos.nn import lr_scheduler as ls

BASE = 0.5
T = 20


def optimizer(lr: float = BASE) -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=lr, momentum=0.9)


def rates(sched: torch.optim.lr_scheduler.LRScheduler, n: int) -> list[float]:
    """The rate in force at steps 0..n-1 (read before each ``step()``)."""
    out = []
    for _ in range(n):
        out.append(sched.get_last_lr()[0])
        sched.optimizer.step()
        sched.step()
    return out


def cos_anneal(base: float, eta_min: float, t: int, period: int) -> float:
    t = min(t, period)
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * t / period)) / 2


W = 4
CASES: dict[str, tuple[Callable[[torch.optim.Optimizer], Any], Callable[[int], float]]] = {
    "LinearWarmupLR": (
        lambda o: ls.LinearWarmupLR(o, T, warmup_steps=W),
        lambda t: BASE * (t + 1) / (W + 1) if t < W else BASE * max(T - t, 0) / (T - W),
    ),
    "CosineAnnealingLR": (
        lambda o: ls.CosineAnnealingLR(o, T, eta_min=0.01),
        lambda t: cos_anneal(BASE, 0.01, t, T),
    ),
    "CosineAnnealingWarmupLR": (
        lambda o: ls.CosineAnnealingWarmupLR(o, T, warmup_steps=W, eta_min=0.01),
        lambda t: BASE * (t + 1) / W if t < W else cos_anneal(BASE, 0.01, t - W, T - W),
    ),
    "FlatAnnealingLR": (
        lambda o: ls.FlatAnnealingLR(o, T, pct_start=0.5),
        lambda t: BASE if t < 10 else cos_anneal(BASE, 0.0, t - 10, 10),
    ),
    "FlatAnnealingWarmupLR": (  # flat for int(16 * 0.72) = 11 steps after warm-up
        lambda o: ls.FlatAnnealingWarmupLR(o, T, warmup_steps=W, eta_min=0.02),
        lambda t: (
            BASE * (t + 1) / W if t < W else BASE if t < 15 else cos_anneal(BASE, 0.02, t - 15, 5)
        ),
    ),
    "MultiStepLR": (
        lambda o: ls.MultiStepLR(o, T, milestones=[5, 12], gamma=0.5),
        lambda t: BASE * 0.5 ** ((t >= 5) + (t >= 12)),
    ),
    "MultiStepWarmupLR": (  # milestone 2 falls inside the warm-up and is dropped
        lambda o: ls.MultiStepWarmupLR(o, T, warmup_steps=W, milestones=[2, 8, 12], gamma=0.5),
        lambda t: BASE * (t + 1) / W if t < W else BASE * 0.5 ** ((t >= 8) + (t >= 12)),
    ),
    "PolynomialLR": (
        lambda o: ls.PolynomialLR(o, T, end_lr=0.01, power=2.0),
        lambda t: (BASE - 0.01) * (1 - min(t, T) / T) ** 2 + 0.01,
    ),
    "PolynomialWarmupLR": (
        lambda o: ls.PolynomialWarmupLR(o, T, warmup_steps=W, end_lr=0.01, power=1.0),
        lambda t: (
            BASE * (t + 1) / W
            if t < W
            else (BASE - 0.01) * (1 - min(t - W, T - W) / (T - W)) + 0.01
        ),
    ),
    "LambdaLR": (lambda o: ls.LambdaLR(o, T, lr_lambda=lambda t: 0.9**t), lambda t: BASE * 0.9**t),
    "MultiplicativeLR": (
        lambda o: ls.MultiplicativeLR(o, T, lr_lambda=lambda t: 0.9),
        lambda t: BASE * 0.9**t,
    ),
    "StepLR": (lambda o: ls.StepLR(o, T, step_size=3, gamma=0.5), lambda t: BASE * 0.5 ** (t // 3)),
    "ExponentialLR": (lambda o: ls.ExponentialLR(o, T, gamma=0.9), lambda t: BASE * 0.9**t),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_schedule_matches_closed_form(name: str) -> None:
    make, closed = CASES[name]
    got = rates(make(optimizer()), T + 3)
    want = [closed(t) for t in range(T + 3)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15), name


@pytest.mark.parametrize("name", sorted(set(CASES) - {"MultiplicativeLR"}))
def test_resume_from_state_dict(name: str) -> None:
    make, closed = CASES[name]
    first = make(optimizer())
    rates(first, 7)
    opt = optimizer()
    opt.load_state_dict(first.optimizer.state_dict())
    second = make(opt)
    second.load_state_dict(first.state_dict())
    assert rates(second, 5) == pytest.approx([closed(t) for t in range(7, 12)], rel=1e-12)


def test_every_documented_scheduler_exists() -> None:
    names = [
        *("CosineAnnealingLR", "CosineAnnealingWarmupLR", "FlatAnnealingLR"),
        *("FlatAnnealingWarmupLR", "LinearWarmupLR", "MultiStepLR", "MultiStepWarmupLR"),
        *("OneCycleLR", "PolynomialLR", "PolynomialWarmupLR", "LambdaLR", "MultiplicativeLR"),
        *("StepLR", "ExponentialLR"),
    ]
    assert sorted(names) == sorted(ls.__all__)
    assert set(CASES) | {"OneCycleLR"} == set(names)


def test_documented_call_forms() -> None:
    """As the docs call them: keyword, positional total_steps, and keyword optimizer."""
    assert ls.LinearWarmupLR(optimizer(), warmup_steps=50, total_steps=100).get_last_lr() == [
        pytest.approx(BASE / 51)
    ]
    assert ls.LinearWarmupLR(optimizer(), 10, warmup_steps=1).get_last_lr() == [BASE / 2]
    sched = ls.CosineAnnealingWarmupLR(optimizer=optimizer(), total_steps=10, warmup_steps=2)
    assert sched.get_last_lr() == [BASE / 2]
    assert ls.CosineAnnealingLR(optimizer(), total_steps=10).get_last_lr() == [BASE]
    # the tutorial's 2-epoch run with 50 warm-up steps: the rate only rises
    assert rates(ls.LinearWarmupLR(optimizer(), warmup_steps=50, total_steps=2), 3) == [
        pytest.approx(BASE * k / 51) for k in (1, 2, 3)
    ]
    for make in (ls.CosineAnnealingWarmupLR, ls.FlatAnnealingWarmupLR, ls.PolynomialWarmupLR):
        assert rates(make(optimizer(), 2, warmup_steps=5), 3) == pytest.approx(
            [BASE * k / 5 for k in (1, 2, 3)]
        )


def test_cosine_equals_torch_within_the_period() -> None:
    ours = rates(ls.CosineAnnealingLR(optimizer(), T, eta_min=0.01), T + 1)
    ref = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer(), T_max=T, eta_min=0.01)
    assert ours == pytest.approx(rates(ref, T + 1), rel=1e-9, abs=1e-12)


def test_one_cycle_uses_group_rates_as_peaks() -> None:
    ours = ls.OneCycleLR(optimizer(), total_steps=T, pct_start=0.25)
    ref = torch.optim.lr_scheduler.OneCycleLR(optimizer(), max_lr=BASE, total_steps=T,
                                              pct_start=0.25)  # fmt: skip
    assert rates(ours, T) == pytest.approx(rates(ref, T), rel=1e-12)
    assert max(rates(ls.OneCycleLR(optimizer(), total_steps=T), T)) == pytest.approx(BASE)


def test_multiple_groups_follow_their_own_base() -> None:
    p, q = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([{"params": [p], "lr": 1.0}, {"params": [q], "lr": 0.1}])
    sched = ls.LinearWarmupLR(opt, 10, warmup_steps=1)
    assert sched.get_last_lr() == [0.5, 0.05]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda o: ls.LinearWarmupLR(o, 0), "total_steps"),
        (lambda o: ls.CosineAnnealingWarmupLR(o, 10, warmup_steps=-1), "warmup_steps"),
        (lambda o: ls.FlatAnnealingLR(o, 10, pct_start=1.5), "pct_start"),
        (lambda o: ls.PolynomialLR(o, 10, end_lr=-1.0), "end_lr"),
        (lambda o: ls.MultiStepLR(o, 10), "milestones"),
        (lambda o: ls.MultiStepWarmupLR(o, 10, milestones=[]), "milestones"),
        (lambda o: ls.LambdaLR(o, 10), "lr_lambda"),
    ],
)
def test_validation(make: Callable[[torch.optim.Optimizer], Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(optimizer())


def test_works_with_kolossos_optimizers() -> None:
    from kolossos.nn.optimizer import HybridAdam

    model = torch.nn.Linear(2, 2)
    opt = HybridAdam(model.parameters(), lr=1e-3)
    sched = ls.CosineAnnealingWarmupLR(opt, total_steps=4, warmup_steps=2)
    for _ in range(4):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(cos_anneal(1e-3, 0.0, 2, 2))
