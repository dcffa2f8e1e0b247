"""``parallel = dict(moe=dict(size=2))`` through ``kolossos.launch`` + ``kolossos.initialize`` on 4
CPU ranks: the documented group layout (MOE_MODEL ``[0, 1] [2, 3]``, MOE_DATA ``[0, 2] [1, 3]``),
``MoeGradientHandler`` added by itself, and engine training with ``clip_grad_norm`` (a norm
summed over the expert-parallel group) equal to one process holding all experts: losses every
step, parameters at the end, moved 10x the tolerance. The data-parallel broadcast in
``initialize`` must leave each rank's experts alone."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import kolossos
from kolossos.context import ParallelMode
from kolossos.core import global_context as gpc
from kolossos.moe import (
    MOE_CONTEXT,
    Experts,
    MoeLayer,
    MoeLoss,
    Top1Router,
    moe_set_seed,
    single_process_info,
)
from kolossos.testing import spawn
from kolossos.testing.parity import assert_moved, global_mean, shard, snapshot

pytestmark = pytest.mark.dist

D, FF, SEQ, CLASSES, EXPERTS = 16, 32, 8, 5, 4
STEPS, LR, MAX_NORM, TOL = 4, 0.3, 0.2, 2e-5


class FFN(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        moe_set_seed(42)
        self.embed = nn.Linear(D, D)
        experts = Experts(expert=FFN, num_experts=EXPERTS, d_model=D, d_ff=FF)
        self.moe = MoeLayer(D, EXPERTS, Top1Router(capacity_factor_train=1.0), experts)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head((h + self.moe(h)).mean(1))


def named(model: Net) -> dict[str, torch.Tensor]:
    out = {n: p.detach() for n, p in model.named_parameters() if not n.startswith("moe.experts")}
    out.update({f"experts.{k}": v for k, v in model.moe.experts.expert_state_dict().items()})
    return out


def _run(rank: int, world_size: int, port: int) -> None:
    config = dict(parallel=dict(moe=dict(size=2)), clip_grad_norm=MAX_NORM)
    kolossos.launch(config, rank, world_size, "localhost", port, verbose=False)
    assert gpc.get_ranks_in_group(ParallelMode.MOE_MODEL) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert gpc.get_ranks_in_group(ParallelMode.MOE_DATA) == [rank % 2, rank % 2 + 2]
    assert gpc.get_world_size(ParallelMode.DATA) == 4
    info = MOE_CONTEXT.parallel_info
    assert (info.ep_size, info.ep_rank, info.dp_size) == (2, rank % 2, 2)

    model = Net()
    MOE_CONTEXT.set_parallel_info(single_process_info())
    ref = Net()
    initial = snapshot(named(ref))
    criterion = MoeLoss(aux_weight=0.1, loss_fn=nn.CrossEntropyLoss)
    engine, *_ = kolossos.initialize(
        model, torch.optim.SGD(model.parameters(), lr=LR), criterion, verbose=False
    )
    assert [type(h).__name__ for h in engine.gradient_handlers] == ["MoeGradientHandler"]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(3)
    losses, ref_losses = [], []
    engine.train()
    for _ in range(STEPS):
        x, y = torch.randn(8, SEQ, D, generator=gen), torch.randint(0, CLASSES, (8,), generator=gen)
        engine.zero_grad()
        loss = engine.criterion(engine(shard(x, rank, 4)), shard(y, rank, 4))
        engine.backward(loss)
        engine.step()
        losses.append(global_mean(loss))
        total = sum(criterion(ref(shard(x, r, 4)), shard(y, r, 4)) for r in range(4)) / 4
        assert isinstance(total, torch.Tensor)
        total.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        assert norm > 2 * MAX_NORM  # clipping is active
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(total.item())
    torch.testing.assert_close(losses, ref_losses, rtol=TOL, atol=TOL)
    trained, want = named(model), named(ref)
    for name, value in trained.items():
        torch.testing.assert_close(value, want[name], rtol=TOL, atol=TOL, msg=name)
    assert_moved(initial, trained, TOL)
    dist.barrier()


def test_moe_config_initialize_and_engine_match_single_process() -> None:
    spawn(_run, 4)
