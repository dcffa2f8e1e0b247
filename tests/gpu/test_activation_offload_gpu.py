"""``kolossos.utils.checkpoint(function, activation_offload=True, *args)`` on a GPU: the saved
block inputs wait in host memory, so less device memory is held between forward and backward,
and the results equal the non-offloaded run (and plain autograd) exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from kolossos.utils import checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEPTH, WIDTH, TOKENS = 4, 1024, 8192


def _blocks() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        for _ in range(DEPTH)
    ).cuda()


def _run(mode: str) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    blocks = _blocks()
    x = torch.randn(TOKENS, WIDTH, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    x.requires_grad_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    h = x
    for block in blocks:
        h = block(h) if mode == "plain" else checkpoint(block, mode == "offload", h)
    loss = h.square().mean()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    return held, loss.detach(), [p.grad.clone() for p in blocks.parameters()]


def test_activation_offload_holds_less_device_memory() -> None:
    plain_held, plain_loss, plain_grads = _run("plain")
    ckpt_held, ckpt_loss, ckpt_grads = _run("checkpoint")
    off_held, off_loss, off_grads = _run("offload")
    print(f"device bytes held after forward: plain={plain_held} checkpoint={ckpt_held} "
          f"offload={off_held}")  # fmt: skip
    assert ckpt_held < plain_held and off_held < ckpt_held
    assert torch.equal(ckpt_loss, off_loss)
    torch.testing.assert_close(plain_loss, ckpt_loss)
    for a, b, c in zip(plain_grads, ckpt_grads, off_grads, strict=True):
        torch.testing.assert_close(a, b)
        assert torch.equal(b, c)
