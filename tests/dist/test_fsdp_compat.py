"""Colossal-AI's FSDP1 idioms on kolossos' FSDP2 plugin: the boosted model's ``state_dict`` holds
full plain tensors, ``load_state_dict`` takes them back, and a saved optimizer state dict
restores training exactly (the round trip upstream's FSDP checkpoint test makes)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from kolossos.booster import Booster
from kolossos.booster.plugin import TorchFSDPPlugin
from kolossos.testing import check_state_dict_equal, distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))  # 16 rows: uneven shards


@distributed(2)
def test_state_dicts_behave_like_fsdp1_full_state_dicts() -> None:
    reference = _model()
    booster = Booster(plugin=TorchFSDPPlugin())
    model: Any = _model()
    optimizer: Any
    model, optimizer, *_ = booster.boost(model, torch.optim.Adam(model.parameters()))
    assert isinstance(model.unwrap(), FSDPModule)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

    def step() -> torch.Tensor:
        loss = model(x).square().mean()
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    full = model.state_dict()
    expected = {"module." + k: v for k, v in reference.state_dict().items()}
    assert all(type(v) is torch.Tensor for v in full.values())
    check_state_dict_equal(full, expected)
    step()
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    saved_model = model.state_dict()
    assert any(not torch.equal(saved_model[k], full[k]) for k in full)  # it trained
    first = step()
    model.load_state_dict(saved_model)
    optimizer.load_state_dict(saved_optimizer)
    again = step()
    assert torch.equal(first, again), (first, again)
    model.load_state_dict(full)  # back to the start, from plain full tensors
    check_state_dict_equal(model.state_dict(), expected)
