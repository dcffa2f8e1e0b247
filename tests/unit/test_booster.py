"""Booster contract without a process group: argument checks, errors, wrappers, precisions."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import kolossos
from kolossos.booster import Booster
from kolossos.booster.mixed_precision import (
    BF16MixedPrecision,
    FP16ApexMixedPrecision,
    FP16NaiveMixedPrecision,
    FP16TorchMixedPrecision,
    mixed_precision_factory,
)
from kolossos.booster.plugin import TorchDDPPlugin, get_plugin_class
from kolossos.interface import ModelWrapper, OptimizerWrapper
from kolossos.testing.parity import TinyMLP


def _objects() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = TinyMLP()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_boost_returns_five_in_order_and_keywords_work() -> None:
    model, opt = _objects()
    crit = nn.CrossEntropyLoss()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    out = Booster().boost(model=model, optimizer=opt, criterion=crit, lr_scheduler=sched)
    assert len(out) == 5
    m, o, c, d, s = out
    assert m is model and isinstance(o, OptimizerWrapper) and o.unwrap() is opt
    assert c is crit and d is None and s is sched
    assert kolossos.Booster is Booster


def test_boosting_twice_is_an_error() -> None:
    model, opt = _objects()
    booster = Booster(mixed_precision="bf16")
    m, *_ = booster.boost(model, opt)
    with pytest.raises(RuntimeError, match="already been boosted"):
        booster.boost(model)
    with pytest.raises(RuntimeError, match="already been boosted"):
        booster.boost(m)
    other = TinyMLP()
    with pytest.raises(RuntimeError, match=r"optimizer .* already been boosted"):
        booster.boost(other, opt)


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="plugin must be"):
        Booster(plugin="torch_ddp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'fp8' is not supported"):
        Booster(mixed_precision="fp8")
    with pytest.raises(TypeError, match="mixed_precision must be"):
        Booster(mixed_precision=16)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        Booster().boost("model")  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="HybridParallelPlugin"):
        Booster().execute_pipeline(iter([]), nn.Linear(1, 1), lambda x: x)
    with pytest.raises(ValueError, match="unknown plugin 'ddp'"):
        get_plugin_class("ddp")
    assert get_plugin_class("torch_ddp") is TorchDDPPlugin
    with pytest.warns(RuntimeWarning, match="not available"):
        Booster(device="cuda" if not torch.cuda.is_available() else "meta")


def test_plugin_needs_process_group() -> None:
    with pytest.raises(RuntimeError, match="launch"):
        TorchDDPPlugin()


def test_precision_recipes_and_factory() -> None:
    assert isinstance(mixed_precision_factory("fp16"), FP16TorchMixedPrecision)
    assert isinstance(mixed_precision_factory("bf16"), BF16MixedPrecision)
    assert isinstance(mixed_precision_factory("fp16_naive"), FP16NaiveMixedPrecision)
    assert mixed_precision_factory("fp32") is None
    with pytest.raises(ValueError, match="growth_factor"):
        FP16TorchMixedPrecision(growth_factor=0.5)
    with pytest.raises(ValueError, match="hysteresis"):
        FP16NaiveMixedPrecision(hysteresis=0)
    from kolossos.mixed_precision import FP16TorchMixedPrecision as Alias

    assert Alias is FP16TorchMixedPrecision


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp16_naive"])
def test_one_process_mixed_precision_trains(precision: str) -> None:
    torch.manual_seed(0)
    model = TinyMLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    booster = Booster(mixed_precision=precision)
    m, o, c, _, _ = booster.boost(model, opt, nn.CrossEntropyLoss())
    assert isinstance(m, ModelWrapper) and m.unwrap() is model
    x, y = torch.randn(32, 16), torch.randint(0, 8, (32,))
    losses = []
    for _ in range(30):
        loss = c(m(x), y)  # type: ignore[misc]
        booster.backward(loss, o)  # type: ignore[arg-type]
        o.step()  # type: ignore[union-attr]
        o.zero_grad()  # type: ignore[union-attr]
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_fp16_naive_keeps_fp32_masters() -> None:
    model, opt = _objects()
    booster = Booster(mixed_precision=FP16NaiveMixedPrecision(initial_scale=2**8))
    m, o, *_ = booster.boost(model, opt)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert all(p.dtype == torch.float32 for g in o.param_groups for p in g["params"])  # type: ignore
    loss = m(torch.randn(4, 16)).float().sum()
    booster.backward(loss, o)  # type: ignore[arg-type]
    o.step()  # type: ignore[union-attr]
    masters = [p for g in o.param_groups for p in g["params"]]  # type: ignore[union-attr]
    for work, master in zip(model.parameters(), masters, strict=True):
        assert torch.equal(work, master.half())


def test_fp16_overflow_backs_off_and_skips_single_process() -> None:
    model, opt = _objects()
    booster = Booster(mixed_precision=FP16TorchMixedPrecision(init_scale=2**10))
    m, o, *_ = booster.boost(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    booster.backward(m(torch.randn(4, 16)).float().sum() * float("inf"), o)  # type: ignore
    assert o.step() is None  # type: ignore[union-attr]
    assert o.loss_scale == 2**9  # type: ignore[union-attr]
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_apex_levels_map_to_recipes() -> None:
    with pytest.warns(UserWarning, match="apex is not used"):
        o1 = FP16ApexMixedPrecision(opt_level="O1")
    with pytest.warns(UserWarning, match="apex is not used"):
        o2 = FP16ApexMixedPrecision(opt_level="O2", loss_scale=128.0)
    model, opt = _objects()
    o1.configure(model, opt)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model2, opt2 = _objects()
    _, o2_opt, _ = o2.configure(model2, opt2)
    assert all(p.dtype == torch.float16 for p in model2.parameters())
    assert o2_opt.loss_scale == 128.0  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="opt_level='O4'"):
        FP16ApexMixedPrecision(opt_level="O4")
    with pytest.raises(ValueError, match="num_losses=2"):
        FP16ApexMixedPrecision(num_losses=2)


def test_clip_arguments_are_checked() -> None:
    model, opt = _objects()
    wrapper = OptimizerWrapper(opt)
    with pytest.raises(ValueError, match="max_norm=0"):
        wrapper.clip_grad_by_norm(0)
    with pytest.raises(ValueError, match="clip_value=-1"):
        wrapper.clip_grad_by_value(-1)
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        OptimizerWrapper(model)  # type: ignore[arg-type]


def test_master_weight_optimizer_is_keyed_by_parameter_name(tmp_path: object) -> None:
    from kolossos.checkpoint_io import optimizer_param_names

    model, opt = _objects()
    booster = Booster(mixed_precision="fp16_naive")
    _, o, *_ = booster.boost(model, opt)
    names = optimizer_param_names(o)  # type: ignore[arg-type]
    assert sorted(n for group in names for n in group) == sorted(
        n for n, _ in model.named_parameters()
    )
