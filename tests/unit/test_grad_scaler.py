"""The shared loss scaler: state-machine traces, validation, state dicts, overflow detection."""

from __future__ import annotations

import pytest
import torch

from kolossos.amp import (
    ConstantGradScaler,
    DynamicGradScaler,
    ScaleEvent,
    all_reduce_overflow,
    has_inf_or_nan,
    unscale_and_check_,
)

G, T, B, U = ScaleEvent.GOOD, ScaleEvent.TOLERATE, ScaleEvent.BACKOFF, ScaleEvent.GROW


def trace(scaler: DynamicGradScaler, overflows: str) -> list[tuple[ScaleEvent, float]]:
    """Feed a string of steps ('x' = overflow, '.' = good) and record (event, scale) after each."""
    return [(scaler.update(step == "x"), scaler.scale) for step in overflows]


# ---------------------------------------------------------------- DynamicGradScaler state machine


def test_growth_after_interval() -> None:
    scaler = DynamicGradScaler(initial_scale=4, growth_interval=3, hysteresis=1)
    assert trace(scaler, "......") == [(G, 4), (G, 4), (U, 8), (G, 8), (G, 8), (U, 16)]


def test_overflow_resets_growth_tracker() -> None:
    scaler = DynamicGradScaler(initial_scale=64, growth_interval=3, hysteresis=1)
    assert trace(scaler, "..x...") == [(G, 64), (G, 64), (B, 32), (G, 32), (G, 32), (U, 64)]


def test_hysteresis_one_backs_off_on_every_overflow() -> None:
    scaler = DynamicGradScaler(initial_scale=64, hysteresis=1)
    assert [s for _, s in trace(scaler, "xxx")] == [32, 16, 8]


def test_hysteresis_two_tolerates_first_overflow_then_backs_off_every_time() -> None:
    scaler = DynamicGradScaler(initial_scale=64, hysteresis=2)
    assert trace(scaler, "xxxx") == [(T, 64), (B, 32), (B, 16), (B, 8)]
    assert scaler.hysteresis_tracker == 0


def test_hysteresis_counts_overflows_since_last_growth_not_consecutive_ones() -> None:
    # Good steps between the overflows do not refill the budget: the 2nd overflow backs off.
    scaler = DynamicGradScaler(initial_scale=64, growth_interval=10, hysteresis=2)
    assert trace(scaler, "x..x") == [(T, 64), (G, 64), (G, 64), (B, 32)]


def test_growth_refills_hysteresis_budget() -> None:
    scaler = DynamicGradScaler(initial_scale=64, growth_interval=2, hysteresis=3)
    assert trace(scaler, "xx..xxx") == [
        (T, 64), (T, 64), (G, 64), (U, 128), (T, 128), (T, 128), (B, 64),
    ]  # fmt: skip


def test_clamped_at_min_and_max_scale() -> None:
    scaler = DynamicGradScaler(initial_scale=4, min_scale=2, max_scale=8, growth_interval=1,
                               hysteresis=1)  # fmt: skip
    assert [s for _, s in trace(scaler, "xxx")] == [2, 2, 2]
    assert [s for _, s in trace(scaler, "....")] == [4, 8, 8, 8]


def test_non_power_of_two_factors() -> None:
    scaler = DynamicGradScaler(initial_scale=100, growth_factor=1.5, backoff_factor=0.25,
                               growth_interval=1, hysteresis=1)  # fmt: skip
    assert [s for _, s in trace(scaler, ".x")] == [150, 37.5]


def test_accepts_zero_dim_tensor_flag() -> None:
    scaler = DynamicGradScaler(initial_scale=8, hysteresis=1)
    scaler.update(torch.tensor(1.0))  # type: ignore[arg-type]
    assert scaler.scale == 4


def test_scale_is_float_and_tensor_helpers() -> None:
    scaler = DynamicGradScaler(initial_scale=2**16)
    assert isinstance(scaler.scale, float)
    assert scaler.inv_scale == 2.0**-16
    t = scaler.scale_tensor("cpu")
    assert t.dtype == torch.float32 and t.shape == () and t.item() == 2**16


def test_state_dict_round_trip_continues_identically() -> None:
    a = DynamicGradScaler(initial_scale=1024, growth_interval=4, hysteresis=3)
    trace(a, "x..")
    b = DynamicGradScaler(initial_scale=1024, growth_interval=4, hysteresis=3)
    b.load_state_dict(a.state_dict())
    assert (b.scale, b.growth_tracker, b.hysteresis_tracker) == (1024, 2, 2)
    steps = "..xxx.x"
    assert trace(a, steps) == trace(b, steps)


