"""Activation checkpointing: Colossal-AI's functional ``colossalai.utils.checkpoint(function,
activation_offload, *args)``.

The wrapped ``function`` runs without keeping its intermediate activations; backward runs it once
more (same inputs, same random numbers) to rebuild them. Only the inputs stay alive between
forward and backward. ``activation_offload=True`` also moves those saved inputs to host memory
while they wait (pinned when the device is a GPU) and back for the recomputation; for inputs
already on the CPU it changes nothing. Built on :func:`torch.utils.checkpoint.checkpoint`
(non-reentrant), which restores the default random generator (and the accelerator's) for the
recomputation, so dropout, including the tensor-parallel streams of
:mod:`kolossos.nn.layer.parallel_1d.random` that derive from it, draws the same masks twice.

Example:
    >>> import torch
    >>> from kolossos.utils import checkpoint
    >>> layer = torch.nn.Linear(4, 4)
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> y = checkpoint(layer, False, x)  # same value as layer(x)
    >>> torch.equal(y, layer(x))
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

__all__ = ["checkpoint"]


def _on_accelerator(args: tuple[Any, ...]) -> bool:
    return any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)


def checkpoint(
    function: Callable[..., Any],
    activation_offload: bool,
    *args: Any,
    use_reentrant: bool = False,
) -> Any:
    """Run ``function(*args)`` without keeping its activations; recompute them in backward.

    Args:
        function: the block to run (a module or any callable of tensors).
        activation_offload: keep the saved inputs in host memory until backward (a no-op for
            tensors already on the CPU).
        *args: positional arguments of ``function``.
        use_reentrant: use PyTorch's reentrant implementation (kolossos' addition). The
            offload path always uses it: it saves the inputs through ``save_for_backward``, where
            :func:`torch.autograd.graph.save_on_cpu` can move them.

    Returns:
        What ``function(*args)`` returns.

    Raises:
        TypeError: ``function`` is not callable or ``activation_offload`` is not a bool (the
            documented argument order is ``checkpoint(function, activation_offload, *args)``).

    Example:
        >>> block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU())
        >>> out = checkpoint(block, False, torch.randn(3, 4))
        >>> tuple(out.shape)
        (3, 8)
    """
    if not callable(function):
        raise TypeError(
            f"checkpoint: function (a {type(function).__name__}) is not callable; the order is "
            "checkpoint(function, activation_offload, *args)."
        )
    if not isinstance(activation_offload, bool):
        raise TypeError(
            f"checkpoint: activation_offload must be True or False, got a "
            f"{type(activation_offload).__name__}; the order is checkpoint(function, "
            "activation_offload, *args)."
        )
    offload = activation_offload and _on_accelerator(args)
    context: contextlib.AbstractContextManager[Any] = (
        torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else contextlib.nullcontext()
    )
    with context:
        return torch_checkpoint.checkpoint(
            function, *args, use_reentrant=use_reentrant or offload, preserve_rng_state=True
        )
