"""The rules of the ``parallel`` config key (CHECKLIST §3.3), checked without a process group.

``parallel = dict(data=..., pipeline=2 | dict(size=2), tensor=dict(size=4, mode="2d"))``:
everything is optional, sizes default to 1, the data-parallel size is inferred as
``world_size // (pipeline * tensor)``, and a tensor size above 1 needs a mode whose size rule
holds (2D: q², 2.5D: q²·depth, 3D: q³). ``moe=dict(size=E)`` spreads each MoE layer's experts
over ``E`` consecutive data-parallel ranks (it must divide the data-parallel size; MoE is
incompatible with tensor parallelism, as documented, and not built with pipeline stages).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kolossos.legacy.constants import INITIALIZER_MAPPING

__all__ = ["ParallelLayout", "parse_parallel", "tensor_modes"]

#: mapping keys that name group kinds, not tensor modes
_NOT_TENSOR_MODES = {"data", "tensor", "pipeline", "model", "embedding", "moe"}
_BUILTIN_KWARGS = {"1d": (), "2d": (), "2.5d": ("depth",), "3d": (), "sequence": ()}


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """The checked ``parallel`` section for one world size."""

    world_size: int
    """Number of processes."""
    data_size: int = 1
    """Data-parallel size (inferred)."""
    pipeline_size: int = 1
    """Pipeline stages."""
    tensor_size: int = 1
    """Ranks per tensor-parallel group."""
    tensor_mode: str | None = None
    """``"1d"``, ``"2d"``, ``"2.5d"``, ``"3d"``, ``"sequence"``, a mode added to
    ``INITIALIZER_MAPPING``, or ``None``."""
    tensor_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """The other keys of ``parallel.tensor`` (``depth`` for 2.5D; anything for a user mode),
    forwarded to the mode's initializer."""
    moe_size: int | None = None
    """``parallel.moe.size``: the expert-parallel size (``None``: no MoE groups)."""

    def __post_init__(self) -> None:
        product = self.data_size * self.pipeline_size * self.tensor_size
        if product != self.world_size:
            raise ValueError(
                f"parallel config: data ({self.data_size}) x pipeline ({self.pipeline_size}) x "
                f"tensor ({self.tensor_size}) = {product} must equal the world size "
                f"{self.world_size}."
            )


def tensor_modes() -> list[str]:
    """The accepted tensor modes: the built-in ones and any added to ``INITIALIZER_MAPPING``."""
    return [m for m in INITIALIZER_MAPPING if m not in _NOT_TENSOR_MODES]


def _size(value: Any, name: str) -> int:
    if isinstance(value, Mapping):
        extra = set(value) - {"size"}
        if extra:
            raise ValueError(
                f"parallel config: {name}={dict(value)!r} has unknown keys {sorted(extra)}; "
                f"only size is read (write {name}=dict(size=N) or {name}=N)."
            )
        value = value.get("size", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"parallel config: {name} size {value!r} must be a positive int (write {name}=N or "
            f"{name}=dict(size=N))."
        )
    return value


def _tensor(raw: Any) -> tuple[int, str | None, dict[str, Any]]:
    if isinstance(raw, bool) or not isinstance(raw, (int, Mapping)):
        raise ValueError(
            f"parallel config: tensor={raw!r} must be dict(size=N, mode='1d'|'2d'|'2.5d'|'3d'|"
            "'sequence')."
        )
    if isinstance(raw, int):
        if raw != 1:
            raise ValueError(
                f"parallel config: tensor={raw} has no mode; tensor parallelism needs "
                f"dict(size={raw}, mode=...), with mode one of {tensor_modes()}."
            )
        return 1, None, {}
    rest = dict(raw)
    mode = rest.pop("mode", None)
    size = _size(rest.pop("size", 1), "tensor")
    if mode is None:
        if size != 1 or rest:
            raise ValueError(
                f"parallel config: tensor={dict(raw)!r} has no mode; add mode=... (one of "
                f"{tensor_modes()})."
            )
        return 1, None, {}
    if not isinstance(mode, str) or mode.lower() not in tensor_modes():
        raise ValueError(
            f"parallel config: tensor mode={mode!r} is unknown; use one of {tensor_modes()}, "
            "or register an initializer and add it to INITIALIZER_MAPPING."
        )
    return size, mode.lower(), rest


