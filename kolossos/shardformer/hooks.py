"""Forward hooks the sharder installs: communication at the entry of tensor-parallel regions,
the sequence split and gather of Megatron sequence parallelism, and RNG-state switching for
dropout on sharded activations.

Hooks leave the transformers forward code untouched, so the model keeps its outputs and
arguments; every hook acts on one named tensor argument (or the output) of one module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from kolossos.nn.layer.parallel_1d import (
    copy_to_tp,
    gather_from_tp,
    gather_seq_reduce_scatter_grad,
    get_tp_rng_tracker,
    split_to_tp,
)

__all__ = [
    "RngFork",
    "add_input_hook",
    "add_output_hook",
    "region_entry",
    "sequence_gather",
    "sequence_split",
]

TensorFn = Callable[[torch.Tensor], torch.Tensor]


def _first_param(module: nn.Module) -> str:
    params = list(inspect.signature(module.forward).parameters)
    return params[0] if params else ""


def add_input_hook(module: nn.Module, arg: str | None, fn: TensorFn) -> RemovableHandle:
    """Apply ``fn`` to ``module``'s forward argument ``arg`` (given by name or first); ``None``
    means the first argument whatever its name (a replaced layer's own ``forward(x)``)."""
    first = _first_param(module)
    name = first if arg is None else arg
    positional_first = first == name

    def hook(
        mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if name in kwargs:
            kwargs = {**kwargs, name: fn(kwargs[name])}
        elif positional_first and args:
            args = (fn(args[0]), *args[1:])
        else:
            raise RuntimeError(
                f"{type(mod).__name__} was called without its {name!r} argument; the "
                "tensor-parallel hook cannot find the activations."
            )
        return args, kwargs

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def add_output_hook(module: nn.Module, fn: TensorFn) -> RemovableHandle:
    """Apply ``fn`` to ``module``'s output (a tensor, or the first element of a tuple)."""

    def hook(mod: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return fn(output)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (fn(output[0]), *output[1:])
        raise RuntimeError(
            f"{type(mod).__name__} returned {type(output).__name__}; the sequence gather expects "
            "a tensor or a tuple starting with one."
        )

    return module.register_forward_hook(hook)


def region_entry(group: ProcessGroup, sequence_parallel: bool, seq_dim: int) -> TensorFn:
    """Activations entering a tensor-parallel region, once for all its column layers (which are
    built with ``input_comm=False``).

    Without sequence parallelism: identity forward, gradient all-reduced over the group
    (Megatron's *f*). With it: the sequence shards are all-gathered, so the column layers (and
    the attention forward, which reads the sequence length from its input) see the full
    sequence; the gradient is reduce-scattered back to the shards.
    """
    if sequence_parallel:
        return lambda x: gather_seq_reduce_scatter_grad(x, group, dim=seq_dim)
    return lambda x: copy_to_tp(x, group)


def sequence_split(group: ProcessGroup, seq_dim: int) -> TensorFn:
    """Keep this rank's slice of the sequence (gradient all-gathered)."""
    return lambda x: split_to_tp(x, group, dim=seq_dim)


def sequence_gather(group: ProcessGroup, seq_dim: int) -> TensorFn:
    """Rebuild the full sequence (gradient: this rank's slice; the consumers downstream are
    replicated or vocabulary-parallel with their input gradient summed over the group)."""
    return lambda x: gather_from_tp(x, group, dim=seq_dim)


class RngFork:
    """Runs a module's forward on one stream of the tensor-parallel RNG tracker.

    The stream is entered by a pre-hook and left by a hook that also runs when the forward
    raises, so the default generators are always restored. Nested modules that act on
    replicated activations (:meth:`add_suspension`) leave the stream while they run and draw from
    the default generator, identical on every rank; the stream is re-entered afterwards (a fresh
    draw, so the masks after them are still per-rank and reproducible under recomputation).
    """

    def __init__(self, module: nn.Module, stream: str) -> None:
        self.stream = stream
        self._open: list[ExitStack | None] = []  # one entry per active call of the module
        self.handles = [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._leave, always_call=True),
        ]

    def _fork(self) -> ExitStack:
        stack = ExitStack()
        stack.enter_context(get_tp_rng_tracker().fork(self.stream))
        return stack

    def _enter(self, mod: nn.Module, args: tuple[Any, ...]) -> None:
        self._open.append(self._fork())

    def _leave(self, mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._open:
            stack = self._open.pop()
            if stack is not None:
                stack.close()

    def _suspend(self, mod: nn.Module, args: tuple[Any, ...]) -> None:
        if self._open and self._open[-1] is not None:
            self._open[-1].close()
            self._open[-1] = None

    def _resume(self, mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._open and self._open[-1] is None:
            self._open[-1] = self._fork()

    def add_suspension(self, inner: nn.Module) -> list[RemovableHandle]:
        """Leave the stream while ``inner`` (a sub-module) runs."""
        return [
            inner.register_forward_pre_hook(self._suspend),
            inner.register_forward_hook(self._resume, always_call=True),
        ]
