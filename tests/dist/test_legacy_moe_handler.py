"""``MoeGradientHandler`` on 2 ranks (CPU/gloo): ordinary gradients are averaged over the DATA
group, an expert's over its own expert data-parallel group (``param.moe_info.dp_group``), and an
expert held by one rank alone is divided by the data-parallel size. ``ZeROGradientHandler``
refuses an optimizer that is not a ZeRO one."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import kolossos
from kolossos.engine.gradient_handler import MoeGradientHandler, ZeROGradientHandler
from kolossos.testing import spawn


@dataclass
class Info:
    ep_size: int
    dp_group: dist.ProcessGroup | None


def _grads(rank: int) -> dict[str, torch.Tensor]:
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    return {"dense": base * (rank + 1), "own": base * (rank + 10), "shared": base * (rank + 100)}


def _run(rank: int, world_size: int, port: int) -> None:
    kolossos.launch({}, rank, world_size, "localhost", port, verbose=False)
    model = nn.ParameterDict(
        {k: nn.Parameter(torch.zeros(2, 3)) for k in ("dense", "own", "shared")}
    )
    vars(model["own"])["moe_info"] = Info(ep_size=2, dp_group=None)  # this rank's expert alone
    vars(model["shared"])["moe_info"] = Info(ep_size=1, dp_group=dist.group.WORLD)
    for name, grad in _grads(rank).items():
        model[name].grad = grad.clone()
    MoeGradientHandler(model, None).handle_gradient()
    mean = {k: (_grads(0)[k] + _grads(1)[k]) / 2 for k in ("dense", "shared")}
    torch.testing.assert_close(model["dense"].grad, mean["dense"])
    torch.testing.assert_close(model["shared"].grad, mean["shared"])
    # this rank's expert alone: its gradient already sums both ranks' tokens (the all-to-all's
    # backward), so it is only divided by the data-parallel size
    torch.testing.assert_close(model["own"].grad, _grads(rank)["own"] / 2)

    vars(model["own"])["moe_info"] = "expert"
    with pytest.raises(TypeError, match="moe_info is str, without ep_size and dp_group"):
        MoeGradientHandler(model, None).handle_gradient()
    with pytest.raises(TypeError, match=r"needs a ZeRO optimizer.*DataParallelGradientHandler"):
        ZeROGradientHandler(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.dist
def test_moe_handler_reduces_each_parameter_over_its_group() -> None:
    spawn(_run, 2)
