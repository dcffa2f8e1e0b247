"""The model zoo's ViT (``_create_vit_model``) under 2D tensor parallelism (4 CPU ranks) trains
like the dense zoo ViT: the same definition picks the 2D patch embedding, linear layers,
LayerNorms, dropout and classifier from the launch config.

The dense model is built before the launch (no tensor parallelism then), the 2D one after it;
the dense weights are copied in (``load_full_state_dict``; gathering them back is exact). Both
train SGD steps with momentum on the same global batches (the 2D model takes the whole batch and
keeps its batch block; the 2D loss takes whole targets and returns the whole batch's mean). The
loss of every step, the gathered parameters at the end and that every parameter moved far
beyond the tolerance are checked. Tolerance 1e-5 (fp32): only the order of the SUMMA block sums
and the LayerNorm statistics' all-reduces differ.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import kolossos
from kolossos.legacy.models.vit import _create_vit_model
from kolossos.legacy.models.vit_nd import full_state_dict, load_full_state_dict
from kolossos.legacy.nn.layer import Linear2D
from kolossos.nn import CrossEntropyLoss
from kolossos.testing import spawn
from kolossos.testing.parity import assert_moved, snapshot

pytestmark = pytest.mark.dist

STEPS, BATCH, LR, TOL = 4, 8, 0.1, 1e-5
KWARGS = dict(img_size=8, patch_size=4, dim=16, depth=2, num_heads=2, mlp_ratio=2,
              num_classes=6, dropout=0.0, init_method="jax", checkpoint=True)  # fmt: skip


def _build() -> nn.Module:
    torch.manual_seed(0)
    return _create_vit_model(**KWARGS)


def _train(model: nn.Module, criterion: nn.Module) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, 3, 8, 8, generator=gen)
        y = torch.randint(0, 6, (BATCH,), generator=gen)
        opt.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _run(rank: int, world_size: int, port: int) -> None:
    dense = _build()
    with torch.no_grad():  # a unit-scale class token keeps the LayerNorms well conditioned
        dense.layers[0].patch_embed.cls_token.normal_()
        dense.layers[-1].dense.weight.normal_(std=0.1)  # 'jax' zeroes the head
    config = dict(parallel=dict(tensor=dict(size=4, mode="2d")))
    kolossos.launch(config, rank, world_size, "localhost", port, verbose=False)
    model = _build()
    assert sum(isinstance(m, Linear2D) for m in model.modules()) == 8
    load_full_state_dict(model, dense.state_dict())
    initial = full_state_dict(model)
    for name, value in initial.items():
        assert torch.equal(value, dense.state_dict()[name]), name
    initial = snapshot(initial)
    losses = _train(model, CrossEntropyLoss())  # the 2D loss, from the launch config
    ref = _train(dense, nn.CrossEntropyLoss())
    torch.testing.assert_close(losses, ref, rtol=TOL, atol=TOL)
    final = full_state_dict(model)
    for name, p in dense.named_parameters():
        torch.testing.assert_close(final[name], p.detach(), rtol=TOL, atol=TOL,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip
    assert_moved(initial, final, TOL)


def test_zoo_vit_2d_matches_dense() -> None:
    spawn(_run, 4)
