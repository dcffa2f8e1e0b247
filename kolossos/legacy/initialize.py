"""``initialize``: build the legacy :class:`~kolossos.legacy.engine.Engine` from the launch
config (``gpc.config``), as ``colossalai.initialize`` does. Also ``kolossos.initialize(...)``."""

from __future__ import annotations

import pprint
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import Optimizer

from kolossos.accelerator import get_accelerator
from kolossos.booster import Booster
from kolossos.interface import OptimizerWrapper
from kolossos.legacy.amp import AMP_TYPE
from kolossos.legacy.context import ParallelMode
from kolossos.legacy.core import global_context as gpc
from kolossos.legacy.engine import Engine
from kolossos.legacy.engine.config import EngineConfig
from kolossos.legacy.engine.grad_norm import model_parallel_grad_norm
from kolossos.legacy.engine.gradient_accumulation import accumulate_gradient
from kolossos.legacy.engine.gradient_handler import BaseGradientHandler
from kolossos.legacy.engine.schedule.select import (
    build_schedule,
    check_pipeline_config,
    with_pipeline_handlers,
)
from kolossos.legacy.engine.zero import ZeroSettings
from kolossos.legacy.registry import GRADIENT_HANDLER
from kolossos.legacy.utils import is_using_sequence
from kolossos.logging import get_dist_logger
from kolossos.moe import expert_parallel_grad_norm, is_moe_param, sync_moe_params

__all__ = ["initialize"]

Criterion = Callable[..., torch.Tensor]


