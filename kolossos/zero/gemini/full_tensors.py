"""Full (unsharded) tensors of a Gemini model, gathered chunk by chunk, and loading them back.

Used by checkpoint IO: saving iterates :meth:`FullTensorIO.named_full_tensors`, which all-gathers
one chunk's fp32 masters at a time; loading hands full tensors to
:meth:`FullTensorIO.load_full_tensors`, and each rank keeps its own slice.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn as nn

from kolossos.zero.gemini.chunk import Chunk, ChunkManager, TensorInfo
from kolossos.zero.gemini.chunk.chunk import all_gather_flat

__all__ = ["FullTensorIO", "gather_chunk_vector", "local_range"]


def local_range(chunk: Chunk, info: TensorInfo) -> tuple[int, int] | None:
    """The part of ``info``'s tensor in this rank's shard, as ``(begin, end)`` element offsets
    into the shard; ``None`` when the shard holds none of it."""
    begin = max(info.offset, chunk.shard_begin)
    end = min(info.offset + info.numel, chunk.shard_begin + chunk.shard_size)
    if begin >= end:
        return None
    return begin - chunk.shard_begin, end - chunk.shard_begin


def gather_chunk_vector(chunk: Chunk, shard: torch.Tensor) -> torch.Tensor:
    """All-gather a shard-sized vector of ``chunk`` into a full chunk-sized one (COLLECTIVE;
    on the compute device for the collective, returned there)."""
    src = shard.to(chunk.compute_device)
    if chunk.world_size == 1:
        return src.clone()
    full = torch.empty(chunk.chunk_size, dtype=src.dtype, device=chunk.compute_device)
    all_gather_flat(full, src, group=chunk.group)
    return full


class FullTensorIO:
    """Full tensors of ``module``'s parameters (from ``manager``'s chunks) and buffers."""

    def __init__(self, module: nn.Module, manager: ChunkManager) -> None:
        self.module = module
        self.manager = manager
        first: dict[nn.Parameter, str] = {}
        self._aliases: dict[str, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if p in first:
                self._aliases[name] = first[p]
            else:
                first[p] = name
        self._by_name = {name: p for p, name in first.items()}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            info = manager.locate(p)[1]
            self._shapes[name] = tuple(info.shape)
        self._buffer_names = [name for name, _ in _persistent_buffers(module)]
        for name, buf in _persistent_buffers(module):
            self._shapes[name] = tuple(buf.shape)

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Global shapes of every state-dict entry (tied aliases included)."""
        return dict(self._shapes)

    def tied_aliases(self) -> dict[str, str]:
        """``{alias: first name}`` of tied parameters."""
        return dict(self._aliases)

    def names_not_held(self) -> list[str]:
        """State-dict names (tied aliases included) of the parameters of which this rank holds
        nothing: outside its shard of a chunk that is not kept gathered. Loading skips them."""
        skip = set()
        for name, param in self._by_name.items():
            chunk, info = self.manager.locate(param)
            if chunk.payload is None and local_range(chunk, info) is None:
                skip.add(name)
        return sorted(skip | {a for a, kept in self._aliases.items() if kept in skip})

    def named_full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameters chunk by chunk (fp32, COLLECTIVE), then buffers."""
        for chunk in self.manager:
            assert chunk.master is not None
            full = gather_chunk_vector(chunk, chunk.master)
            for info in chunk.tensors:
                yield info.name, full[info.offset : info.offset + info.numel].view(info.shape)
            del full
        yield from _persistent_buffers(self.module)

    def load_full_tensors(self, items: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Each rank copies its slice of each named full tensor (not collective)."""
        consumed: set[str] = set()
        for name, value in items:
            key = self._aliases.get(name, name)
            if key in self._by_name:
                self._load_param(name, self._by_name[key], value)
            elif key in self._buffer_names:
                buffer = self.module.get_buffer(key)
                _check_shape(name, tuple(buffer.shape), value)
                with torch.no_grad():
                    buffer.copy_(value)
            else:
                continue
            consumed.add(name)
        return consumed

    def _load_param(self, name: str, param: nn.Parameter, value: torch.Tensor) -> None:
        chunk, info = self.manager.locate(param)
        _check_shape(name, tuple(info.shape), value)
        assert chunk.master is not None
        flat = value.detach().reshape(-1)
        with torch.no_grad():
            span = local_range(chunk, info)
            if span is not None:
                begin, end = span
                offset = chunk.shard_begin + begin - info.offset
                chunk.master[begin:end].copy_(flat[offset : offset + end - begin])
            if chunk.payload is not None:  # gathered (kept or in use): the full copy too
                chunk.payload[info.offset : info.offset + info.numel].copy_(flat)
            if not chunk.keep_gathered:
                chunk.shard = None  # re-made from the master on the next gather


def _check_shape(name: str, shape: tuple[int, ...], value: torch.Tensor) -> None:
    if tuple(value.shape) != shape:
        raise ValueError(
            f"{name}: the loaded tensor has shape {tuple(value.shape)} but the model's is "
            f"{shape}; load a checkpoint of the same model configuration."
        )


def _persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for mod_name, sub in module.named_modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf
