"""Booster contract without a process group: argument checks, errors, wrappers, precisions."""

from __future__ import annotations

import re
import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    TensorDataset,
)

import kolossos
from kolossos.booster import Booster
from kolossos.booster.booster import UnshardedDataWarning
from kolossos.booster.mixed_precision import (
    BF16MixedPrecision,
    FP16ApexMixedPrecision,
    FP16NaiveMixedPrecision,
    FP16TorchMixedPrecision,
    mixed_precision_factory,
)
from kolossos.booster.plugin import Plugin, TorchDDPPlugin, get_plugin_class
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


# --------------------------------------------------------------------------- boost's contract
class _LayoutPlugin(Plugin):
    """A data-parallel layout without a process group; ``configure`` passes everything through
    and records that it ran (the contract checks must come before it)."""

    def __init__(self, dp_size: int, dp_rank: int) -> None:
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.configured = False

    def supported_devices(self) -> list[str]:
        return ["cpu", "cuda"]

    def supported_precisions(self) -> list[str]:
        return ["fp32"]

    def control_precision(self) -> bool:
        return False

    def control_device(self) -> bool:
        return False

    def support_no_sync(self) -> bool:
        return False

    def configure(self, model: Any, optimizer: Any = None, criterion: Any = None,
                  dataloader: Any = None, lr_scheduler: Any = None) -> Any:  # fmt: skip
        self.configured = True
        return model, optimizer, criterion, dataloader, lr_scheduler

    def control_checkpoint_io(self) -> bool:
        return False

    def get_checkpoint_io(self) -> Any:
        raise NotImplementedError

    def no_sync(self, model: Any, optimizer: Any = None) -> AbstractContextManager[None]:
        return nullcontext()

    def prepare_dataloader(self, dataset: Any, batch_size: int, *args: Any, **kw: Any) -> Any:
        sampler = DistributedSampler(dataset, num_replicas=self.dp_size, rank=self.dp_rank)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def _dataset() -> TensorDataset:
    return TensorDataset(torch.randn(16, 16), torch.randint(0, 8, (16,)))


def test_optimizer_over_another_models_parameters_is_refused() -> None:
    model, other = TinyMLP(), TinyMLP()
    shape = re.escape(str(list(next(other.parameters()).shape)))
    booster = Booster(mixed_precision="fp16_naive")  # checked before precision touches anything
    stranger = rf"param_groups\[0\]\.params\[0\] \(shape {shape}, float32\) is not a parameter"
    for opt in (torch.optim.SGD(other.parameters(), lr=0.1),
                OptimizerWrapper(torch.optim.SGD(other.parameters(), lr=0.1))):  # fmt: skip
        with pytest.raises(ValueError, match=stranger) as info:
            booster.boost(model, opt)  # type: ignore[arg-type]
        assert "model.parameters()" in str(info.value)
    extra = nn.Parameter(torch.zeros(3))
    groups = [{"params": list(model.parameters())}, {"params": [extra]}]
    with pytest.raises(ValueError, match=r"param_groups\[1\]\.params\[0\] \(shape \[3\]"):
        booster.boost(model, torch.optim.SGD(groups, lr=0.1))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing was cast
    _, o, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))  # not marked
    assert o is not None


def test_lr_scheduler_must_drive_the_boosted_optimizer() -> None:
    model, opt = _objects()
    elsewhere = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(elsewhere, step_size=1)
    plugin = _LayoutPlugin(1, 0)
    with pytest.raises(ValueError, match=r"lr_scheduler \(StepLR\) is bound to another optimizer"):
        Booster(plugin=plugin).boost(model, opt, lr_scheduler=sched)
    assert not plugin.configured
    wrapped = OptimizerWrapper(opt)  # an already wrapped optimizer: its inner one counts
    good = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    *_, s = Booster(plugin=plugin).boost(model, wrapped, lr_scheduler=good)  # type: ignore
    assert s is good and plugin.configured


def test_distributed_sampler_must_match_the_plugin_layout() -> None:
    data = _dataset()
    wrong = [
        DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=4, rank=3)),
        DataLoader(data, batch_sampler=BatchSampler(
            DistributedSampler(data, num_replicas=2, rank=0), batch_size=2, drop_last=False)),
    ]  # fmt: skip
    for loader in wrong:
        plugin = _LayoutPlugin(dp_size=2, dp_rank=1)
        model, opt = _objects()
        with pytest.raises(ValueError, match=r"num_replicas=\d, rank=\d, but _LayoutPlugin") as e:
            Booster(plugin=plugin).boost(model, opt, dataloader=loader)
        assert "dp_size=2" in str(e.value) and "dp_rank=1" in str(e.value)
        assert "plugin.prepare_dataloader" in str(e.value)
        assert not plugin.configured  # refused before the plugin did anything
    plugin = _LayoutPlugin(dp_size=2, dp_rank=1)
    model, opt = _objects()
    loader = plugin.prepare_dataloader(data, batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        *_, got, _ = Booster(plugin=plugin).boost(model, opt, dataloader=loader)
    assert got is loader


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(4))


def test_plain_sampler_with_several_replicas_warns() -> None:
    data = _dataset()
    model, opt = _objects()
    with pytest.warns(UnshardedDataWarning, match=r"RandomSampler.*dp_size=2.*same batches"):
        Booster(plugin=_LayoutPlugin(2, 0)).boost(
            model, opt, dataloader=DataLoader(data, shuffle=True)
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Booster(plugin=_LayoutPlugin(1, 0)).boost(TinyMLP(), dataloader=DataLoader(data))
        Booster(plugin=_LayoutPlugin(2, 0)).boost(TinyMLP(), dataloader=DataLoader(_Stream()))
        Booster().boost(TinyMLP(), dataloader=DataLoader(data))  # no plugin: one process
