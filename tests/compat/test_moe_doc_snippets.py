"""The MoE page's snippets (CHECKLIST §13, F0:1286-1361) with only the imports renamed
(``colossalai.nn.layer.moe`` / ``colossalai.nn.loss`` → ``kolossos.moe``), in one process: the
experts, router, layer and loss build with the documented arguments and a step trains."""

from __future__ import annotations

import torch
import torch.nn as nn

from kolossos.context.random import moe_set_seed
from kolossos.moe import Experts, MoeLayer, MoeLoss, NormalNoiseGenerator, Top2Router


class VanillaFFN(nn.Module):
    def __init__(self, d_model: int, d_ff: int, drop_rate: float = 0.0) -> None:
        super().__init__()
        self.ffn = nn.Sequential(
            nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(drop_rate), nn.Linear(d_ff, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(x)


def moe_mlp_args(d_model: int, d_ff: int, drop_rate: float) -> dict[str, object]:
    return dict(d_model=d_model, d_ff=d_ff, drop_rate=drop_rate)


def test_moe_page_snippets() -> None:
    num_experts, capacity_factor, d_model, d_ff, drop_rate = 4, 1.2, 16, 32, 0.0
    moe_set_seed(42)
    noisy_func = NormalNoiseGenerator(num_experts)
    shared_router = Top2Router(capacity_factor, noisy_func=noisy_func)
    shared_experts = Experts(
        expert=VanillaFFN,
        num_experts=num_experts,
        **moe_mlp_args(d_model=d_model, d_ff=d_ff, drop_rate=drop_rate),
    )
    ffn = MoeLayer(
        dim_model=d_model, num_experts=num_experts, router=shared_router, experts=shared_experts
    )
    criterion = MoeLoss(aux_weight=0.01, loss_fn=nn.CrossEntropyLoss, label_smoothing=0.1)
    assert shared_router.capacity_factor_train == capacity_factor
    assert shared_experts.num_local_experts == num_experts  # one process: all of them
    head = nn.Linear(d_model, 3)
    x, y = torch.randn(4, 8, d_model), torch.randint(0, 3, (4,))
    loss = criterion(head(ffn(x).mean(1)), y)
    loss.backward()
    assert ffn.gate.weight.grad is not None and torch.isfinite(loss)
    assert shared_experts.experts.ffn[0].weight.grad is not None
