"""Registering modules, optimizers and tensors with a TensorMemoryTracker, and watching them.

Split from ``memory_tracker.py`` to keep each module small. Modules and optimizers are *owners*:
besides counting what they hold at :meth:`TensorMemoryTracker.track` time, the tracker hooks them
while active (gradient accumulation -> ``grads``, ``optimizer.step`` -> ``optim``) and sweeps them
once more on exit so that late gradients and states carry the right label.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from kolossos.accelerator.memory_categories import BUFFERS, GRADS, OPTIM, OTHER, PARAMS

if TYPE_CHECKING:
    from kolossos.accelerator.memory_tracker import TensorMemoryTracker

__all__ = ["install_hooks", "remove_hooks", "sweep", "track_object"]


def _leaf_grad(tensor: torch.Tensor) -> torch.Tensor | None:
    """Return ``tensor.grad`` for leaf tensors (reading it on non-leaves warns), else ``None``."""
    return tensor.grad if tensor.is_leaf else None


def _count_module(tracker: TensorMemoryTracker, module: torch.nn.Module, label: str | None) -> None:
    for param in module.parameters():
        tracker._count(param, label or PARAMS)
        tracker._count(_leaf_grad(param), label or GRADS)
    for buffer in module.buffers():
        tracker._count(buffer, label or BUFFERS)


def _count_optimizer(
    tracker: TensorMemoryTracker, optimizer: torch.optim.Optimizer, label: str | None
) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            tracker._count(param, label or PARAMS)
            tracker._count(_leaf_grad(param), label or GRADS)
    for state in optimizer.state.values():
        values = state.values() if isinstance(state, Mapping) else [state]
        for value in values:
            if isinstance(value, torch.Tensor):
                tracker._count(value, label or OPTIM)


def _remember(tracker: TensorMemoryTracker, owner: object, label: str | None) -> None:
    """Add ``owner`` to the tracker's watched objects (once; the latest label wins)."""
    tracker._owners = [(ref, lab) for ref, lab in tracker._owners if ref() not in (None, owner)]
    tracker._owners.append((weakref.ref(owner), label))


def track_object(tracker: TensorMemoryTracker, obj: Any, label: str | None) -> None:
    """Count what ``obj`` holds now; watch it if it is a module or an optimizer.

    Raises:
        TypeError: ``obj`` is not a tensor, module, optimizer or container of them.
    """
    if isinstance(obj, torch.nn.Module):
        _count_module(tracker, obj, label)
        _remember(tracker, obj, label)
    elif isinstance(obj, torch.optim.Optimizer):
        _count_optimizer(tracker, obj, label)
        _remember(tracker, obj, label)
    elif isinstance(obj, torch.Tensor):
        default = PARAMS if isinstance(obj, torch.nn.Parameter) else OTHER
        tracker._count(obj, label or default)
        tracker._count(_leaf_grad(obj), label or GRADS)
    elif isinstance(obj, Mapping):
        for value in obj.values():
            track_object(tracker, value, label)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            track_object(tracker, value, label)
    else:
        raise TypeError(
            f"TensorMemoryTracker.track() got a {type(obj).__name__}; it takes tensors, "
            "torch.nn.Module, torch.optim.Optimizer, or lists/tuples/dicts of them."
        )


def sweep(tracker: TensorMemoryTracker) -> None:
    """Count and re-label everything the watched modules and optimizers hold now."""
    for ref, label in list(tracker._owners):
        owner = ref()
        if isinstance(owner, torch.nn.Module):
            _count_module(tracker, owner, label)
        elif isinstance(owner, torch.optim.Optimizer):
            _count_optimizer(tracker, owner, label)


def _hook_param(tracker: TensorMemoryTracker, param: torch.Tensor, label: str | None) -> None:
    """After each gradient accumulation into ``param``, bill its ``.grad`` to ``grads``."""
    if not param.requires_grad or not param.is_leaf or param in tracker._hooked:
        return
    tracker_ref = weakref.ref(tracker)

    def on_grad(p: torch.Tensor) -> None:
        live = tracker_ref()
        if live is not None and live.active:
            live._count(p.grad, label or GRADS)

    tracker._hooked[param] = True
    tracker._handles.append(param.register_post_accumulate_grad_hook(on_grad))


def _hook_optimizer(
    tracker: TensorMemoryTracker, optimizer: torch.optim.Optimizer, label: str | None
) -> None:
    """Bill storages first seen inside ``optimizer.step`` to ``optim``; re-label states after."""
    if optimizer in tracker._hooked:
        return
    tracker_ref = weakref.ref(tracker)
    depth: list[int] = []  # category-stack depth at each pending step

    def before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        live = tracker_ref()
        if live is not None and live.active:
            depth.append(len(live._categories))
            live._categories.append(label or OPTIM)

    def after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        live = tracker_ref()
        if live is not None and depth:
            del live._categories[depth.pop() :]
            if live.active:
                _count_optimizer(live, opt, label)

    tracker._hooked[optimizer] = True
    tracker._handles.append(optimizer.register_step_pre_hook(before_step))
    tracker._handles.append(optimizer.register_step_post_hook(after_step))


def install_hooks(tracker: TensorMemoryTracker) -> None:
    """Hook every watched module and optimizer (idempotent)."""
    for ref, label in list(tracker._owners):
        owner = ref()
        if isinstance(owner, torch.nn.Module):
            for param in owner.parameters():
                _hook_param(tracker, param, label)
        elif isinstance(owner, torch.optim.Optimizer):
            _hook_optimizer(tracker, owner, label)
            for group in owner.param_groups:
                for param in group["params"]:
                    _hook_param(tracker, param, label)


def remove_hooks(tracker: TensorMemoryTracker) -> None:
    """Remove every hook the tracker installed and reset its category stack."""
    for handle in tracker._handles:
        handle.remove()
    tracker._handles.clear()
    tracker._hooked.clear()
    del tracker._categories[1:]
