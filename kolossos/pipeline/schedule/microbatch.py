"""Splitting a batch into micro-batches, feeding them to the first stage and the loss, and
merging the last stage's outputs back.

Batch conventions (the docs'): a ``(data, label)`` pair (``data`` a tensor, a tuple of tensors or
a dict of keyword arguments; the loss is ``criterion(output, label)``), or a dict of keyword
arguments / a single tensor (the loss is ``criterion(output, micro_batch)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def batch_size_of(batch: Any) -> int:
    """The leading dimension of the first tensor in ``batch``.

    Raises:
        TypeError: no tensor in the batch.
    """
    if isinstance(batch, torch.Tensor) and batch.dim() > 0:
        return int(batch.shape[0])
    items = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(items, (list, tuple)) or isinstance(batch, Mapping):
        for item in items:
            try:
                return batch_size_of(item)
            except TypeError:
                continue
    raise TypeError(f"cannot find a batch dimension in a {type(batch).__name__}; pass tensors.")


def _split(value: Any, size: int, parts: int) -> list[Any]:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == size:
        return list(torch.tensor_split(value, parts, dim=0))
    if isinstance(value, Mapping):
        split = {k: _split(v, size, parts) for k, v in value.items()}
        return [{k: v[i] for k, v in split.items()} for i in range(parts)]
    if isinstance(value, (list, tuple)):
        columns = [_split(v, size, parts) for v in value]
        return [type(value)(col[i] for col in columns) for i in range(parts)]
    return [value] * parts  # scalars and non-batch tensors go to every micro-batch


def split_batch(batch: Any, num_microbatches: int | None, microbatch_size: int | None) -> list[Any]:
    """``batch`` cut along its leading dimension into equal micro-batches.

    Raises:
        ValueError: the batch does not split evenly (the mean of the micro-batch losses would
            then differ from the batch loss).
    """
    size = batch_size_of(batch)
    if num_microbatches is None:
        assert microbatch_size is not None
        if size % microbatch_size:
            raise ValueError(
                f"a batch of {size} does not split into micro-batches of {microbatch_size}; "
                "choose a batch size that is a multiple of microbatch_size."
            )
        num_microbatches = size // microbatch_size
    if size % num_microbatches:
        raise ValueError(
            f"a batch of {size} does not split into {num_microbatches} equal micro-batches; "
            "choose a batch size that is a multiple of num_microbatches."
        )
    return _split(batch, size, num_microbatches)


def first_stage_call(micro_batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional and keyword arguments of the first stage for one micro-batch."""
    data = micro_batch[0] if _is_pair(micro_batch) else micro_batch
    if isinstance(data, Mapping):
        return (), dict(data)
    if isinstance(data, (list, tuple)):
        return tuple(data), {}
    return (data,), {}


def loss_target(micro_batch: Any) -> Any:
    """What the criterion receives beside the output: the label of a pair, else the batch."""
    return micro_batch[1] if _is_pair(micro_batch) else micro_batch


def _is_pair(micro_batch: Any) -> bool:
    return isinstance(micro_batch, (list, tuple)) and len(micro_batch) == 2


def merge_outputs(outputs: list[Any]) -> Any:
    """The last stage's per-micro-batch outputs joined along the batch dimension."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs, dim=0) if first.dim() > 0 else torch.stack(outputs)
    if isinstance(first, Mapping):
        return {k: merge_outputs([o[k] for o in outputs]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(merge_outputs(list(col)) for col in zip(*outputs, strict=True))
    return outputs


def detach_all(value: Any) -> Any:
    """A copy of ``value`` with every tensor detached."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, Mapping):
        return {k: detach_all(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(detach_all(v) for v in value)
    return value
