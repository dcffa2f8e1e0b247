"""Tensor-parallel settings of the legacy, config-driven layers (``kolossos.nn.Linear`` ...).

Colossal-AI's legacy API reads ``parallel.tensor`` from the config given to ``launch``::

    CONFIG = dict(parallel=dict(data=1, pipeline=1, tensor=dict(size=2, mode="1d")))

The settings come from the launch config (``gpc.config``) and the groups from the global context
``gpc`` (tensor innermost: blocks of ``size`` consecutive ranks). A module-level *parallel
input* flag makes consecutive ``Linear`` layers alternate column- then row-parallel, as
Colossal-AI's environment does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from kolossos.legacy.context import ParallelMode
from kolossos.legacy.core import global_context as gpc

__all__ = [
    "TensorParallelSettings",
    "get_parallel_input",
    "get_tensor_parallel_group",
    "read_tensor_parallel_settings",
    "set_parallel_input",
]

TP_MODES = ("1d", "2d", "2.5d", "3d")
_parallel_input = False


@dataclass(frozen=True, kw_only=True)
class TensorParallelSettings:
    """The ``parallel`` section of a launch config, checked against the world size."""

    mode: str | None
    """``"1d"`` (implemented), ``"2d"``, ``"2.5d"``, ``"3d"`` (not yet), or ``None``: no tensor
    parallelism."""
    tensor_size: int
    """Ranks per tensor-parallel group."""
    pipeline_size: int = 1
    """Pipeline stages."""
    data_size: int = 1
    """Data-parallel replicas."""

    def __post_init__(self) -> None:
        for name in ("tensor_size", "pipeline_size", "data_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel config: {name}={value!r} must be a positive integer.")
        if self.mode is not None and self.mode not in TP_MODES:
            raise ValueError(
                f"parallel config: tensor mode={self.mode!r} must be one of {TP_MODES} or None."
            )
        if self.mode is None and self.tensor_size != 1:
            raise ValueError(
                f"parallel config: tensor size={self.tensor_size} needs a mode; add "
                "mode='1d' to parallel.tensor."
            )


def _size(value: Any, name: str) -> int:
    if isinstance(value, Mapping):
        value = value.get("size", 1)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"parallel config: {name}={value!r} must be an int or dict(size=int).")
    return value


def read_tensor_parallel_settings(
    config: Mapping[str, Any] | None = None,
) -> TensorParallelSettings:
    """Parse ``config["parallel"]`` (default: ``gpc.config``, the config of the launch; before
    any launch, no parallelism).

    The data-parallel size defaults to ``world_size // (pipeline * tensor)``.

    Raises:
        ValueError: malformed sizes, or sizes whose product is not the world size.
    """
    if config is None:
        config = gpc.config if dist.is_initialized() else {}
    raw = config
    parallel = raw.get("parallel") or {}
    tensor = parallel.get("tensor") or {}
    if not isinstance(tensor, Mapping):
        raise ValueError(f"parallel config: tensor={tensor!r} must be dict(size=..., mode=...).")
    mode = tensor.get("mode")
    tp = _size(tensor, "tensor")
    pp = _size(parallel.get("pipeline", 1), "pipeline")
    world = dist.get_world_size() if dist.is_initialized() else tp * pp
    if world % (tp * pp):
        raise ValueError(
            f"parallel config: world size {world} is not divisible by pipeline ({pp}) x tensor "
            f"({tp}); launch a multiple of {tp * pp} processes."
        )
    dp = _size(parallel.get("data", world // (tp * pp)), "data")
    if dp * pp * tp != world:
        raise ValueError(
            f"parallel config: data ({dp}) x pipeline ({pp}) x tensor ({tp}) = {dp * pp * tp} "
            f"must equal the world size {world}; fix the sizes or the number of processes."
        )
    return TensorParallelSettings(
        mode=mode,
        tensor_size=tp,
        pipeline_size=pp,
        data_size=dp,
    )


def get_tensor_parallel_group(settings: TensorParallelSettings) -> ProcessGroup:
    """This rank's tensor-parallel group: ``gpc``'s ``ParallelMode.TENSOR`` group (its block of
    ``tensor_size`` consecutive ranks), built by the launch.

    Raises:
        RuntimeError: the launch built no tensor group of ``settings.tensor_size`` ranks (the
            settings do not come from the launch config).
    """
    if settings.tensor_size == dist.get_world_size() and not gpc.is_initialized(
        ParallelMode.TENSOR
    ):
        assert dist.group.WORLD is not None
        return dist.group.WORLD
    if (
        not gpc.is_initialized(ParallelMode.TENSOR)
        or gpc.get_world_size(ParallelMode.TENSOR) != settings.tensor_size
    ):
        raise RuntimeError(
            f"no tensor-parallel group of {settings.tensor_size} ranks was built at launch; give "
            "parallel=dict(tensor=dict(size=..., mode='1d')) to kolossos.launch*(config=...) "
            "before building kolossos.nn layers."
        )
    return gpc.get_group(ParallelMode.TENSOR)


def get_parallel_input() -> bool:
    """Whether the next legacy ``Linear`` receives an input split over the tensor group."""
    return _parallel_input


def set_parallel_input(value: bool) -> None:
    """Set the flag :func:`get_parallel_input` reads (column layers set it, row layers clear
    it)."""
    global _parallel_input
    _parallel_input = bool(value)
