"""Activation checkpointing: the functional ``kolossos.utils.checkpoint(function,
activation_offload, *args)`` and the zoo blocks' ``checkpoint=`` flag.

Checkpointing must not change the numbers (same outputs, same gradients, same dropout masks on
the recomputation: equality, not closeness) and must hold fewer activation bytes between forward
and backward. Memory is measured with :class:`kolossos.accelerator.TensorMemoryTracker` (every
tensor storage allocated during the forward and still alive when backward starts; parameters
predate the tracker and are not counted).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import kolossos.utils
from kolossos.accelerator import TensorMemoryTracker
from kolossos.legacy.models.gpt import GPT, GPTBlock, GPTLMLoss
from kolossos.legacy.models.vit import _create_vit_model
from kolossos.legacy.utils.checkpoint import load_checkpoint, save_checkpoint
from kolossos.testing.parity import assert_moved, snapshot
from kolossos.utils import checkpoint


def _block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 8))


@pytest.mark.parametrize("offload", [False, True])
def test_functional_checkpoint_same_values_and_grads(offload: bool) -> None:
    block, x = _block(), torch.randn(4, 8)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(5)
    plain = block(xa)
    plain.square().sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    torch.manual_seed(5)
    ckpt = checkpoint(block, offload, xb)  # offload on CPU inputs: a no-op
    ckpt.square().sum().backward()
    assert torch.equal(plain, ckpt)  # same dropout mask in forward ...
    assert torch.equal(xa.grad, xb.grad)  # ... and in the recomputation
    for g, p in zip(grads, block.parameters(), strict=True):
        assert torch.equal(g, p.grad)


def test_functional_checkpoint_argument_errors() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(TypeError, match="activation_offload must be True or False, got a Tensor"):
        checkpoint(_block(), x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="is not callable"):
        checkpoint(x, False, x)  # type: ignore[arg-type]


def test_utils_checkpoint_names_coexist(tmp_path: object) -> None:
    """``kolossos.utils.checkpoint`` is the activation checkpoint; the legacy save/load of
    ``kolossos.utils`` are unchanged."""
    assert kolossos.utils.checkpoint is checkpoint
    assert kolossos.utils.save_checkpoint is save_checkpoint
    assert kolossos.utils.load_checkpoint is load_checkpoint
    assert "checkpoint" in dir(kolossos.utils)


def _vit(ckpt: bool) -> nn.Module:
    torch.manual_seed(0)
    return _create_vit_model(
        img_size=16, patch_size=4, dim=32, depth=3, num_heads=4, mlp_ratio=4, num_classes=10,
        dropout=0.1, attention_dropout=0.1, drop_path=0.1, checkpoint=ckpt,
    )  # fmt: skip


def _gpt(ckpt: bool) -> nn.Module:
    torch.manual_seed(0)
    return GPT(
        vocab_size=64,
        max_position_embeddings=32,
        dim=32,
        num_heads=4,
        depth=3,
        dropout=0.1,
        embedding_dropout=0.1,
        attention_dropout=0.1,
        checkpoint=ckpt,
    )


def _step_loss(kind: str, model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    if kind == "vit":
        x, y = torch.randn(8, 3, 16, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        return nn.functional.cross_entropy(model(x), y)
    ids = torch.randint(0, 64, (4, 32), generator=gen)
    return GPTLMLoss()(model(ids, torch.ones(4, 32)), ids)


def _train(kind: str, ckpt: bool) -> tuple[list[float], nn.Module, dict[str, torch.Tensor]]:
    model = _vit(ckpt) if kind == "vit" else _gpt(ckpt)
    initial = snapshot(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(123)  # dropout masks
    losses = []
    for step in range(3):
        opt.zero_grad()
        loss = _step_loss(kind, model, step)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, model, initial


@pytest.mark.parametrize("kind", ["vit", "gpt"])
def test_zoo_checkpoint_flag_trains_identically(kind: str) -> None:
    """With dropout, attention dropout (and stochastic depth for the ViT) active."""
    off, model_off, initial = _train(kind, False)
    on, model_on, _ = _train(kind, True)
    assert off == on
    for (name, a), b in zip(model_off.named_parameters(), model_on.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert_moved(initial, model_on, 1e-6)


def _held_activation_bytes(kind: str, ckpt: bool) -> int:
    model = _vit(ckpt) if kind == "vit" else _gpt(ckpt)
    with TensorMemoryTracker("cpu") as tracker:
        loss = _step_loss(kind, model, 0)
        held = tracker.current_bytes  # what forward left alive for backward
        loss.backward()
    return held


@pytest.mark.parametrize("kind", ["vit", "gpt"])
def test_zoo_checkpoint_holds_less_activation_memory(kind: str) -> None:
    """3 blocks: without checkpointing every block's intermediates stay alive until backward;
    with it only each block's input does."""
    off = _held_activation_bytes(kind, False)
    on = _held_activation_bytes(kind, True)
    print(f"{kind}: activation bytes held after forward: off={off} on={on} ({on / off:.2f}x)")
    assert on < 0.5 * off, (off, on)


def test_gpt_block_returns_hidden_states_and_mask() -> None:
    block = GPTBlock(16, 4, checkpoint=True)
    x, mask = torch.randn(2, 4, 16, requires_grad=True), torch.zeros(2, 1, 1, 4)
    out, same = block(x, mask)
    assert out.shape == x.shape and same is mask
    out.sum().backward()
    assert x.grad is not None
