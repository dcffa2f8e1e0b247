"""Expert parallelism vs one process holding every expert (CPU/gloo, 4 ranks, fp32).

For expert-parallel sizes 1, 2 and 4 (expert data-parallel 4, 2 and 1), with token dropping
(capacity factor 0.5: at least half the choices dropped) and without (no-drop mode): every rank
trains on its quarter of the global batch; the reference is a single-process model with all 4
experts that routes each quarter separately (routing, capacity and the load-balancing loss are
per rank, as in Colossal-AI) and trains on the mean of the quarters' losses. Compared: the
routing decisions of every step, the loss of every step, every parameter at the end (experts
through their per-expert, global-index layout), and the parameters must have moved 10x the
tolerance. SGD, so a gradient off by a constant factor cannot hide behind Adam's normalisation.

The mix that silently breaks elsewhere (expert parallel 2 x expert data parallel 2) also checks
the expert *gradients* after ``MoeGradientHandler`` against the reference's, and the clipping
norm of ``ExpertParallelGradNorm`` against the reference's total norm; its experts, saved per
expert under their global index, load into models at ep 4 and ep 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.legacy.engine.gradient_handler import MoeGradientHandler
from kolossos.moe import (
    MOE_CONTEXT,
    Experts,
    MoeLayer,
    MoeLoss,
    MoeParallelInfo,
    Top2Router,
    create_moe_groups,
    expert_parallel_grad_norm,
    moe_set_seed,
    single_process_info,
)
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import assert_moved, global_mean, shard, snapshot

pytestmark = pytest.mark.dist

EXPERTS, D, FF, SEQ, CLASSES = 4, 16, 32, 8, 6
GLOBAL_BATCH, STEPS, LR, AUX = 8, 5, 0.2, 0.05
# fp32 on CPU: expert parallelism only changes where rows are computed (padded bmm) and the order
# of the gradient sums; measured: passes at a tolerance of 2e-7.
TOL = 2e-5


class FFN(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TinyMoE(nn.Module):
    def __init__(self, info: MoeParallelInfo, capacity_factor: float | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        moe_set_seed(11)
        self.embed = nn.Linear(D, D)
        router = Top2Router(capacity_factor_train=capacity_factor, min_capacity=1)
        experts = Experts(FFN, EXPERTS, parallel_info=info, d_model=D, d_ff=FF)
        self.moe = MoeLayer(D, EXPERTS, router, experts)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.moe(h)
        return self.head(self.norm(h).mean(1))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [
        (torch.randn(GLOBAL_BATCH, SEQ, D, generator=gen),
         torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=gen))
        for _ in range(STEPS)
    ]  # fmt: skip


def named(model: TinyMoE) -> dict[str, torch.Tensor]:
    """Dense parameters by name, experts by global index (the per-expert layout)."""
    out = {n: p.detach() for n, p in model.named_parameters() if not n.startswith("moe.experts")}
    out.update({f"experts.{k}": v for k, v in model.moe.experts.expert_state_dict().items()})
    return out


def ref_step(
    ref: TinyMoE, criterion: MoeLoss, x: torch.Tensor, y: torch.Tensor, world: int
) -> tuple[float, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The mean of the quarters' losses, backward; returns it and each quarter's routing."""
    total = torch.zeros(())
    routings = []
    for r in range(world):
        total = total + criterion(ref(shard(x, r, world)), shard(y, r, world)) / world
        routing = ref.moe.last_routing
        assert routing is not None
        routings.append((routing.expert_index, routing.kept))
    total.backward()
    return total.item(), routings


