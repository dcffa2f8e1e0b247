"""User weight initializers on tensor-parallel shards (Colossal-AI's ``weight_initializer`` /
``bias_initializer`` keywords).

An initializer is a callable in the style of Colossal-AI's ``colossalai.nn.init``:
``initializer(tensor, fan_in=..., fan_out=...)`` fills ``tensor`` in place (bias initializers are
called with ``fan_in`` only). The fans are those of the *full* layer, the tensor is this rank's
shard. Sharded tensors are drawn on the group's per-rank random stream (independent shards, as
Colossal-AI's per-rank seed offset gives), replicated ones on the replicated stream (the same
values on every rank, so no broadcast is needed). Both streams derive from the default generator
(see :mod:`kolossos.nn.layer.parallel_1d.random`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_1d.random import ensure_tp_rng_states, get_tp_rng_tracker

__all__ = ["Initializer", "apply_initializer", "check_initializers"]

Initializer = Callable[..., Any]
"""``initializer(tensor, fan_in=..., fan_out=...)``, filling ``tensor`` in place."""


def check_initializers(owner: str, weight_given: bool, **initializers: Initializer | None) -> None:
    """Validate initializer keywords before anything is built.

    Raises:
        TypeError: an initializer is not callable.
        ValueError: an initializer was given together with the weights it would initialise.
    """
    for name, initializer in initializers.items():
        if initializer is None:
            continue
        if not callable(initializer):
            raise TypeError(
                f"{owner}: {name}={initializer!r} must be a callable "
                "initializer(tensor, fan_in=..., fan_out=...), or None."
            )
        if weight_given:
            raise ValueError(
                f"{owner}: {name} only applies when the layer creates its own weights; it was "
                "given together with weight=... (e.g. by from_native_module), which keeps the "
                f"given values. Drop {name} or the weights."
            )


def apply_initializer(
    tensor: torch.Tensor,
    initializer: Initializer,
    group: ProcessGroup,
    *,
    sharded: bool,
    fan_in: int,
    fan_out: int | None = None,
) -> None:
    """Fill ``tensor`` (this rank's shard, or a replicated tensor) with ``initializer``.

    Args:
        tensor: the local tensor to fill in place.
        initializer: ``initializer(tensor, fan_in=..., fan_out=...)``.
        group: the tensor-parallel group (selects its random streams).
        sharded: ``True``: draw on the per-rank stream; ``False``: the same values on every rank.
        fan_in: the full layer's fan-in.
        fan_out: the full layer's fan-out; ``None`` calls ``initializer(tensor, fan_in=...)``
            (Colossal-AI's convention for biases).
    """
    names = ensure_tp_rng_states(group)
    stream = names.parallel if sharded else names.replicated
    fans: dict[str, int] = {"fan_in": fan_in}
    if fan_out is not None:
        fans["fan_out"] = fan_out
    with torch.no_grad(), get_tp_rng_tracker().fork(stream):
        initializer(tensor, **fans)
