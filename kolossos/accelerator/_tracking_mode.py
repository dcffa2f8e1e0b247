"""The machinery under TensorMemoryTracker: its dispatch mode and the registry of active trackers.

The mode runs after every operator of the thread that entered it (autograd's backward inherits it)
and hands the output storages to the tracker's ledger. The registry lets the CPU accelerator find
the active tracker, and patches ``UntypedStorage.resize_`` while any tracker is active, because code
like FSDP2 frees and re-allocates parameter memory by resizing storages outside the dispatcher.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from kolossos.accelerator.memory_tracker import TensorMemoryTracker

__all__ = ["TrackingMode", "activate", "active_tracker", "deactivate", "storages_of"]

_active: list[TensorMemoryTracker] = []  # entered trackers, innermost last
_active_lock = threading.Lock()
_original_resize: Callable[..., Any] | None = None


def storages_of(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """Yield the storages holding ``tensor``'s data (the inner tensors' for wrapper subclasses)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and is_traceable_wrapper_subclass(
        tensor
    ):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):  # torch 2.13's DTensor also lists its mesh here
                yield from storages_of(inner)
        return
    try:
        yield tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, functional, ...
        return


def active_tracker(device_type: str | None = None) -> TensorMemoryTracker | None:
    """Return the innermost active tracker (of ``device_type``, e.g. ``"cpu"``), or ``None``."""
    with _active_lock:
        for tracker in reversed(_active):
            if device_type is None or tracker.device.type == device_type:
                return tracker
    return None


def _tracked_resize(storage: torch.UntypedStorage, size: int) -> Any:
    """``UntypedStorage.resize_`` while a tracker is active: resize, then trackers re-read it."""
    assert _original_resize is not None
    result = _original_resize(storage, size)
    for tracker in list(_active):
        tracker._ledger.refresh(storage)
    return result


def activate(tracker: TensorMemoryTracker) -> None:
    """Register ``tracker`` as active (innermost); the first one patches storage resizing."""
    global _original_resize
    with _active_lock:
        if not _active:
            _original_resize = torch.UntypedStorage.resize_
            torch.UntypedStorage.resize_ = _tracked_resize  # type: ignore[method-assign,assignment]
        _active.append(tracker)


def deactivate(tracker: TensorMemoryTracker) -> None:
    """Unregister ``tracker``; the last one restores ``UntypedStorage.resize_``."""
    global _original_resize
    with _active_lock:
        _active.remove(tracker)
        if not _active and _original_resize is not None:
            torch.UntypedStorage.resize_ = _original_resize  # type: ignore[method-assign]
            _original_resize = None


class TrackingMode(TorchDispatchMode):
    """Dispatch mode entering each operator's newly allocated output storages into a tracker."""

    def __init__(self, tracker: TensorMemoryTracker) -> None:
        super().__init__()
        self._tracker = tracker
        # torch.tensor(...) and torch.from_numpy hand over fresh data through these aliasing ops.
        self._fresh_ops = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift.default)

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        self._record(func, args, kwargs, out)
        return out

    def _record(self, func: torch._ops.OpOverload, args: Any, kwargs: Any, out: Any) -> None:
        """Enter the storages of ``out`` that are new: not counted yet and not an input's."""
        tracker = self._tracker
        ledger, category = tracker._ledger, tracker._categories[-1]
        input_keys: set[int] | None = None
        fresh = func in self._fresh_ops
        for leaf in tree_leaves(out):
            if not isinstance(leaf, torch.Tensor):
                continue
            for storage in storages_of(leaf):
                if not tracker._wants(storage):
                    continue
                if storage in ledger:
                    ledger.refresh(storage)  # ``resize_`` and ``out=`` can change its size
                    continue
                if not fresh:
                    if input_keys is None:
                        input_keys = {
                            s._cdata
                            for a in tree_leaves((args, kwargs))
                            if isinstance(a, torch.Tensor)
                            for s in storages_of(a)
                        }
                    if storage._cdata in input_keys:
                        continue  # a view of, or in-place result on, an untracked older tensor
                ledger.add(storage, category)
        if "resize" in getattr(
            func, "__name__", ""
        ):  # e.g. inductor's resize_storage_bytes_ returns nothing
            for leaf in tree_leaves(args):
                if isinstance(leaf, torch.Tensor):
                    for storage in storages_of(leaf):
                        ledger.refresh(storage)
