"""``torch.nn.init`` functions that a dispatch mode cannot record, recorded whole.

``trunc_normal_`` (rejection sampling: how many numbers it draws depends on their values),
``orthogonal_``, ``sparse_`` and ``dirac_`` return at once on a meta tensor, so their work never
reaches the :class:`~kolossos.lazy.recorder.Recorder`. While a recorder is active they are
replaced (in ``torch.nn.init`` and in transformers' table of torch's init functions) by wrappers
that record the whole call as one op, replayed by calling the original function on the real
tensor with the generator state the eager call would have had.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.nn.init

from kolossos.lazy.tape import lazy_storage

__all__ = ["WHOLE_CALLS", "CallRecorder", "recorded_init_functions"]

#: ``torch.nn.init`` attributes recorded as one op, and whether they draw random numbers
WHOLE_CALLS: dict[str, bool] = {
    "_no_grad_trunc_normal_": True,
    "orthogonal_": True,
    "sparse_": True,
    "dirac_": False,
}
_HF_TABLE = ("transformers.initialization", "TORCH_INIT_FUNCTIONS")


class CallRecorder(Protocol):
    """What the wrappers need of the recorder."""

    @property
    def active(self) -> bool:
        """Whether the recorder is recording now."""
        ...

    def record_call(
        self, fn: Callable[..., Any], tensor: torch.Tensor, args: tuple[Any, ...],
        kwargs: dict[str, Any], random: bool,
    ) -> None:  # fmt: skip
        """Record ``fn(tensor, *args, **kwargs)`` as one op writing all of ``tensor``."""
        ...


def _wrap(recorder: CallRecorder, fn: Callable[..., Any], random: bool) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if recorder.active and lazy_storage(tensor) is not None:
            recorder.record_call(fn, tensor, args, kwargs, random)
            return tensor
        return fn(tensor, *args, **kwargs)

    wrapper.__kolossos_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _original(fn: Any) -> Any:
    return getattr(fn, "__kolossos_original__", fn)


@contextmanager
def recorded_init_functions(recorder: CallRecorder) -> Iterator[None]:
    """Replace the :data:`WHOLE_CALLS` functions by recording wrappers for the duration."""
    hf_module = sys.modules.get(_HF_TABLE[0])
    table = getattr(hf_module, _HF_TABLE[1], None)
    saved: list[tuple[Any, str, Any]] = []
    for name, random in WHOLE_CALLS.items():
        current = getattr(torch.nn.init, name, None)
        if current is None:
            continue
        wrapper = _wrap(recorder, _original(current), random)
        saved.append((torch.nn.init, name, current))
        setattr(torch.nn.init, name, wrapper)
        if isinstance(table, dict) and table.get(name) is current:
            saved.append((table, name, table[name]))
            table[name] = wrapper
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            if isinstance(owner, dict):
                owner[name] = value
            else:
                setattr(owner, name, value)