def _check_mode(size: int, mode: str, kwargs: dict[str, Any]) -> None:
    allowed = _BUILTIN_KWARGS.get(mode)
    if allowed is None:
        return  # a user mode: its initializer receives (and checks) the extra keys
    extra = sorted(set(kwargs) - set(allowed))
    if extra:
        raise ValueError(
            f"parallel config: tensor mode {mode!r} takes no keys {extra}"
            + (" (depth is for mode='2.5d')." if "depth" in extra else ".")
        )
    if mode == "2d" and math.isqrt(size) ** 2 != size:
        raise ValueError(
            f"parallel config: 2D tensor parallelism needs a square size (q*q), got "
            f"size={size}; use 4, 9, 16, ..."
        )
    if mode == "2.5d":
        depth = kwargs.get("depth")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(
                f"parallel config: 2.5D tensor parallelism needs depth=d (a positive int) with "
                f"size = q*q*d, got depth={depth!r}; e.g. tensor=dict(size=8, mode='2.5d', "
                "depth=2)."
            )
        q = math.isqrt(size // depth)
        if size % depth or q * q * depth != size:
            raise ValueError(
                f"parallel config: 2.5D tensor parallelism needs size = q*q*depth; size={size} "
                f"with depth={depth} is not (e.g. size=8, depth=2 or size=4, depth=1)."
            )
    if mode == "3d":
        q = round(size ** (1 / 3))
        if q**3 != size:
            raise ValueError(
                f"parallel config: 3D tensor parallelism needs a cube size (q*q*q), got "
                f"size={size}; use 8, 27, 64, ..."
            )


def parse_parallel(parallel: Any, world_size: int) -> ParallelLayout:
    """Check ``config["parallel"]`` against ``world_size`` and infer the data-parallel size.

    Args:
        parallel: the ``parallel`` value of a config (``None``: nothing is parallel but data).
        world_size: the number of processes.

    Raises:
        ValueError: any broken rule, naming the value, the rule and the fix.
        NotImplementedError: ``parallel.moe`` with tensor or pipeline parallelism.

    Example:
        >>> parse_parallel(dict(pipeline=2, tensor=dict(size=2, mode="1d")), 8).data_size
        2
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size {world_size!r} must be a positive int.")
    if parallel is None:
        return ParallelLayout(world_size=world_size, data_size=world_size)
    if not isinstance(parallel, Mapping):
        raise ValueError(
            f"parallel config: parallel={parallel!r} must be a dict, e.g. "
            "dict(pipeline=2, tensor=dict(size=2, mode='1d'))."
        )
    unknown = sorted(set(parallel) - {"data", "pipeline", "tensor", "moe"})
    if unknown:
        raise ValueError(
            f"parallel config: unknown keys {unknown}; parallel takes data, pipeline, tensor "
            "and moe."
        )
    pipeline = _size(parallel.get("pipeline", 1), "pipeline")
    tensor, mode, kwargs = _tensor(parallel.get("tensor", 1))
    if mode is not None:
        _check_mode(tensor, mode, kwargs)
    if world_size % (pipeline * tensor):
        raise ValueError(
            f"parallel config: pipeline ({pipeline}) x tensor ({tensor}) = {pipeline * tensor} "
            f"does not divide the world size {world_size}; launch a multiple of "
            f"{pipeline * tensor} processes or shrink the sizes."
        )
    data = world_size // (pipeline * tensor)
    if "data" in parallel and _size(parallel["data"], "data") != data:
        raise ValueError(
            f"parallel config: data={parallel['data']!r} but world size {world_size} / "
            f"(pipeline {pipeline} x tensor {tensor}) = {data}; the data size is inferred, so "
            "drop it or fix it."
        )
    moe = _moe_size(parallel["moe"], data, pipeline, tensor) if "moe" in parallel else None
    return ParallelLayout(
        world_size=world_size,
        data_size=data,
        pipeline_size=pipeline,
        tensor_size=tensor,
        tensor_mode=mode,
        tensor_kwargs=kwargs,
        moe_size=moe,
    )


def _moe_size(raw: Any, data: int, pipeline: int, tensor: int) -> int:
    """``parallel.moe``'s size, checked against the other sizes."""
    size = _size(raw, "moe")
    if tensor > 1 or pipeline > 1:
        raise NotImplementedError(
            f"parallel config: moe (size {size}) with tensor size {tensor} and pipeline size "
            f"{pipeline}: MoE is incompatible with tensor parallelism (as documented) and "
            "kolossos' legacy context does not build it with pipeline stages; drop "
            "parallel.tensor and parallel.pipeline."
        )
    if data % size:
        raise ValueError(
            f"parallel config: moe size {size} must divide the data-parallel size {data} "
            f"(consecutive ranks form an expert-parallel group); launch a multiple of {size} "
            "processes or change moe=dict(size=...)."
        )
    return size