def test_load_state_dict_accepts_tensor_scale_and_clamps() -> None:
    scaler = DynamicGradScaler(initial_scale=4, max_scale=16)
    scaler.load_state_dict({"scale": torch.tensor(2.0**20)})  # other keys missing: fresh trackers
    assert scaler.scale == 16 and scaler.hysteresis_tracker == 2 and scaler.growth_tracker == 0
    with pytest.raises(KeyError, match="scale"):
        scaler.load_state_dict({})
    with pytest.raises(ValueError, match="finite"):
        scaler.load_state_dict({"scale": float("inf")})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"growth_factor": 1.0}, "growth_factor=1.0 must be > 1"),
        ({"backoff_factor": 1.0}, "0 < backoff_factor < 1"),
        ({"backoff_factor": 0.0}, "backoff_factor=0.0 is invalid"),
        ({"min_scale": 0}, "min_scale=0 is invalid"),
        ({"initial_scale": 0.5}, "min_scale <= initial_scale <= max_scale"),
        ({"initial_scale": 2**40}, "min_scale <= initial_scale <= max_scale"),
        ({"max_scale": float("inf")}, "finite"),
        ({"hysteresis": 0}, "hysteresis=0 is invalid"),
        ({"growth_interval": 0}, "growth_interval=0 is invalid"),
    ],
)
def test_argument_validation(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DynamicGradScaler(**kwargs)  # type: ignore[arg-type]


def test_argument_types() -> None:
    with pytest.raises(TypeError, match="hysteresis must be an int"):
        DynamicGradScaler(hysteresis=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="initial_scale must be a number"):
        DynamicGradScaler(initial_scale="big")  # type: ignore[arg-type]


def test_constant_scaler() -> None:
    scaler = ConstantGradScaler(32.0)
    assert [scaler.update(f) for f in (False, True)] == [ScaleEvent.GOOD, ScaleEvent.SKIP]
    assert scaler.scale == 32.0
    other = ConstantGradScaler(1.0)
    other.load_state_dict(scaler.state_dict())
    assert other.scale == 32.0
    with pytest.raises(ValueError, match="scale"):
        ConstantGradScaler(-1.0)


# ---------------------------------------------------------------- overflow detection

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BAD = [float("inf"), float("-inf"), float("nan")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", BAD)
def test_has_inf_or_nan_detects(dtype: torch.dtype, bad: float) -> None:
    grads = [torch.ones(5, dtype=dtype), torch.tensor([0.0, bad, 1.0], dtype=dtype)]
    flag = has_inf_or_nan(grads)
    assert flag.shape == () and flag.dtype == torch.float32 and flag.item() == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_has_inf_or_nan_no_false_positive_on_large_finite(dtype: torch.dtype) -> None:
    big = torch.finfo(dtype).max
    grads = [torch.full((1000,), big, dtype=dtype), torch.full((7,), -big, dtype=dtype), None]
    assert has_inf_or_nan(grads).item() == 0.0
    assert has_inf_or_nan([]).item() == 0.0
    assert has_inf_or_nan([torch.empty(0), torch.arange(3)]).item() == 0.0


def test_has_inf_or_nan_sparse() -> None:
    idx = torch.tensor([[0, 2]])
    ok = torch.sparse_coo_tensor(idx, torch.tensor([1.0, 2.0]), (4,), check_invariants=True)
    bad = torch.sparse_coo_tensor(
        idx, torch.tensor([1.0, float("nan")]), (4,), check_invariants=True
    )
    assert has_inf_or_nan([ok]).item() == 0.0 and has_inf_or_nan([ok, bad]).item() == 1.0


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [None, *BAD])
def test_unscale_and_check_both_paths(fused: bool, dtype: torch.dtype, bad: float | None) -> None:
    values = [8.0, -4.0, float(torch.finfo(dtype).max)] + ([] if bad is None else [bad])
    grads = [torch.tensor(values, dtype=dtype), torch.full((3,), 2.0, dtype=torch.float32), None]
    expected = [g.clone() * 0.25 for g in grads if g is not None]
    flag = unscale_and_check_(grads, 0.25, fused=fused)
    assert flag.shape == () and flag.dtype == torch.float32
    assert flag.item() == (0.0 if bad is None else 1.0)
    for got, want in zip([g for g in grads if g is not None], expected, strict=True):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)


def test_unscale_and_check_tensor_inv_scale_and_leaf_params() -> None:
    p = torch.nn.Parameter(torch.tensor([4.0, 8.0]))  # in-place on a leaf needs no_grad inside
    flag = unscale_and_check_([p], torch.tensor([0.5]), fused=False)
    assert flag.item() == 0.0 and p.detach().tolist() == [2.0, 4.0]


def test_unscale_and_check_sparse() -> None:
    g = torch.sparse_coo_tensor(
        torch.tensor([[1]]), torch.tensor([6.0]), (3,), check_invariants=True
    )
    assert unscale_and_check_([g], 0.5).item() == 0.0
    assert g.to_dense().tolist() == [0.0, 3.0, 0.0]


def test_all_reduce_overflow_without_process_group_is_identity() -> None:
    flag = torch.tensor(1.0)
    assert all_reduce_overflow(flag) is True
    assert all_reduce_overflow(torch.tensor(0.0)) is False
    assert all_reduce_overflow(torch.tensor([True])) is True
    assert all_reduce_overflow(False) is False
    assert flag.item() == 1.0
