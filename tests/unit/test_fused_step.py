"""``fused_adam_step``: torch's fused Adam kernel for the ZeRO engines' host shards."""

from __future__ import annotations

import pytest
import torch

from kolossos.nn.optimizer.fused_step import fused_adam_step


def _run(
    cls: type[torch.optim.Optimizer], fused: bool, steps: int = 5, **kw: object
) -> torch.Tensor:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(1000))
    start = param.detach().clone()
    opt = cls([param], lr=1e-2, weight_decay=0.1, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        param.grad = torch.randn(1000, generator=gen)
        if fused:
            with fused_adam_step(opt) as switched:
                opt.step()
            assert switched == 1
            assert opt.param_groups[0]["fused"] is None  # restored: state_dict unchanged
        else:
            opt.step()
    assert (param.detach() - start).abs().max() > 1e-2  # it trained
    return param.detach()


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_fused_matches_the_loop(cls: type[torch.optim.Optimizer], amsgrad: bool) -> None:
    loop = _run(cls, fused=False, amsgrad=amsgrad)
    fused = _run(cls, fused=True, amsgrad=amsgrad)
    torch.testing.assert_close(fused, loop, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "opt",
    [
        lambda p: torch.optim.Adam(p, foreach=False),  # the user chose the loop
        lambda p: torch.optim.Adam(p, differentiable=True),
        lambda p: torch.optim.SGD(p, lr=0.1),  # not an Adam
        lambda p: type("MyAdam", (torch.optim.Adam,), {})(p),  # a subclass may override step
    ],
)
def test_left_alone(opt: object) -> None:
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.ones(4)
    optimizer = opt([param])  # type: ignore[operator]
    before = dict(optimizer.param_groups[0])
    with fused_adam_step(optimizer) as switched:
        assert switched == 0
    assert optimizer.param_groups[0] == before


def test_kill_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KOLOSSOS_ADAM_IMPL", "foreach")
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.ones(4)
    with fused_adam_step(torch.optim.Adam([param])) as switched:
        assert switched == 0
