"""Gradient norms in pieces (``kolossos.zero.low_level.clip.power_sum``): the piece size follows
the device, a bf16 gradient gives the bits of its fp32 copy, and the tensor-parallel global norm
(``kolossos.hybrid.grad_norm``) sums the same way."""

from __future__ import annotations

import pytest
import torch

from kolossos.hybrid.grad_norm import tp_global_norm
from kolossos.zero.low_level import clip
from kolossos.zero.low_level.clip import (
    ACCELERATOR_NORM_PIECE_NUMEL,
    NORM_PIECE_NUMEL,
    norm_piece_numel,
    power_sum,
)


def test_piece_size_follows_the_device() -> None:
    assert norm_piece_numel(torch.device("cpu")) == NORM_PIECE_NUMEL
    for name in ("cuda", "cuda:1", "meta"):  # device objects only: no accelerator needed
        assert norm_piece_numel(torch.device(name)) == ACCELERATOR_NORM_PIECE_NUMEL
    assert NORM_PIECE_NUMEL < ACCELERATOR_NORM_PIECE_NUMEL


@pytest.mark.parametrize(
    ("device", "piece"), [("cpu", NORM_PIECE_NUMEL), ("meta", ACCELERATOR_NORM_PIECE_NUMEL)]
)
def test_one_reduction_per_piece(device: str, piece: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three and a half pieces' worth of elements: four reductions on either device (on ``meta``
    only shapes exist, so an accelerator's 16 Mi-element pieces cost no memory here)."""
    calls: list[int] = []
    real = torch.linalg.vector_norm

    def counting(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(x.numel())
        return real(x, *args, **kwargs)

    monkeypatch.setattr(clip.torch.linalg, "vector_norm", counting)
    grad = torch.empty(7 * piece // 2, dtype=torch.bfloat16, device=device)
    power_sum(grad, 2.0)
    assert calls == [piece, piece, piece, piece // 2]


def test_bf16_gives_the_bits_of_its_fp32_copy() -> None:
    torch.manual_seed(0)
    grad = torch.randn(3 * NORM_PIECE_NUMEL + 5).bfloat16()
    widened = grad.float()
    for p in (1.0, 2.0, 3.0):
        assert torch.equal(power_sum(grad, p), power_sum(widened, p))
    for p in (1.0, 2.0):  # fp32 sums of about a million terms
        exact = widened.double().abs().pow(p).sum()
        torch.testing.assert_close(power_sum(grad, p).double(), exact, rtol=2e-5, atol=0.0)
    assert power_sum(torch.empty(0), 2.0).item() == 0.0


def test_tensor_parallel_norm_sums_in_pieces() -> None:
    torch.manual_seed(1)
    sharded = torch.randn(2 * NORM_PIECE_NUMEL + 3).bfloat16()
    replicated = torch.randn(1000).bfloat16()
    pieces = [(sharded, True), (replicated, False)]
    total = tp_global_norm(pieces, 2.0, None)
    widened = tp_global_norm([(g.float(), s) for g, s in pieces], 2.0, None)
    assert torch.equal(total, widened)
    exact = (sharded.double().square().sum() + replicated.double().square().sum()).sqrt()
    torch.testing.assert_close(total.double(), exact, rtol=2e-5, atol=0.0)