def _check_environment(ophooks: Sequence[Any] | None) -> None:
    """Refuse what this step does not provide yet, before any collective."""
    if ophooks:
        raise NotImplementedError(
            f"initialize(ophooks=...) ({len(ophooks)} given) is not supported; use torch module "
            "hooks (register_forward_hook / register_full_backward_hook) on the model."
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize needs the distributed environment: call kolossos.launch_from_torch("
            "config=...) (or another kolossos.launch*) first."
        )
    check_pipeline_config(gpc.config, gpc.pipeline_parallel_size)  # NUM_MICRO_BATCHES, ...


def _check_zero_layout() -> None:
    """ZeRO through ``initialize`` shards over the whole world: refuse model parallelism."""
    tp, pp = gpc.tensor_parallel_size, gpc.pipeline_parallel_size
    if tp > 1 or pp > 1:
        raise NotImplementedError(
            f"zero=dict(...) with tensor size {tp} and pipeline size {pp}: ZeRO through "
            "kolossos.initialize shards over the data-parallel world only; drop parallel.tensor "
            "and parallel.pipeline, or use Booster(plugin=HybridParallelPlugin(tp_size=..., "
            "pp_size=..., zero_stage=1|2))."
        )


def _apply_zero(
    settings: ZeroSettings, model: nn.Module, optimizer: Any, criterion: Criterion | None
) -> tuple[nn.Module, OptimizerWrapper, Criterion | None]:
    """Wrap model and optimizer with the Booster's ZeRO engine (COLLECTIVE)."""
    booster = Booster(plugin=settings.build_plugin())
    model, optim, criterion, _, _ = booster.boost(model, optimizer, criterion)
    assert optim is not None  # an optimizer went in
    return model, optim, criterion


def _build_model_and_optimizer(
    model: Any, optimizer: Any
) -> tuple[nn.Module, Optimizer | OptimizerWrapper]:
    """Build a model given as a factory and an optimizer given as a class, on the device."""
    if not isinstance(model, nn.Module):
        if not callable(model):
            raise TypeError(f"model must be an nn.Module or a function building one, got {model!r}")
        model = model()
        if not isinstance(model, nn.Module):
            raise TypeError(f"the model function returned {type(model).__name__}, not nn.Module")
    model = model.to(get_accelerator().get_current_device())
    if not isinstance(optimizer, (Optimizer, OptimizerWrapper)):
        if not callable(optimizer):
            raise TypeError(
                f"optimizer must be a torch optimizer or its class, got {type(optimizer).__name__}"
            )
        optimizer = optimizer(model.parameters())
    if not isinstance(optimizer, (Optimizer, OptimizerWrapper)):
        raise TypeError(
            f"the optimizer class returned {type(optimizer).__name__}, not an Optimizer"
        )
    return model, optimizer


def _broadcast_from_first_data_rank(
    model: nn.Module, mode: ParallelMode = ParallelMode.DATA
) -> None:
    """Make every replica in ``mode`` (DATA; SEQUENCE_DP under sequence parallelism, where all
    ranks of a stage hold the whole model) start from the same weights (a collective). Expert
    parameters differ across their expert-parallel group: each is broadcast over its own
    expert data-parallel group instead."""
    group = gpc.get_group(mode)
    src = gpc.get_ranks_in_group(mode)[0]
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if not is_moe_param(tensor):
                dist.broadcast(tensor.data, src=src, group=group)  # SYNC POINT
    sync_moe_params(model)


def _sequence_parallel_reduction(
    model: nn.Module, config: EngineConfig
) -> tuple[nn.Module, list[dict[str, Any]] | None, str]:
    """Under ``mode='sequence'`` without handlers (as upstream): torch DDP over SEQUENCE_DP, or
    ``SequenceParallelGradientHandler`` where DDP does not fit (fp16 NAIVE, pipeline)."""
    if config.amp_mode is AMP_TYPE.NAIVE or gpc.pipeline_parallel_size > 1:
        note = "SequenceParallelGradientHandler (fp16 NAIVE or pipeline)"
        return model, [dict(type="SequenceParallelGradientHandler")], note
    accelerator = get_accelerator()
    device_ids = None if accelerator.name == "cpu" else [accelerator.current_device()]
    group = gpc.get_group(ParallelMode.SEQUENCE_DP)
    ddp = DDP(model, device_ids=device_ids, process_group=group, **config.torch_ddp.ddp_kwargs())
    return ddp, None, "torch DistributedDataParallel over SEQUENCE_DP"


def _build_handlers(
    entries: list[dict[str, Any]], model: nn.Module, optimizer: Any
) -> list[BaseGradientHandler]:
    handlers = []
    for entry in entries:
        kwargs = dict(entry)
        cls = GRADIENT_HANDLER.get_module(kwargs.pop("type"))
        handlers.append(cls(model, optimizer, **kwargs))
    return handlers


def initialize(
    model: nn.Module | Callable[[], nn.Module],
    optimizer: Optimizer | OptimizerWrapper | Callable[..., Optimizer],
    criterion: Criterion | None = None,
    train_dataloader: Iterable[Any] | None = None,
    test_dataloader: Iterable[Any] | None = None,
    lr_scheduler: Any = None,
    ophooks: Sequence[Any] | None = None,
    verbose: bool = True,
) -> tuple[Engine, Any, Any, Any]:
    """Wrap model, optimizer, criterion, dataloader and lr scheduler with the features the
    launch config asks for, and return them behind an :class:`Engine`.

    Keys read from ``gpc.config`` (all checked before any collective):
    ``fp16=dict(mode=AMP_TYPE.TORCH|NAIVE|APEX, **kwargs)`` (the Booster's mixed-precision
    recipes), ``gradient_accumulation=N``, ``clip_grad_norm=x``,
    ``gradient_handler=[dict(type=..., **kwargs)]`` (``GRADIENT_HANDLER`` registry),
    ``torch_ddp=dict(...)``, ``cudnn_benchmark``, ``cudnn_deterministic``. With a data-parallel
    size above 1 and no handler, the model is wrapped in torch DDP over ``ParallelMode.DATA``
    (with ``AMP_TYPE.NAIVE``, ``DataParallelGradientHandler`` is used instead, as upstream);
    under ``parallel.tensor mode='sequence'``, over ``ParallelMode.SEQUENCE_DP`` (or
    ``SequenceParallelGradientHandler``). A model with expert parameters (``kolossos.moe``) gets
    ``MoeGradientHandler`` and a gradient norm summed over the expert-parallel groups.

    Args:
        model: the model, or a function building it (moved to the accelerator's device).
        optimizer: its optimizer, or an optimizer class called with ``model.parameters()``.
        criterion: the loss function.
        train_dataloader: wrapped for gradient accumulation (whole cycles per epoch).
        test_dataloader: returned as given.
        lr_scheduler: wrapped for gradient accumulation (one real step per cycle).
        ophooks: not supported (must be empty).
        verbose: log the config and the choices made on rank 0.

    Returns:
        ``(engine, train_dataloader, test_dataloader, lr_scheduler)``.

    Raises:
        RuntimeError: called before ``kolossos.launch*``.
        EngineConfigError, ValueError, TypeError: a bad feature key (see ``EngineConfig``).
        NotImplementedError: ``zero`` with model parallelism, ``ophooks``.

    Example:
        >>> kolossos.launch_from_torch(config=dict(fp16=dict(mode=AMP_TYPE.TORCH)))
        >>> engine, train_loader, _, _ = kolossos.initialize(
        ...     model, optimizer, criterion, train_loader)  # doctest: +SKIP
    """
    config = EngineConfig.from_config(gpc.config)  # every config error surfaces here, locally
    _check_environment(ophooks)
    if config.zero is not None:
        _check_zero_layout()
    logger = get_dist_logger()
    gpc.verbose = verbose
    if verbose:
        logger.info(f"initialize with the config:\n{pprint.pformat(dict(gpc.config))}", ranks=[0])
    torch.backends.cudnn.benchmark = config.cudnn_benchmark
    torch.backends.cudnn.deterministic = config.cudnn_deterministic

    model, optim = _build_model_and_optimizer(model, optimizer)
    dp_size = gpc.get_world_size(ParallelMode.DATA)
    has_experts = any(is_moe_param(p) for p in model.parameters())
    if has_experts and config.zero is not None:
        raise NotImplementedError(
            "zero=dict(...) with a MoE model: ZeRO through kolossos.initialize shards every "
            "parameter over the data-parallel world, but expert parameters are replicated only "
            "over their MoE data group; drop zero for MoE models."
        )
    if is_using_sequence():
        _broadcast_from_first_data_rank(model, ParallelMode.SEQUENCE_DP)
    elif dp_size > 1:
        _broadcast_from_first_data_rank(model)
    if config.amp is not None:
        model, amp_optim, criterion = config.amp.configure(model, optim, criterion)
        assert amp_optim is not None  # an optimizer went in
        optim = amp_optim
    if config.zero is not None:
        model, optim, criterion = _apply_zero(config.zero, model, optim, criterion)

    entries = config.gradient_handlers
    if entries is None and config.zero is not None:
        entries = [dict(type="ZeROGradientHandler")]
    elif entries is None and is_using_sequence():
        model, entries, note = _sequence_parallel_reduction(model, config)
        if verbose:
            logger.info(f"sequence parallelism: gradients reduced by {note}", ranks=[0])
    elif entries is None and has_experts and dp_size > 1:
        entries = [dict(type="MoeGradientHandler")]  # experts average over their own groups
    elif entries is None and dp_size > 1:
        if config.amp_mode is AMP_TYPE.NAIVE or gpc.pipeline_parallel_size > 1:
            entries = [dict(type="DataParallelGradientHandler")]
            note = "DataParallelGradientHandler (fp16 NAIVE or pipeline)"
        else:
            accelerator = get_accelerator()
            device_ids = None if accelerator.name == "cpu" else [accelerator.current_device()]
            group = gpc.get_group(ParallelMode.DATA)
            model = DDP(
                model, device_ids=device_ids, process_group=group, **config.torch_ddp.ddp_kwargs()
            )
            note = "torch DistributedDataParallel"
        if verbose:
            logger.info(f"data parallel size {dp_size}: gradients reduced by {note}", ranks=[0])
    wrapped = optim if isinstance(optim, OptimizerWrapper) else OptimizerWrapper(optim)
    if config.zero is None:  # the ZeRO optimizers compute their own global norm
        wrapped.grad_norm_fn = expert_parallel_grad_norm(model) or model_parallel_grad_norm()
    entries = with_pipeline_handlers(entries, model)  # shared (tied) pipeline parameters
    handlers = None if entries is None else _build_handlers(entries, model, wrapped)

    if config.gradient_accumulation is not None:
        wrapped, train_dataloader, handlers, lr_scheduler = accumulate_gradient(  # type: ignore[assignment]
            model,
            wrapped,
            train_dataloader,
            config.gradient_accumulation,
            gradient_handlers=handlers,
            lr_scheduler=lr_scheduler,
        )
    engine = Engine(
        model,
        wrapped,
        criterion,
        gradient_handlers=handlers,
        clip_grad_norm=config.clip_grad_norm,
        verbose=verbose,
        schedule=build_schedule(gpc.config, gpc.pipeline_parallel_size),
    )
    return engine, train_dataloader, test_dataloader, lr_scheduler
