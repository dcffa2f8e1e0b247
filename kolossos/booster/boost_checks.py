"""What ``booster.boost`` checks before it wraps anything: the optimizer, the LR scheduler and the
data loader belong to the model and the plugin (local checks, no collective)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from kolossos.booster.plugin.plugin_base import Plugin
from kolossos.interface import OptimizerWrapper

__all__ = ["UnshardedDataWarning", "check_boost_arguments"]


class UnshardedDataWarning(UserWarning):
    """``booster.boost`` got a data loader that gives every data-parallel rank the whole dataset.

    Silence it with ``warnings.filterwarnings("ignore", category=UnshardedDataWarning)`` when
    the dataset already gives each rank its own part.
    """


def _describe(tensor: Any) -> str:
    if isinstance(tensor, torch.Tensor):
        return f"shape {list(tensor.shape)}, {str(tensor.dtype).removeprefix('torch.')}"
    return f"a {type(tensor).__name__}"


def _check_optimizer_owner(model: nn.Module, inner: Optimizer) -> None:
    """Every tensor the optimizer updates must be a parameter of ``model``.

    The same rule as the hybrid engine's ``check_fresh`` (same wording), checked here for every
    plugin on what the user passed in, before any plugin replaces or re-points parameters.
    """
    own = {id(p) for p in model.parameters()}
    for g, group in enumerate(inner.param_groups):
        for j, param in enumerate(group["params"]):
            if id(param) not in own:
                raise ValueError(
                    f"optimizer param_groups[{g}].params[{j}] ({_describe(param)}) is not a "
                    f"parameter of the model ({type(model).__name__}): booster.boost trains the "
                    "model's own parameters, and an optimizer over another model (or a copy of "
                    "it) would update tensors the model never uses. Build the optimizer over "
                    "model.parameters() before booster.boost."
                )


def _check_scheduler_binding(lr_scheduler: Any, inner: Optimizer) -> None:
    """``lr_scheduler`` must drive the optimizer being boosted (its innermost torch optimizer)."""
    bound = getattr(lr_scheduler, "optimizer", None)
    if bound is None:  # not a torch-style scheduler: nothing to compare
        return
    if isinstance(bound, OptimizerWrapper):
        bound = bound.unwrap()
    if bound is not inner:
        raise ValueError(
            f"lr_scheduler ({type(lr_scheduler).__name__}) is bound to another optimizer "
            f"({type(bound).__name__} at {id(bound):#x}) than the one passed to booster.boost "
            f"({type(inner).__name__} at {id(inner):#x}): its learning rates would never reach "
            "the parameters being trained. Build the scheduler over the optimizer you boost, "
            "e.g. CosineAnnealingLR(optimizer, T_max=...)."
        )


def _index_sampler(loader: DataLoader[Any]) -> Any:
    """The sampler that decides which samples this process reads (inside a batch sampler)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", None)
    if inner is not None:
        return inner
    return batch_sampler if batch_sampler is not None else loader.sampler


def _check_dataloader_layout(loader: Any, plugin: Plugin) -> None:
    """A ``DistributedSampler`` must split the data as the plugin's data-parallel axis does; a
    loader without one gets an :class:`UnshardedDataWarning` when there are several replicas."""
    dp_size, dp_rank = getattr(plugin, "dp_size", None), getattr(plugin, "dp_rank", None)
    if not isinstance(loader, DataLoader) or not isinstance(dp_size, int):
        return
    fix = (
        "Build the loader with plugin.prepare_dataloader(dataset, batch_size, shuffle=True), "
        "or give it DistributedSampler(dataset, num_replicas=plugin.dp_size, "
        "rank=plugin.dp_rank)."
    )
    sampler = _index_sampler(loader)
    if isinstance(sampler, DistributedSampler):
        if (sampler.num_replicas, sampler.rank) != (dp_size, dp_rank):
            raise ValueError(
                f"the dataloader's {type(sampler).__name__} has num_replicas="
                f"{sampler.num_replicas}, rank={sampler.rank}, but {plugin.name} splits the data "
                f"over dp_size={dp_size} data-parallel replicas and this process is "
                f"dp_rank={dp_rank}: the processes of one replica (tensor- or pipeline-parallel "
                "peers, or shards of one model) must read the same samples, and the replicas "
                f"together the whole dataset. {fix}"
            )
    elif dp_size > 1 and not isinstance(loader.dataset, IterableDataset):
        warnings.warn(
            f"the dataloader's sampler ({type(sampler).__name__}) is not a DistributedSampler: "
            f"each of the dp_size={dp_size} data-parallel replicas of {plugin.name} would read "
            f"the whole dataset, so all of them train on the same batches. {fix} If the dataset "
            "already gives each rank its own part, silence this with "
            "warnings.filterwarnings('ignore', category=UnshardedDataWarning).",
            UnshardedDataWarning,
            stacklevel=4,
        )


def check_boost_arguments(
    model: nn.Module,
    optimizer: Optimizer | OptimizerWrapper | None,
    dataloader: Any,
    lr_scheduler: Any,
    plugin: Plugin | None,
) -> None:
    """The checks of ``booster.boost`` on the user's own objects (see ``docs/booster.md``).

    Raises:
        ValueError: the optimizer holds a tensor that is not a parameter of ``model``, the
            scheduler is bound to another optimizer, or the sampler's layout is not the plugin's.
    """
    if optimizer is not None:
        inner = optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper) else optimizer
        _check_optimizer_owner(model, inner)
        if lr_scheduler is not None:
            _check_scheduler_binding(lr_scheduler, inner)
    if plugin is not None and dataloader is not None:
        _check_dataloader_layout(dataloader, plugin)
