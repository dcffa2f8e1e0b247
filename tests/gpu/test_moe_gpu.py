"""The MoE layer on a GPU (one device, all experts local): the same forward, loss and gradients
as on the CPU, for fp32 (TF32 off); the expert seed gives the same experts on both devices."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from kolossos.moe import Experts, MoeLayer, MoeLoss, Top2Router, moe_set_seed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


class FFN(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def build() -> MoeLayer:
    torch.manual_seed(0)
    moe_set_seed(5)
    experts = Experts(expert=FFN, num_experts=8, d_model=32, d_ff=64)
    return MoeLayer(32, 8, Top2Router(capacity_factor_train=1.0, min_capacity=1), experts)


def test_moe_layer_cuda_matches_cpu() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu, gpu = build(), build().cuda()
    x = torch.randn(4, 16, 32)
    criterion = MoeLoss(aux_weight=0.1, loss_fn=nn.MSELoss)
    results = []
    for layer, device in ((cpu, "cpu"), (gpu, "cuda")):
        inp = x.to(device)
        loss = criterion(layer(inp), inp)
        loss.backward()
        routing = layer.last_routing
        assert routing is not None
        grads = {n: p.grad.cpu() for n, p in layer.named_parameters() if p.grad is not None}
        results.append((loss.item(), routing.expert_index.cpu(), routing.kept.cpu(), grads))
    (l0, i0, k0, g0), (l1, i1, k1, g1) = results
    assert torch.equal(i0, i1) and torch.equal(k0, k1) and bool((~k0).any())
    assert l1 == pytest.approx(l0, rel=1e-5)
    assert g0.keys() == g1.keys() and len(g0) == 5
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)
