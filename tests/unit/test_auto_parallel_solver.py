"""The sharding-strategy solver on MLP chains with fixed costs (no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kolossos.auto_parallel import CostModel, InfeasibleBudgetError, UnsupportedOperatorError
from kolossos.auto_parallel.apply import format_plan
from kolossos.auto_parallel.autoparallelize import build_chain, search_plan
from kolossos.auto_parallel.solver import solve_chain

HIDDEN = 256
BATCH = 512


def _mlp(layers: int = 4, hidden: int = HIDDEN) -> nn.Sequential:
    blocks: list[nn.Module] = []
    for i in range(layers):
        blocks.append(nn.Linear(hidden, hidden))
        if i < layers - 1:
            blocks.append(nn.ReLU())
    return nn.Sequential(*blocks)


def _chain(world_size: int, model: nn.Module | None = None, batch: int = BATCH):
    cost = CostModel(world_size=world_size, flops_per_s=1e10, alpha=1e-4, beta=1e-9)
    meta = {"input": torch.empty(batch, HIDDEN, device="meta")}
    chain, targets = build_chain(model or _mlp(), meta, cost)
    return chain, targets, cost


def _family_memory(chain, cost) -> tuple[float, float]:
    dp = solve_chain(chain, cost, allowed_layouts=("B",), input_layouts=("B",))
    tp = solve_chain(chain, cost, allowed_layouts=("R", "F"), input_layouts=("R",))
    return dp.memory, tp.memory


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_when_memory_allows(world_size: int) -> None:
    chain, _, cost = _chain(world_size)
    plan = search_plan(chain, cost, memory_budget=None)
    assert set(plan.names) == {"dp", "B"}
    assert plan.input_layout == "B"
    dp_memory, _ = _family_memory(chain, cost)
    assert plan.memory == pytest.approx(dp_memory)
    # DP all-reduces parameter gradients (4 x 257 KiB); TP all-reduces activations (8 x 512 KiB).
    assert plan.step_time < solve_chain(chain, cost, allowed_layouts=("R", "F")).step_time


@pytest.mark.parametrize("world_size", [2, 4])
def test_megatron_when_memory_is_short(world_size: int) -> None:
    chain, _, cost = _chain(world_size)
    dp_memory, tp_memory = _family_memory(chain, cost)
    assert tp_memory < dp_memory
    budget = (tp_memory + dp_memory) / 2
    plan = search_plan(chain, cost, memory_budget=budget)
    assert plan.names == ("col", "F", "row", "R", "col", "F", "row")
    assert plan.memory <= budget
    # The unrestricted DP over all layouts also finds a column -> row plan within the budget.
    free = solve_chain(chain, cost, memory_budget=budget)
    assert free.memory <= budget and free.step_time <= plan.step_time + 1e-12
    assert "col" in free.names and "row" in free.names


def test_memory_accounting() -> None:
    chain, _, cost = _chain(2)
    plan = search_plan(chain, cost, memory_budget=None)
    linear = (HIDDEN * HIDDEN + HIDDEN) * 4
    activation = BATCH * HIDDEN * 4
    # dp: parameter, gradient and two Adam states whole; activations split in two.
    assert plan.memory == pytest.approx(4 * 4 * linear + 7 * activation / 2)
    tp = solve_chain(chain, cost, allowed_layouts=("R", "F"), input_layouts=("R",))
    col = 4 * linear / 2
    row = 4 * (HIDDEN * HIDDEN * 4 / 2 + HIDDEN * 4)
    acts = 4 * activation / 2 + 3 * activation
    assert tp.memory == pytest.approx(2 * col + 2 * row + acts)


def test_resharding_is_charged() -> None:
    chain, _, cost = _chain(2)
    # Forcing a batch-sharded input into a tensor-parallel plan costs an all-gather.
    plan = solve_chain(chain, cost, input_layouts=("B",), allowed_layouts=("B", "R", "F"))
    forced = solve_chain(chain, cost, input_layouts=("R",), allowed_layouts=("R", "F"))
    assert plan.step_time <= forced.step_time
    assert all(m >= 0 for m in plan.reshard_s)


def test_infeasible_budget() -> None:
    chain, _, cost = _chain(2)
    with pytest.raises(InfeasibleBudgetError, match="need at least"):
        search_plan(chain, cost, memory_budget=1000)


def test_unsupported_operator_names_node() -> None:
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Softmax(dim=-1))
    with pytest.raises(NotImplementedError, match=r"node '_1'.*Softmax"):
        _chain(2, model)
    with pytest.raises(UnsupportedOperatorError):
        _chain(2, model)


def test_not_a_chain() -> None:
    class Skip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(HIDDEN, HIDDEN)

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.fc(input) + input)

    with pytest.raises(UnsupportedOperatorError, match="node 'add'"):
        _chain(2, Skip())


def test_format_plan() -> None:
    chain, targets, cost = _chain(2)
    text = format_plan(search_plan(chain, cost), targets)
    assert "predicted step time" in text and "dp" in text
