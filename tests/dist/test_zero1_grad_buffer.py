"""ZeRO-1's flat gradient buffer lives from a step's first gradient to ``zero_grad`` only
(``kolossos/zero/low_level/grad_buffers.py``): it is not alive during the next forward, ranges
no gradient reaches are zeroed rather than left stale, and ``no_sync`` keeps accumulating. Outside
accumulation no full buffer exists, and a bucket inside one gradient is sent from it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.booster import Booster
from kolossos.booster.plugin import LowLevelZeroPlugin
from kolossos.testing import distributed
from kolossos.zero.low_level import LowLevelZeroOptimizer
from kolossos.zero.low_level.bucket import BufferPool


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


@distributed(3)
def test_a_bucket_inside_one_gradient_is_sent_without_a_copy(monkeypatch: Any) -> None:
    """Every bucket of a lone weight lies inside its gradient: no bucket buffer is taken while
    the gradient already has the communication dtype, one per bucket when it must be cast."""
    taken: list[int] = []
    original = BufferPool.acquire

    def counting(pool: BufferPool, numel: int) -> torch.Tensor:
        taken.append(numel)
        return original(pool, numel)

    monkeypatch.setattr(BufferPool, "acquire", counting)
    for stage, comm_dtype, copies in ((1, None, False), (2, None, False), (2, torch.float32, True)):
        torch.manual_seed(0)
        model = nn.Linear(48, 64, bias=False)  # 3072 elements: 1024 a rank, 4 buckets of <= 300
        plugin = LowLevelZeroPlugin(stage=stage, precision="bf16", communication_dtype=comm_dtype,
                                    reduce_bucket_size_in_m=300 / 2**20)  # fmt: skip
        boosted, opt, *_ = Booster(plugin=plugin).boost(model, torch.optim.SGD(model.parameters()))
        taken.clear()
        loss = boosted(torch.randn(4, 48, dtype=torch.bfloat16)).float().square().mean()
        opt.backward(loss)
        buckets = len(opt.reducer.buckets)
        assert buckets == 3 * 4
        assert len(taken) == (buckets if copies else 0), (stage, comm_dtype, taken)
        opt.step()
