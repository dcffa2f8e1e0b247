"""Closed-form estimators: model-state bytes, communication volume, bubbles, FLOPs."""

from __future__ import annotations

import math

import pytest

from kolossos.utils.profiling import (
    PrecisionBytes,
    bubble_fraction,
    collective_sent_bytes,
    comm_bytes_per_rank,
    comm_volume_elements,
    model_state_bytes,
    precision_bytes,
    transformer_train_flops_per_token,
)

GB = 1e9


def test_precision_bytes_presets() -> None:
    assert precision_bytes() == PrecisionBytes(param=2, grad=2, optim=12)
    assert precision_bytes("fp32") == PrecisionBytes(param=4, grad=4, optim=8)
    assert precision_bytes("mixed", "sgd_momentum").optim == 8
    assert precision_bytes("fp32", "sgd").optim == 0
    with pytest.raises(ValueError, match="precision"):
        precision_bytes("fp8")
    with pytest.raises(ValueError, match="optimizer"):
        precision_bytes("mixed", "lamb")


def test_model_states_match_the_zero_paper_figures() -> None:
    # ZeRO paper, Figure 1: Ψ = 7.5B, N = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
    psi, n = 7_500_000_000, 64
    assert model_state_bytes(psi, "ddp", n).total / GB == pytest.approx(120.0)
    assert model_state_bytes(psi, "zero1", n).total / GB == pytest.approx(31.4, abs=0.05)
    assert model_state_bytes(psi, "zero2", n).total / GB == pytest.approx(16.6, abs=0.05)
    assert model_state_bytes(psi, "zero3", n).total / GB == pytest.approx(1.875)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_model_state_formulas(n: int) -> None:
    psi = 1000
    z1 = model_state_bytes(psi, "zero1", n)
    assert (z1.params, z1.grads, z1.optim) == (2 * psi, 2 * psi, 12 * psi / n)
    assert model_state_bytes(psi, "zero2", n).total == 2 * psi + 14 * psi / n
    assert model_state_bytes(psi, "zero3", n).total == 16 * psi / n
    # fp32 training with Adam: 4 + 4 + 8 bytes per parameter, whatever N under DDP
    assert model_state_bytes(psi, "ddp", n, "fp32").total == 16 * psi
    custom = PrecisionBytes(param=4, grad=4, optim=12)
    assert model_state_bytes(psi, "zero2", n, custom).grads == 4 * psi / n
    if n == 1:  # nothing to shard on one rank: every strategy keeps everything
        assert {model_state_bytes(psi, s, 1).total for s in ("ddp", "zero1", "zero3")} == {16e3}


def test_model_state_bytes_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="strategy"):
        model_state_bytes(10, "zero4", 2)
    with pytest.raises(ValueError, match="world_size"):
        model_state_bytes(10, "ddp", 0)
    with pytest.raises(ValueError, match="num_params"):
        model_state_bytes(-1, "ddp", 2)
    with pytest.raises(ValueError, match="num_params"):
        model_state_bytes(True, "ddp", 2)


@pytest.mark.parametrize("n", [1, 2, 4, 64])
def test_comm_volume(n: int) -> None:
    psi = 1_000_000
    ring = (n - 1) / n
    for strategy in ("ddp", "zero1", "zero2"):
        assert comm_volume_elements(psi, strategy, n) == pytest.approx(2 * psi * ring)
        assert comm_volume_elements(psi, strategy, n, asymptotic=True) == 2 * psi
    assert comm_volume_elements(psi, "zero3", n) == pytest.approx(3 * psi * ring)
    assert comm_volume_elements(psi, "zero3", n, asymptotic=True) == 3 * psi
    assert comm_bytes_per_rank(psi, "ddp", n, 4) == pytest.approx(8 * psi * ring)


def test_collective_sent_bytes_ring_and_gloo() -> None:
    s = 1200.0
    assert collective_sent_bytes("all_reduce", s, 4) == pytest.approx(1800)
    assert collective_sent_bytes("reduce_scatter", s, 4) == pytest.approx(900)
    assert collective_sent_bytes("all_gather", s, 4) == pytest.approx(900)
    assert collective_sent_bytes("all_to_all", s, 3) == pytest.approx(800)
    assert collective_sent_bytes("send", s, 2) == s
    assert collective_sent_bytes("recv", s, 2) == 0
    assert collective_sent_bytes("barrier", 0, 2) == 0
    # gloo's reduce-scatter runs a whole all-reduce (measured, docs/benchmarks.md)
    assert collective_sent_bytes("reduce_scatter", s, 4, "gloo") == pytest.approx(1800)
    assert collective_sent_bytes("all_gather", s, 4, "gloo") == pytest.approx(900)
    assert collective_sent_bytes("all_reduce", s, 1) == 0
    with pytest.raises(ValueError, match="kind"):
        collective_sent_bytes("all_scatter", s, 2)
    with pytest.raises(ValueError, match="algorithm"):
        collective_sent_bytes("all_reduce", s, 2, "tree")
    with pytest.raises(ValueError, match="world_size"):
        collective_sent_bytes("all_reduce", s, 0)


def test_bubble_fraction() -> None:
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, "gpipe") == bubble_fraction(4, 8, "1f1b")
    assert bubble_fraction(4, 8, "interleaved", num_chunks=2) == pytest.approx(3 / 19)
    assert bubble_fraction(1, 8) == 0.0
    # the bubble shrinks towards 0 as micro-batches grow, and interleaving divides it by ~v
    assert bubble_fraction(8, 1024) < 0.01
    plain, inter = bubble_fraction(4, 64), bubble_fraction(4, 64, "interleaved", num_chunks=4)
    assert plain / inter == pytest.approx(4, rel=0.05)
    # as a ratio to the useful time: (p-1)/m, Megatron-LM's form
    f = bubble_fraction(4, 16)
    assert f / (1 - f) == pytest.approx(3 / 16)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 4), "pp_size"),
        ((2, 0), "num_microbatches"),
        ((2, 4, "zb"), "schedule"),
        ((2, 4, "1f1b", 2), "interleaved"),
        ((2, 4, "interleaved", 0), "num_chunks"),
    ],
)
def test_bubble_fraction_rejects_bad_input(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        bubble_fraction(*args)


def test_transformer_flops() -> None:
    # GPT-2 small (124M), 1024 tokens: about 0.86 GFLOP per token, attention adds ~15%
    flops = transformer_train_flops_per_token(124_000_000, 12, 768, 1024)
    assert flops == 6 * 124_000_000 + 12 * 12 * 768 * 1024
    assert math.isclose(flops / 1e9, 0.857, rel_tol=0.01)
