"""``Booster``: the one object a training script talks to. It only dispatches: mixed precision to
a recipe, parallelism to the plugin, saving and loading to the plugin's checkpoint IO."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from kolossos.accelerator import get_accelerator
from kolossos.booster.boost_checks import UnshardedDataWarning, check_boost_arguments
from kolossos.booster.mixed_precision import MixedPrecision, mixed_precision_factory
from kolossos.booster.plugin.plugin_base import Plugin
from kolossos.checkpoint_io import CheckpointIO, GeneralCheckpointIO, LoadReport
from kolossos.checkpoint_io.async_writer import AsyncWriter
from kolossos.interface import OptimizerWrapper
from kolossos.lazy import is_lazy_module, materialize_on

__all__ = ["Booster", "UnshardedDataWarning"]

Criterion = Callable[..., torch.Tensor]

_PIPELINE_PLUGINS = "HybridParallelPlugin with pp_size > 1"
#: set on every model and optimizer a Booster consumed or returned (boosting twice is refused)
_BOOSTED_MARK = "_kolossos_boosted"


def _is_boosted(obj: Any) -> bool:
    return bool(vars(obj).get(_BOOSTED_MARK, False))


def _mark_boosted(obj: Any) -> None:
    vars(obj)[_BOOSTED_MARK] = True  # kept on the object it describes (no global registry)


def _check_fresh(obj: Any, what: str) -> None:
    if _is_boosted(obj):
        raise RuntimeError(
            f"this {what} ({type(obj).__name__}) has already been boosted; boost each model and "
            "optimizer exactly once and keep using the objects booster.boost returned."
        )


class Booster:
    """Injects parallelism and mixed precision into a model, optimizer, criterion, data loader and
    LR scheduler, and saves/loads them.

    Args:
        device: where a model goes when no plugin places it (default: the accelerator's device;
            an unavailable device such as ``'cuda'`` on a CPU machine falls back with a warning).
        mixed_precision: ``'fp16'``, ``'fp16_naive'``, ``'fp16_apex'``, ``'bf16'``, ``'fp32'`` or
            a :class:`~kolossos.booster.mixed_precision.MixedPrecision` object. Not allowed with
            plugins that control precision (pass ``precision=`` to them).
        plugin: a :class:`~kolossos.booster.plugin.Plugin`, or ``None`` for one-process training.

    Raises:
        TypeError / ValueError: a bad argument, or a precision the plugin does not support.

    Example:
        >>> plugin = TorchDDPPlugin()
        >>> booster = Booster(mixed_precision="bf16", plugin=plugin)
        >>> model, optimizer, criterion, _, scheduler = booster.boost(
        ...     model, optimizer, criterion, lr_scheduler=scheduler)  # doctest: +SKIP
        >>> booster.backward(criterion(model(x), y), optimizer)  # doctest: +SKIP
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        mixed_precision: str | MixedPrecision | None = None,
        plugin: Plugin | None = None,
    ) -> None:
        if plugin is not None and not isinstance(plugin, Plugin):
            raise TypeError(
                f"plugin must be a kolossos.booster.plugin.Plugin instance, got "
                f"{type(plugin).__name__}; e.g. Booster(plugin=TorchDDPPlugin())."
            )
        self.plugin = plugin
        self.device = self._resolve_device(device)
        self.mixed_precision = self._resolve_precision(mixed_precision)
        self._async_writer = AsyncWriter()
        self._optimizers_of: weakref.WeakKeyDictionary[nn.Module, list[OptimizerWrapper]] = (
            weakref.WeakKeyDictionary()
        )

    # --- construction -----------------------------------------------------------------------
    def _resolve_device(self, device: str | torch.device | None) -> torch.device:
        own = get_accelerator().get_current_device()
        if device is None:
            return own
        wanted = torch.device(device)
        if wanted.type != own.type:
            warnings.warn(
                f"Booster(device={str(device)!r}) is not available here; using {own}.",
                RuntimeWarning,
                stacklevel=3,
            )
            return own
        return wanted

    def _resolve_precision(self, mp: str | MixedPrecision | None) -> MixedPrecision | None:
        if mp is None:
            return None
        if self.plugin is not None and self.plugin.control_precision():
            raise ValueError(
                f"{self.plugin.name} controls precision itself: pass precision=... to the plugin "
                f"instead of Booster(mixed_precision={mp!r})."
            )
        if isinstance(mp, str):
            name = mp
            recipe = mixed_precision_factory(mp)
        elif isinstance(mp, MixedPrecision):
            name, recipe = mp.name, mp
        else:
            raise TypeError(
                f"mixed_precision must be a string or a MixedPrecision object, got "
                f"{type(mp).__name__}."
            )
        if self.plugin is not None and name not in self.plugin.supported_precisions():
            raise ValueError(
                f"{self.plugin.name} does not support mixed_precision={name!r}; it supports "
                f"{', '.join(self.plugin.supported_precisions())}."
            )
        return recipe

    # --- boosting ---------------------------------------------------------------------------
    def boost(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        criterion: Criterion | None = None,
        dataloader: DataLoader[Any] | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> tuple[nn.Module, OptimizerWrapper | None, Criterion | None, DataLoader[Any] | None, Any]:
        """Wrap the training objects; returns ``(model, optimizer, criterion, dataloader,
        lr_scheduler)`` in that order (``None`` where ``None`` was given).

        Mixed precision is applied before the plugin wraps the model, so a data-parallel
        wrapper sees the final parameter dtypes.

        Before anything is wrapped (before any collective), the arguments are checked to belong
        together: every parameter the optimizer updates is a parameter of ``model``; an
        ``lr_scheduler`` drives that optimizer; with a plugin, a ``DistributedSampler`` of
        ``dataloader`` splits the data as the plugin's data-parallel axis does (``num_replicas ==
        plugin.dp_size``, ``rank == plugin.dp_rank``), and a loader without one gets an
        :class:`UnshardedDataWarning` when ``plugin.dp_size > 1`` (see ``docs/booster.md``).

        Raises:
            TypeError: ``model`` is not an ``nn.Module`` or ``optimizer`` not an optimizer.
            RuntimeError: the model or optimizer was boosted before.
            ValueError: the optimizer holds a tensor that is not a parameter of ``model``, the
                scheduler is bound to another optimizer, or the sampler's layout is not the
                plugin's.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        if optimizer is not None and not isinstance(optimizer, (Optimizer, OptimizerWrapper)):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        _check_fresh(model, "model")
        if optimizer is not None:
            _check_fresh(optimizer, "optimizer")
        check_boost_arguments(model, optimizer, dataloader, lr_scheduler, self.plugin)
        _mark_boosted(model)
        if optimizer is not None:
            _mark_boosted(optimizer)
        user_model = model
        takes_lazy = self.plugin is not None and self.plugin.control_device()
        if is_lazy_module(model) and (not takes_lazy or self.mixed_precision is not None):
            # the model is moved or cast before a plugin sees it: whole, here (COLLECTIVE)
            materialize_on(model, self.device)
        if self.plugin is None or not self.plugin.control_device():
            model = model.to(self.device)
        wrapped_opt: OptimizerWrapper | None = None
        if optimizer is not None:
            wrapped_opt = (
                optimizer
                if isinstance(optimizer, OptimizerWrapper)
                else OptimizerWrapper(optimizer)
            )
        if self.mixed_precision is not None:
            model, wrapped_opt, criterion = self.mixed_precision.configure(
                model, wrapped_opt, criterion
            )
        if self.plugin is not None:
            model, wrapped_opt, criterion, dataloader, lr_scheduler = self.plugin.configure(
                model, wrapped_opt, criterion, dataloader, lr_scheduler
            )
        _mark_boosted(model)
        if wrapped_opt is not None:
            _mark_boosted(wrapped_opt)
            self._optimizers_of.setdefault(model, []).append(wrapped_opt)
            if not wrapped_opt.has_param_names():
                # Optimizer checkpoints are keyed by the model's parameter names (a tied
                # parameter under its last name: the format this path has always written).
                named = user_model.named_parameters(remove_duplicate=False)
                wrapped_opt.set_param_names({p: n for n, p in named})
        return model, wrapped_opt, criterion, dataloader, lr_scheduler

    def backward(self, loss: torch.Tensor, optimizer: OptimizerWrapper) -> None:
        """Back-propagate ``loss`` through the optimizer (which may scale it)."""
        if not isinstance(optimizer, OptimizerWrapper):
            raise TypeError(
                "booster.backward needs the optimizer returned by booster.boost, got "
                f"{type(optimizer).__name__}."
            )
        optimizer.backward(loss)

    def no_sync(
        self, model: nn.Module | None = None, optimizer: OptimizerWrapper | None = None
    ) -> AbstractContextManager[None]:
        """A context for gradient accumulation: backward passes inside it do not communicate.

        Run the non-final micro-batches inside it and the final one (followed by
        ``optimizer.step()``) outside. Without a plugin this is a no-op context.

        Raises:
            NotImplementedError: the plugin cannot skip gradient synchronisation.
        """
        if self.plugin is None:
            return nullcontext()
        if not self.plugin.support_no_sync():
            raise NotImplementedError(f"{self.plugin.name} does not support no_sync().")
        if model is None:
            raise ValueError("no_sync needs the boosted model: booster.no_sync(model).")
        return self.plugin.no_sync(model, optimizer)

    def execute_pipeline(
        self,
        data_iter: Iterator[Any],
        model: nn.Module,
        criterion: Criterion,
        optimizer: OptimizerWrapper | None = None,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        """Run one pipelined training step (forward and backward of every micro-batch of
        ``next(data_iter)``) with the plugin's schedule; step ``optimizer`` afterwards. Called
        under ``torch.no_grad()`` it is forward-only (evaluation): the same loss and outputs,
        no backward, no autograd graph, no gradient touched, ``optimizer`` not needed.

        Returns:
            ``{"loss": ..., "outputs": ...}``, filled on the rank holding the last stage
            (``None`` elsewhere, and when not asked for).

        Raises:
            NotImplementedError: the plugin does not run pipelines (only
                ``HybridParallelPlugin`` with ``pp_size > 1`` does).
        """
        if self.plugin is None or not self.plugin.support_pipeline():
            current = self.plugin.name if self.plugin is not None else "no plugin"
            raise NotImplementedError(
                f"execute_pipeline needs a pipeline-parallel plugin ({_PIPELINE_PLUGINS}); the "
                f"Booster has {current}. Use model/criterion/booster.backward for a normal step."
            )
        return self.plugin.execute_pipeline(
            data_iter, model, criterion, optimizer, return_loss, return_outputs
        )

    # --- checkpoints ------------------------------------------------------------------------
    @property
    def checkpoint_io(self) -> CheckpointIO:
        """The checkpoint IO in use (the plugin's, or the general one), writing asynchronous
        saves through this Booster's one background writer."""
        if self.plugin is not None and self.plugin.control_checkpoint_io():
            io = self.plugin.get_checkpoint_io()
        else:
            io = GeneralCheckpointIO()
        io.async_writer = self._async_writer
        return io

    def save_model(
        self,
        model: nn.Module,
        checkpoint: str,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_safetensors: bool = False,
        use_async: bool = False,
    ) -> None:
        """Save model weights: one file, or (``shard=True``) a Hugging Face-style directory of
        shards of at most ``size_per_shard`` MB plus an index.

        With ``use_async=True`` the call returns once the weights are copied to host memory
        (after the collectives that gather them); the files are written in the background,
        with the same crash safety. :meth:`wait_async_saves` waits for them; loads through
        this Booster wait on their own. The host copy costs memory for one copy of the state.
        """
        self.checkpoint_io.save_model(
            model,
            checkpoint,
            shard,
            gather_dtensor,
            prefix,
            size_per_shard,
            use_safetensors,
            use_async,
        )

    def load_model(self, model: nn.Module, checkpoint: str, strict: bool = True) -> LoadReport:
        """Load model weights saved in any supported format (detected from the files).

        Returns:
            What was missing, unexpected or wrongly shaped (empty unless ``strict=False``).
        """
        report = self.checkpoint_io.load_model(model, checkpoint, strict)
        for optimizer in self._optimizers_of.get(model, []):
            optimizer.sync_master_weights()  # fp32 master copies follow the loaded weights
        return report

    def save_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_async: bool = False,
    ) -> None:
        """Save optimizer state (keyed by parameter name, loadable under another layout);
        ``use_async`` as in :meth:`save_model`."""
        self.checkpoint_io.save_optimizer(
            optimizer, checkpoint, shard, gather_dtensor, prefix, size_per_shard, use_async
        )

    def async_saves_pending(self) -> bool:
        """Whether this process still writes an asynchronous save (never blocks; local)."""
        return self._async_writer.pending()

    def wait_async_saves(self) -> None:
        """Wait until this process's asynchronous saves are on disk (local: no collective; a
        checkpoint is complete once every rank returned from it).

        Raises:
            CheckpointError: a background write failed (the path and the error named).
        """
        self._async_writer.wait()

    def load_optimizer(self, optimizer: OptimizerWrapper, checkpoint: str) -> LoadReport:
        """Load optimizer state saved by :meth:`save_optimizer` (keyed by parameter name)."""
        return self.checkpoint_io.load_optimizer(optimizer, checkpoint)

    def save_lr_scheduler(self, lr_scheduler: LRScheduler, checkpoint: str) -> None:
        """Save an LR scheduler's state to a file."""
        self.checkpoint_io.save_lr_scheduler(lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler: LRScheduler, checkpoint: str) -> None:
        """Load an LR scheduler's state from a file."""
        self.checkpoint_io.load_lr_scheduler(lr_scheduler, checkpoint)

    def __repr__(self) -> str:
        mp = type(self.mixed_precision).__name__ if self.mixed_precision else "fp32"
        return f"Booster(device={self.device}, mixed_precision={mp}, plugin={self.plugin!r})"
