"""``initialize``'s config keys are checked before anything is built or communicated, and the
legacy names resolve where Colossal-AI has them (``kolossos.initialize`` the function,
``kolossos.amp.AMP_TYPE``, ``kolossos.engine``)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import kolossos
from kolossos.context import ConfigException
from kolossos.core import global_context as gpc
from kolossos.legacy.amp import AMP_TYPE, convert_to_amp
from kolossos.legacy.engine.config import EngineConfig, EngineConfigError
from kolossos.legacy.engine.gradient_accumulation import (
    GradAccumDataloader,
    GradAccumLrSchedulerByStep,
    GradAccumOptimizer,
)
from kolossos.legacy.engine.schedule import (
    InterleavedPipelineSchedule,
    NonPipelineSchedule,
    PipelineSchedule,
)
from kolossos.legacy.initialize import initialize
from kolossos.registry import GRADIENT_HANDLER


class NotAHandler:
    """Registered under GRADIENT_HANDLER but not a BaseGradientHandler."""


@pytest.fixture
def no_collectives(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail the test if a collective is attempted; restore the global context afterwards."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a collective ran before the config error")

    for name in ("broadcast", "all_reduce", "barrier", "new_group"):
        monkeypatch.setattr(dist, name, refuse)
    yield
    gpc.reset()


def _initialize_with(config: dict[str, Any]) -> None:
    gpc.load_config(config)
    model = torch.nn.Linear(2, 2)
    initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.MSELoss())


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        (dict(fp16=dict(mode="fp8")), ValueError, "fp16 mode='fp8' is not an AMP mode.*AMP_TYPE"),
        (dict(fp16=dict(init_scale=2.0)), EngineConfigError, "has no mode"),
        (dict(fp16=dict(mode=AMP_TYPE.TORCH, scale=1)), TypeError, "does not take scale"),
        (
            dict(fp16=dict(mode=AMP_TYPE.NAIVE, clip_grad_norm=1.0)),
            NotImplementedError,
            "top-level config key clip_grad_norm",
        ),
        (
            dict(fp16=dict(mode=AMP_TYPE.TORCH), zero=dict(model_config=dict())),
            EngineConfigError,
            "both fp16 and zero",
        ),
        (dict(zero=dict(stages=2)), EngineConfigError, "unknown zero key.*stages.*accepted"),
        (dict(zero=dict(stage=4)), EngineConfigError, "stage=4 must be 1 or 2"),
        (dict(zero=dict(stage=1, level=1)), EngineConfigError, "both stage and level"),
        (dict(zero=dict(precision="fp8")), EngineConfigError, "precision='fp8'"),
        (
            dict(zero=dict(stage=2, model_config=dict(tensor_placement_policy="cpu"))),
            EngineConfigError,
            "placement_policy configure the ZeRO-3 model",
        ),
        (
            dict(zero=dict(optimizer_config=dict(initial_scal=8))),
            EngineConfigError,
            "unknown zero.optimizer_config option.*initial_scal.*initial_scale",
        ),
        (
            dict(zero=dict(model_config=dict(tensor_placement_policy="gpu"))),
            EngineConfigError,
            "config key zero:.*gpu",
        ),
        (
            dict(zero=dict(model_config=dict(chunk_size=3))),
            EngineConfigError,
            "config key zero:.*chunk_size",
        ),
        (
            dict(zero=dict(optimizer_config=dict(initial_scale=-1))),
            EngineConfigError,
            "config key zero:.*initial_scale",
        ),
        (
            dict(gradient_handler=[dict(type="NoSuchHandler")]),
            EngineConfigError,
            "'NoSuchHandler' is not registered.*register_module",
        ),
        (
            dict(gradient_handler=[dict(type="NotAHandler")]),
            EngineConfigError,
            "not a subclass of kolossos.engine.BaseGradientHandler",
        ),
        (dict(gradient_handler=[dict()]), EngineConfigError, "must be a dict with a 'type'"),
        (
            dict(gradient_handler=[], gradient_handlers=[]),
            EngineConfigError,
            "both gradient_handler and gradient_handlers",
        ),
        (dict(torch_ddp=dict(bucket_mb=1)), EngineConfigError, "torch_ddp=.*bucket_mb"),
        (dict(amp=dict(mode="torch")), NotImplementedError, "fp16=dict"),
    ],
)
def test_bad_config_fails_before_any_collective(
    config: dict[str, Any], error: type[Exception], match: str, no_collectives: None
) -> None:
    if not GRADIENT_HANDLER.has("NotAHandler"):
        GRADIENT_HANDLER.register_module(NotAHandler)
    with pytest.raises(error, match=match):
        EngineConfig.from_config(config)
    with pytest.raises(error, match=match):
        _initialize_with(config)


def test_zero_with_fp16_is_a_config_exception() -> None:
    with pytest.raises(ConfigException):
        EngineConfig.from_config(dict(fp16=dict(mode="naive"), zero=dict()))


def test_good_config_is_read() -> None:
    cfg = EngineConfig.from_config(
        dict(
            fp16=dict(mode="torch", init_scale=2.0**10),
            gradient_accumulation=2,
            clip_grad_norm=1,
            gradient_handlers=[dict(type="DataParallelGradientHandler")],
        )
    )
    assert cfg.amp_mode is AMP_TYPE.TORCH and cfg.gradient_accumulation == 2
    assert cfg.clip_grad_norm == 1.0
    assert cfg.gradient_handlers == [dict(type="DataParallelGradientHandler")]
    assert EngineConfig.from_config(dict(fp16=dict(mode=None))).amp is None


def test_initialize_before_launch_is_a_clear_error(no_collectives: None) -> None:
    with pytest.raises(RuntimeError, match=r"call kolossos\.launch_from_torch"):
        _initialize_with({})


def test_ophooks_are_refused(no_collectives: None) -> None:
    gpc.load_config({})
    model = torch.nn.Linear(2, 2)
    with pytest.raises(NotImplementedError, match="ophooks"):
        initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), ophooks=[object()])


def test_names_resolve_where_colossal_ai_has_them() -> None:
    import kolossos.amp
    import kolossos.legacy.engine as legacy_engine
    from kolossos.engine import BaseGradientHandler, DataParallelGradientHandler, Engine
    from kolossos.engine.gradient_handler import BaseGradientHandler as Base2
    from kolossos.engine.schedule import BaseSchedule, NonPipelineSchedule
    from kolossos.initialize import launch  # the launcher module keeps its path

    assert kolossos.amp.AMP_TYPE is AMP_TYPE and kolossos.amp.convert_to_amp is convert_to_amp
    assert kolossos.initialize is initialize  # the function, although the submodule is loaded
    assert callable(launch) and "kolossos.initialize" in sys.modules
    assert importlib.import_module("kolossos.initialize").launch is launch
    assert Engine is legacy_engine.Engine and Base2 is BaseGradientHandler
    assert issubclass(DataParallelGradientHandler, BaseGradientHandler)
    assert issubclass(NonPipelineSchedule, BaseSchedule)
    assert kolossos.engine.schedule.PipelineSchedule is PipelineSchedule
    assert kolossos.engine.schedule.InterleavedPipelineSchedule is InterleavedPipelineSchedule


def test_initialize_attribute_in_a_fresh_interpreter() -> None:
    """Either import order gives the function as ``kolossos.initialize``."""
    code = (
        "import kolossos\n"
        "f = kolossos.initialize\n"
        "import kolossos.initialize\n"
        "from kolossos.initialize import launch\n"
        "assert kolossos.initialize is f and f.__module__ == 'kolossos.legacy.initialize'\n"
        "import kolossos.initialize as m\n"
        "assert m is f  # as with colossalai: the package attribute wins\n"
    )
    for program in (code, "import kolossos.initialize\n" + code):
        subprocess.run([sys.executable, "-c", program], check=True)


def test_convert_to_amp_modes_map_onto_the_booster_recipes() -> None:
    from kolossos.amp.fp16_module import FP16Module
    from kolossos.amp.loss_scaled_optimizer import LossScaledOptimizer
    from kolossos.booster.mixed_precision.mixed_precision_base import AutocastModel

    for mode, model_type in [
        (AMP_TYPE.TORCH, AutocastModel),
        (AMP_TYPE.NAIVE, FP16Module),
        ("apex", AutocastModel),
    ]:
        model = torch.nn.Linear(2, 2)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        if mode == "apex":
            with pytest.warns(UserWarning, match="apex is not used"):
                out = convert_to_amp(model, optim, None, mode)  # type: ignore[arg-type]
        else:
            out = convert_to_amp(model, optim, None, mode)
        assert isinstance(out[0], model_type) and isinstance(out[1], LossScaledOptimizer)


def test_naive_constant_scale() -> None:
    from kolossos.legacy.amp.convert import build_amp_recipe

    recipe: Any = build_amp_recipe("naive", dict(dynamic_grad_scale=False, initial_scale=8.0))
    policy = recipe.loss_scale
    assert policy.initial_scale == policy.min_scale == policy.max_scale == 8.0


def test_gradient_accumulation_wrappers() -> None:
    loader = torch.utils.data.DataLoader(list(range(5)), batch_size=1)
    wrapped = GradAccumDataloader(loader, 2)
    assert len(wrapped) == 4 and [int(b) for b in wrapped] == [0, 1, 2, 3]
    assert wrapped.batch_size == 1  # the wrapped loader's attributes
    read: list[int] = []

    class Stream:  # not a torch DataLoader: drained after the last used batch
        def __len__(self) -> int:
            return 5

        def __iter__(self) -> Iterator[int]:
            for i in range(5):
                read.append(i)
                yield i

    assert list(GradAccumDataloader(Stream(), 2)) == [0, 1, 2, 3] and read == [0, 1, 2, 3, 4]

    model = torch.nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = GradAccumLrSchedulerByStep(torch.optim.lr_scheduler.StepLR(sgd, 1, gamma=0.5), 2)
    lrs = []
    for _ in range(4):
        sgd.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    assert lrs == [1.0, 0.5, 0.5, 0.25]

    optim = GradAccumOptimizer(sgd, 2, model)
    before = model.weight.detach().clone()
    for i in range(2):
        optim.zero_grad()
        optim.backward(model(torch.ones(1, 2)).sum())
        stepped = optim.step()
        moved = not torch.equal(model.weight, before)
        assert moved == (i == 1), i  # parameters change only at the end of the cycle
    assert stepped is None and optim.accumulate_step == 0


def test_schedule_rejects_bad_data_process_func() -> None:
    with pytest.raises(ValueError, match="takes 2 parameters"):
        NonPipelineSchedule(lambda a, b: (a, b))


def test_kolossos_initialize_is_listed() -> None:
    assert "initialize" in dir(kolossos) and "initialize" in kolossos.__all__


def test_signatures_are_colossal_ais() -> None:
    import inspect

    from kolossos.engine import Engine

    assert list(inspect.signature(kolossos.initialize).parameters) == [
        "model", "optimizer", "criterion", "train_dataloader", "test_dataloader",
        "lr_scheduler", "ophooks", "verbose",
    ]  # fmt: skip
    assert list(inspect.signature(Engine).parameters) == [
        "model", "optimizer", "criterion", "gradient_handlers", "clip_grad_norm",
        "ophook_list", "verbose", "schedule",
    ]  # fmt: skip
    assert list(inspect.signature(Engine.execute_schedule).parameters) == [
        "self", "data_iter", "forward_only", "return_loss", "return_output_label",
    ]  # fmt: skip
