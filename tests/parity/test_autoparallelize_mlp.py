"""``autoparallelize`` on an MLP vs single-process training on CPU/gloo, 2 and 4 ranks.

A 4-layer MLP (hidden 32, batch 64, fp32, Adam). With no memory budget the solver picks data
parallelism; with a budget between the tensor-parallel and the data-parallel plan's memory it
picks Megatron column -> row sharding. Both plans train STEPS steps from the same initial
weights as a single-process reference on the whole batch: the loss matches at every step and
the (gathered) parameters at the end, and every parameter moved by 10x the tolerance.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from kolossos.auto_parallel import CostModel, autoparallelize
from kolossos.auto_parallel.apply import apply_plan
from kolossos.auto_parallel.autoparallelize import build_chain
from kolossos.auto_parallel.solver import TENSOR_PARALLEL, ChainNode, solve_chain
from kolossos.testing import distributed
from kolossos.testing.parity import assert_run_matches, global_mean, snapshot

pytestmark = pytest.mark.dist

HIDDEN = 32
BATCH = 64
STEPS = 5
LR = 1e-2
# fp32: only the order of sums changes (the gradient average over ranks, the row-parallel
# partial sums); measured worst differences are around 1e-7.
TOL = 1e-5


def _mlp() -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(4):
        layers.append(nn.Linear(HIDDEN, HIDDEN))
        if i < 3:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _budgets(world_size: int, cost: CostModel) -> dict[str, float | None]:
    meta = {"input": torch.empty(BATCH, HIDDEN, device="meta")}
    chain, _ = build_chain(_mlp(), meta, cost)
    dp = solve_chain(chain, cost, allowed_layouts=("B",), input_layouts=("B",)).memory
    tp = solve_chain(chain, cost, allowed_layouts=("R", "F"), input_layouts=("R",)).memory
    assert tp < dp
    return {"dp": None, "tp": (dp + tp) / 2}


def _train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    local: Callable[[torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        xs, ys = x[step], y[step]
        loss = nn.functional.mse_loss(model(local(xs)), local(ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_autoparallelize_parity(world_size: int) -> None:
    cost = CostModel(world_size=world_size, flops_per_s=1e8, alpha=1e-5, beta=1e-9)
    torch.manual_seed(0)
    base = _mlp()
    x = torch.randn(STEPS, BATCH, HIDDEN)
    y = torch.randn(STEPS, BATCH, HIDDEN)
    reference = copy.deepcopy(base)
    before = snapshot(reference)
    ref_losses = _train(reference, x, y, lambda t: t)
    meta = {"input": torch.empty(BATCH, HIDDEN, device="meta")}
    models = [
        (family, autoparallelize(copy.deepcopy(base), meta, memory_budget=b, cost_model=cost))
        for family, b in _budgets(world_size, cost).items()
    ]
    # Layout changes done at a linear's boundary: column linears whose output is gathered for
    # the next node (no row strategy), and row linears slicing a replicated input (no column).
    chain, targets = build_chain(_mlp(), meta, cost)
    for dropped, family in (("row", "col-gather"), ("col", "row-slice")):
        nodes = [
            ChainNode(
                name=n.name,
                in_bytes=n.in_bytes,
                strategies=[s for s in n.strategies if s.name not in (dropped, "rep")],
            )
            for n in chain
        ]
        plan = solve_chain(nodes, cost, allowed_layouts=TENSOR_PARALLEL, input_layouts=("R",))
        assert family[:3] in plan.names, plan.names
        models.append(
            (
                family,
                apply_plan(
                    copy.deepcopy(base), plan, init_device_mesh("cpu", (world_size,)), targets
                ),
            )
        )
    for family, model in models:
        if dist.get_rank() == 0:
            model.print_plan()
        names = model.plan.names
        if family == "dp":
            assert set(names) == {"dp", "B"}, names
        elif family == "tp":
            assert names == ("col", "F", "row", "R", "col", "F", "row"), names
        losses = _train(model, x, y, model.local_batch)
        reduced = [global_mean(x) if model.data_parallel else float(x) for x in losses]
        assert_run_matches(reduced, ref_losses, model.full_state_dict(), reference, before,
                           loss_atol=TOL, param_atol=TOL, label=family)  # fmt: skip
