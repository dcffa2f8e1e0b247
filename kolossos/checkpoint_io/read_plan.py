"""Read only what a rank keeps: per-tensor selections applied while a checkpoint is read.

A :data:`ReadPlan` maps state-dict names to a :data:`Selector` (read that part of the stored
tensor), or to ``None`` (this rank keeps nothing of it: not read at all); names it does not list
are read whole. Safetensors files are read through ``get_slice``, so a selected part costs its own
bytes only; torch files (no random access) are memory-mapped and the selection is applied to the
mapped tensor. Engines say what they keep (``CheckpointIO.model_read_plan``): a pipeline stage its
own layers, a tensor-parallel rank its slices, a Gemini rank the tensors that touch its chunk
shards — so loading a model sharded N ways reads about 1/N of it on each rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from kolossos.accelerator.memory_tracker import active_tracker
from kolossos.checkpoint_io.backends import (
    SAFETENSORS,
    read_tensor_file,
    safe_open_file,
    sniff_format,
)
from kolossos.checkpoint_io.errors import CheckpointError

__all__ = [
    "ReadPlan",
    "Selector",
    "SliceSource",
    "TensorSource",
    "narrow_selector",
    "read_selected",
]


class SliceSource(Protocol):
    """A stored tensor that can be read in parts (safetensors' ``PySafeSlice``)."""

    def get_shape(self) -> list[int]:
        """The stored shape."""
        ...

    def __getitem__(self, index: Any) -> torch.Tensor:
        """Read the part ``index`` (a tuple of slices) selects."""
        ...


Selector = Callable[[SliceSource], torch.Tensor]
"""Reads the part of a stored tensor that a rank keeps."""
ReadPlan = Mapping[str, Selector | None]
"""Name -> selector, or ``None`` to skip the tensor; unlisted names are read whole."""


class TensorSource:
    """A tensor already in memory (or memory-mapped), as a :class:`SliceSource`."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]


def _index(dim: int, start: int, stop: int) -> tuple[slice, ...]:
    return (*([slice(None)] * dim), slice(start, stop))


def narrow_selector(pieces: Sequence[tuple[int, int, int]], pad: int = 0) -> Selector:
    """A selector reading ``pieces`` (``(dim, start, stop)`` ranges along one dimension,
    concatenated in order along it) and appending ``pad`` zero rows.

    Example:
        >>> read = narrow_selector([(0, 2, 4)])
        >>> read(TensorSource(torch.arange(6).view(6, 1))).flatten().tolist()
        [2, 3]
    """
    dims = {dim for dim, _, _ in pieces}
    if len(dims) > 1:
        raise ValueError(f"narrow_selector: pieces along several dimensions {sorted(dims)}.")

    def select(source: SliceSource) -> torch.Tensor:
        dim = next(iter(dims)) if dims else 0
        parts = [source[_index(dim, start, stop)] for _, start, stop in pieces]
        if not parts:
            parts = [source[_index(dim, 0, 0)]]
        if pad:
            shape = list(parts[0].shape)
            shape[dim] = pad
            parts.append(parts[0].new_zeros(shape))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
        return out.contiguous()

    return select


def read_selected(
    file: Path, names: Iterable[str], plan: ReadPlan | None
) -> dict[str, torch.Tensor]:
    """Read ``names`` from ``file`` following ``plan`` (see the module doc)."""
    plan = plan or {}
    wanted = [n for n in names if not (n in plan and plan[n] is None)]
    selected = {n for n in wanted if plan.get(n) is not None}
    if not selected:
        return _counted(read_tensor_file(file, wanted) if wanted else {})
    if sniff_format(file) != SAFETENSORS:
        whole = read_tensor_file(file, wanted)
        return _counted(
            {n: _apply(plan[n], TensorSource(t)) if n in selected else t for n, t in whole.items()}
        )
    out: dict[str, torch.Tensor] = {}
    with safe_open_file(file) as f:
        present = set(f.keys())
        try:
            for name in wanted:
                if name not in present:
                    continue
                out[name] = (
                    _apply(plan[name], f.get_slice(name))
                    if name in selected
                    else f.get_tensor(name)
                )
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"checkpoint file {str(file)!r} is corrupt: {exc}") from exc
    return _counted(out)


def _counted(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Register what was read with an active CPU memory tracker: safetensors builds sliced
    tensors outside torch's dispatcher, where the tracker would not see them."""
    tracker = active_tracker("cpu")
    if tracker is not None and tensors:
        tracker.track(list(tensors.values()))
    return tensors


def _apply(selector: Selector | None, source: SliceSource) -> torch.Tensor:
    assert selector is not None
    return selector(source)
