"""Colossal-AI's batch helpers (``colossalai.pipeline.schedule._utils``): the batch size of a
batch, a micro-batch cut out of it, micro-batch outputs merged back, and small tensor helpers.

A batch is a tensor or any nesting of lists, tuples (named ones too), dicts and
``ModelOutput``-like mappings with tensors and other values as leaves. kolossos' own schedules
cut batches with :mod:`kolossos.pipeline.schedule.microbatch`; these are for scripts written
against upstream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.nn import Module

__all__ = [
    "detach",
    "get_batch_size",
    "get_micro_batch",
    "merge_batch",
    "model_forward",
    "retain_grad",
    "to_device",
]


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, Mapping):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to every leaf, containers rebuilt as their own type."""
    if isinstance(value, Mapping):
        return _rebuild_mapping(value, {k: _map(fn, v) for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_map(fn, v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map(fn, v) for v in value)
    return fn(value)


def _rebuild_mapping(template: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """A mapping of ``template``'s type holding ``items`` (a ``ModelOutput`` takes keywords; a
    type that cannot be rebuilt gives a plain ``dict``)."""
    kind = type(template)
    if kind is dict:
        return items
    try:
        if all(isinstance(k, str) for k in items):
            return kind(**items)
        return kind(items)  # type: ignore[call-arg]
    except TypeError:
        return dict(items)


def get_batch_size(batch: Any) -> int:
    """The size of dimension 0 of the first tensor of ``batch`` (depth first, in order).

    Raises:
        RuntimeError: ``batch`` holds no tensor with a dimension.

    Example:
        >>> get_batch_size({"ids": [1], "x": torch.zeros(4, 2)})
        4
    """
    for leaf in _leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.size(0))
    raise RuntimeError(
        f"no tensor with a batch dimension in the batch ({type(batch).__name__}); put the "
        "samples in tensors whose dimension 0 is the batch."
    )


def get_micro_batch(batch: Any, start: int, micro_batch_size: int) -> Any:
    """Samples ``start`` to ``start + micro_batch_size`` of every tensor in ``batch`` (along
    dimension 0); other leaves, and 0-d tensors, are kept as they are.

    Example:
        >>> get_micro_batch([torch.arange(4), "tag"], 2, 2)
        [tensor([2, 3]), 'tag']
    """

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf[start : start + micro_batch_size]
        return leaf

    return _map(cut, batch)


def merge_batch(data: list[Any], batch_size_dim: int = 0) -> Any:
    """Micro-batches (of the same structure) joined into one batch: tensors concatenated along
    ``batch_size_dim``, 0-d tensors (per-micro-batch losses) dropped to ``None``, other leaves
    collected in a list; containers keep their type.

    Returns:
        The merged batch; ``None`` for an empty list.

    Example:
        >>> merge_batch([{"x": torch.zeros(1, 2)}, {"x": torch.ones(1, 2)}])["x"].shape
        torch.Size([2, 2])
    """
    if not data:
        return None
    return _merge(data, batch_size_dim)


def _merge(items: list[Any], dim: int) -> Any:
    first = items[0]
    if isinstance(first, torch.Tensor):
        return None if first.dim() == 0 else torch.cat(items, dim=dim)
    if isinstance(first, Mapping):
        merged = {k: _merge([item[k] for item in items], dim) for k in first}
        return _rebuild_mapping(first, merged)
    if isinstance(first, (list, tuple)):
        columns = [_merge(list(col), dim) for col in zip(*items, strict=True)]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*columns)
        return type(first)(columns)
    return list(items)


def to_device(x: Any, device: torch.device | None = None) -> Any:
    """``x`` moved to ``device`` if it is a tensor, else ``x``."""
    return x.to(device) if isinstance(x, torch.Tensor) else x


def model_forward(model: Module, data: Any, internal_inputs: dict[str, Any] | None) -> Any:
    """``model`` called with ``data`` (a list/tuple: positional arguments; a dict: keyword
    arguments; anything else: one argument) plus the previous stage's ``internal_inputs`` as
    keyword arguments."""
    extra = internal_inputs or {}
    if isinstance(data, (list, tuple)):
        return model(*data, **extra)
    if isinstance(data, dict):
        return model(**data, **extra)
    return model(data, **extra)


def retain_grad(x: Any) -> None:
    """Keep the gradient of ``x`` after backward, if it is a tensor that requires one."""
    if isinstance(x, torch.Tensor) and x.requires_grad:
        x.retain_grad()


def detach(x: Any) -> Any:
    """``x.detach()`` for a tensor, else ``x``."""
    return x.detach() if isinstance(x, torch.Tensor) else x