def check(ep_size: int, capacity_factor: float | None) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    info = create_moe_groups(ep_size)
    assert (info.ep_size, info.dp_size) == (ep_size, world // ep_size)
    model, ref = TinyMoE(info, capacity_factor), TinyMoE(single_process_info(), capacity_factor)
    assert model.moe.experts.num_local_experts == EXPERTS // ep_size
    mine, theirs = named(model), named(ref)
    for name in mine:  # the expert seed follows the expert: same start at every ep size
        torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=0)
    initial = snapshot({k: v for k, v in theirs.items()})
    criterion = MoeLoss(aux_weight=AUX, loss_fn=nn.CrossEntropyLoss)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    handler = MoeGradientHandler(model, opt)
    losses, ref_losses, dropped = [], [], 0
    for x, y in batches():
        loss = criterion(model(shard(x, rank, world)), shard(y, rank, world))
        loss.backward()
        handler.handle_gradient()
        opt.step()
        opt.zero_grad()
        ref_loss, routings = ref_step(ref, criterion, x, y, world)
        ref_opt.step()
        ref_opt.zero_grad()
        got = model.moe.last_routing
        assert got is not None
        assert torch.equal(got.expert_index, routings[rank][0]), "routing differs"
        assert torch.equal(got.kept, routings[rank][1]), "dropping differs"
        dropped += int((~got.kept).sum())
        losses.append(global_mean(loss))
        ref_losses.append(ref_loss)
    torch.testing.assert_close(losses, ref_losses, rtol=TOL, atol=TOL)
    trained, reference = named(model), named(ref)
    for name, value in trained.items():
        torch.testing.assert_close(value, reference[name], rtol=TOL, atol=TOL, msg=name)
    assert_moved(initial, trained, TOL)
    total = torch.tensor([float(dropped)])
    dist.all_reduce(total)
    assert (total.item() > 0) == (capacity_factor is not None), total.item()


@distributed(4)
def test_expert_parallel_sizes_match_single_process() -> None:
    @parameterize("ep_size", [1, 2, 4])
    @parameterize("capacity_factor", [0.5, None])
    def case(ep_size: int, capacity_factor: float | None) -> None:
        check(ep_size, capacity_factor)

    case()
    check_mixed_gradients()


def check_mixed_gradients() -> None:
    """ep 2 x expert dp 2: expert gradients after the handler equal the single-process ones,
    and the clipping norm is the whole model's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    info = create_moe_groups(2)
    model, ref = TinyMoE(info, 0.5), TinyMoE(single_process_info(), 0.5)
    criterion = MoeLoss(aux_weight=AUX, loss_fn=nn.CrossEntropyLoss)
    x, y = batches()[0]
    criterion(model(shard(x, rank, world)), shard(y, rank, world)).backward()
    MoeGradientHandler(model, None).handle_gradient()
    ref_step(ref, criterion, x, y, world)
    local = model.moe.experts.global_indices
    for name, p in model.moe.experts.experts.named_parameters():
        want = ref.moe.experts.experts.get_parameter(name).grad
        assert p.grad is not None and want is not None
        torch.testing.assert_close(p.grad, want[local.start : local.stop], rtol=1e-5, atol=1e-7)
    for name, p in model.named_parameters():
        if not name.startswith("moe.experts"):
            want = ref.get_parameter(name).grad
            torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-7, msg=name)
    norm_fn = expert_parallel_grad_norm(model)
    assert norm_fn is not None
    pairs = [(p.grad, p) for p in model.parameters() if p.grad is not None]
    ref_grads = [p.grad for p in ref.parameters() if p.grad is not None]
    for norm_type in (2.0, float("inf")):
        want = torch.nn.utils.get_total_norm(ref_grads, norm_type)
        torch.testing.assert_close(norm_fn(pairs, norm_type), want, rtol=1e-5, atol=1e-7)
    check_resharding(model)
    MOE_CONTEXT.reset()


def check_resharding(model: TinyMoE) -> None:
    """Experts saved per expert (global index) at ep 2 load at ep 4 and ep 1."""
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(parts, model.moe.experts.expert_state_dict())
    full = {k: v for part in parts for k, v in part.items()}
    assert len(full) == EXPERTS * 4  # 4 experts x (2 weights + 2 biases)
    for info in (create_moe_groups(4), single_process_info()):
        other = TinyMoE(info, 0.5)
        other.moe.experts.load_expert_state_dict(full)
        for key, value in other.moe.experts.expert_state_dict().items():
            assert torch.equal(value, full[key]), key
