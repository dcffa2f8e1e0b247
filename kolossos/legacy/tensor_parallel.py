"""Tensor-parallel settings of the legacy, config-driven layers (``kolossos.nn.Linear`` ...).

Colossal-AI's legacy API reads ``parallel.tensor`` from the config given to ``launch``::

    CONFIG = dict(parallel=dict(data=1, pipeline=1, tensor=dict(size=2, mode="1d")))

Ranks are laid out as in Colossal-AI's legacy context: the tensor-parallel groups are blocks of
``size`` consecutive ranks (tensor innermost, then data, then pipeline). A module-level *parallel
input* flag makes consecutive ``Linear`` layers alternate column- then row-parallel, as
Colossal-AI's environment does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from kolossos.initialize import get_launch_config
from kolossos.train.config_files import read_config_file  # until the legacy Config owns them

__all__ = [
    "TensorParallelSettings",
    "get_parallel_input",
    "get_tensor_parallel_group",
    "read_tensor_parallel_settings",
    "set_parallel_input",
]

TP_MODES = ("1d", "2d", "2.5d", "3d")
_parallel_input = False
_groups: dict[tuple[Any, ...], ProcessGroup] = {}


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


def _launch_mapping() -> Mapping[str, Any]:
    config = get_launch_config()
    if config is None:
        return {}
    if isinstance(config, Path):
        # The legacy Colossal-AI config is a Python file with module-level names.
        return read_config_file(config)
    return config


def read_tensor_parallel_settings(
    config: Mapping[str, Any] | None = None,
) -> TensorParallelSettings:
    """Parse ``config["parallel"]`` (default: the config of the last ``kolossos.launch``).

    The data-parallel size defaults to ``world_size // (pipeline * tensor)``.

    Raises:
        ValueError: malformed sizes, or sizes whose product is not the world size.
    """
    raw = _launch_mapping() if config is None else config
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
    """This rank's tensor-parallel group: its block of ``tensor_size`` consecutive ranks (the
    world group when ``tensor_size`` is the world size).

    COLLECTIVE over the world the first time (every group is created on every rank, in order).
    """
    world = dist.get_world_size()
    if settings.tensor_size == world:
        assert dist.group.WORLD is not None
        return dist.group.WORLD
    key = (id(dist.group.WORLD), world, settings.tensor_size)
    if key not in _groups:
        mine = dist.get_rank() // settings.tensor_size
        for index in range(world // settings.tensor_size):
            ranks = list(range(index * settings.tensor_size, (index + 1) * settings.tensor_size))
            group = dist.new_group(ranks)  # SYNC POINT: every rank creates every group
            if index == mine:
                _groups[key] = group
    return _groups[key]


def get_parallel_input() -> bool:
    """Whether the next legacy ``Linear`` receives an input split over the tensor group."""
    return _parallel_input


def set_parallel_input(value: bool) -> None:
    """Set the flag :func:`get_parallel_input` reads (column layers set it, row layers clear
    it)."""
    global _parallel_input
    _parallel_input = bool(value)
