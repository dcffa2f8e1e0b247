"""ZeRO-1's flat gradient buffer lives from a step's first gradient to ``zero_grad`` only
(``kolossos/zero/low_level/grad_buffers.py``): it is not alive during the next forward, ranges
no gradient reaches are zeroed rather than left stale, and ``no_sync`` keeps accumulating."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.booster import Booster
from kolossos.booster.plugin import LowLevelZeroPlugin
from kolossos.testing import distributed
from kolossos.zero.low_level import LowLevelZeroOptimizer


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.branch(h) if use_branch else h


@distributed(2)
def test_buffer_freed_between_steps_and_stale_ranges_zeroed() -> None:
    torch.manual_seed(0)
    model = Branchy()
    booster = Booster(plugin=LowLevelZeroPlugin(stage=1, precision="fp32"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # no state: zero gradient, no move
    boosted, opt, *_ = booster.boost(model, optimizer)
    zero = opt
    assert isinstance(zero, LowLevelZeroOptimizer) and zero.flat_grads is not None
    alive_in_forward: list[bool] = []
    model.register_forward_pre_hook(
        lambda *_: alive_in_forward.append(zero.flat_grads.alive(0))  # type: ignore[union-attr]
    )
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    branch = [p.detach().clone() for p in model.branch.parameters()]
    for use_branch in (True, False):  # the branch's gradient of step 1 must not leak into step 2
        booster.backward(boosted(x, use_branch).square().mean(), opt)
        opt.step()
        if use_branch:
            moved = [p.detach().clone() for p in model.branch.parameters()]
            assert any((a - b).abs().max() > 1e-3 for a, b in zip(moved, branch, strict=True))
        opt.zero_grad()
        assert not zero.flat_grads.alive(0)
        assert all(p.grad is None for p in model.parameters())
    for a, b in zip(model.branch.parameters(), moved, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)
    assert alive_in_forward == [False, False]
