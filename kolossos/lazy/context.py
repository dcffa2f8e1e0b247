"""``LazyInitContext``: build a model without allocating it, materialise it later, shard by shard.

Inside the context every tensor a model creates is a meta tensor (no memory) and every operator
that fills it — ``nn.init`` calls, Hugging Face ``post_init``, ``tie_weights``, buffers computed
from other buffers — is recorded. :meth:`LazyInitContext.materialize` replays the record on real
tensors. The replay draws the same random numbers as the eager build did (each generator's state
is recorded, reseeds included), so the values are identical bit for bit to building the model
without the context under the same seed. Plugins do not materialise the whole model: each replays
the record and keeps only its own shard (see ``docs/lazy_init.md``).

Example:
    >>> with LazyInitContext():
    ...     model = nn.Linear(1024, 1024)  # no memory yet
    >>> model.weight.is_meta
    True
    >>> LazyInitContext.materialize(model).weight.is_meta
    False
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch
import torch.nn as nn

from kolossos.lazy.materialize import is_lazy, materialize_module, module_tape
from kolossos.lazy.recorder import Recorder
from kolossos.lazy.tape import Tape
from kolossos.logging import get_dist_logger

__all__ = ["LazyInitContext", "LazyTensor"]


class _LazyTensorMeta(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, torch.Tensor) and is_lazy(instance)


class LazyTensor(metaclass=_LazyTensorMeta):
    """The type of tensors built inside a :class:`LazyInitContext` and not materialised yet:
    ``isinstance(t, LazyTensor)`` tells them apart. They are meta tensors (shape, dtype and
    strides, no data) whose storage knows how to compute its values."""

    def __init__(self) -> None:
        raise TypeError(
            "LazyTensor is not constructed directly; build tensors inside LazyInitContext()."
        )


def _device(device: torch.device | str | int | None) -> torch.device | None:
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(
            f"default_device={device!r} must be None, a torch.device, a str or an int (a CUDA "
            "index)."
        )
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


class LazyInitContext:
    """Build models inside ``with LazyInitContext():`` without allocating their tensors.

    Args:
        tensor_cls: Colossal-AI's test hook; only :class:`LazyTensor` (the default) is accepted.
        default_device: the device tensors are built on when the code names none (``None``:
            torch's default device, normally the CPU). Values are those of an eager build on
            that device.

    Raises:
        TypeError: a bad ``default_device``.
        NotImplementedError: another ``tensor_cls``, or nesting contexts.
    """

    def __init__(
        self,
        tensor_cls: Any = LazyTensor,
        default_device: torch.device | str | int | None = None,
    ) -> None:
        if tensor_cls is not LazyTensor:
            raise NotImplementedError(
                f"LazyInitContext(tensor_cls={tensor_cls!r}): only kolossos.lazy.LazyTensor is "
                "supported; omit the argument."
            )
        self.default_device = _device(default_device)
        self.tape = Tape()
        self._recorder: Recorder | None = None

    def __enter__(self) -> LazyInitContext:
        if self._recorder is not None:
            raise NotImplementedError("a LazyInitContext cannot be entered twice at once.")
        self._recorder = Recorder(self.tape, self.default_device)
        self._recorder.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._recorder is not None
        self._recorder.__exit__(exc_type, exc, tb)
        self._recorder = None

    @staticmethod
    def materialize(module: nn.Module, verbose: bool = False) -> nn.Module:
        """Give ``module``'s lazy parameters and buffers their values, in place, on this rank
        (no communication); returns ``module``. Parameters stay the same objects.

        Raises:
            ValueError: a tensor is still on the meta device but was not recorded (moved or
                cast after the context closed), or tensors of two contexts are mixed.
        """
        _check_recorded(module)
        count = materialize_module(module)
        if verbose:
            get_dist_logger().info(f"LazyInitContext: materialised {count:,} elements.", ranks=[0])
        return module

    @staticmethod
    def distribute(
        module: nn.Module, device_mesh: Any, sharding_spec_dict: Any, verbose: bool = False
    ) -> nn.Module:
        """Colossal-AI's materialise-with-sharding-specs entry point; it needs the distributed
        tensor API, which kolossos does not have yet.

        Raises:
            NotImplementedError: always; boost the lazy model with a plugin instead (each
                plugin materialises only its shard).
        """
        raise NotImplementedError(
            "LazyInitContext.distribute(module, device_mesh, sharding_spec_dict) needs the "
            "distributed tensor API; pass the lazy model to booster.boost() instead — "
            "GeminiPlugin, TorchFSDPPlugin and HybridParallelPlugin materialise only this rank's "
            "shard."
        )

    @staticmethod
    @contextmanager
    def resume(module: nn.Module) -> Iterator[None]:
        """Record again on ``module``'s tape (e.g. while a plugin cuts tensor-parallel shards out
        of its lazy weights), so the cut is replayed at materialisation. No-op for an eager
        module."""
        tape = module_tape(module)
        if tape is None:
            yield
            return
        with Recorder(tape, None):
            yield


def _check_recorded(module: nn.Module) -> None:
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if tensor.is_meta and not is_lazy(tensor):
            raise ValueError(
                f"{name} is on the meta device but was not built inside LazyInitContext (or was "
                "moved or cast after the context closed, which is not recorded); build and "
                "change the model inside the context, or initialise it yourself."
            )
