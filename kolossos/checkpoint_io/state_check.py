"""Comparing what a checkpoint holds with what a model expects, and tied (shared) tensors.

Tied weights (one tensor under two names, e.g. GPT-2's ``lm_head.weight`` and
``transformer.wte.weight``) are saved once, under the first name in state-dict order, as Hugging
Face does; at load time any name of a tied group satisfies the whole group.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kolossos.checkpoint_io.backends import TensorInfo
from kolossos.checkpoint_io.errors import CheckpointMismatchError, LoadReport

__all__ = ["ModelLayout", "compare_model_state", "finish_report", "unique_tensors"]

_log = logging.getLogger("kolossos.checkpoint_io")


def _storage_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """Identity of the memory a tensor views; ``None`` when it has none (empty, meta, ...)."""
    local = getattr(tensor, "_local_tensor", tensor)  # DTensor: its local shard
    try:
        storage = local.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    # meta tensors (a lazily built model) have no address: the storage object tells aliases
    ptr = storage._cdata if local.is_meta else storage.data_ptr()
    if ptr == 0 or local.numel() == 0:
        return None
    return (
        local.device,
        ptr,
        local.storage_offset(),
        tuple(local.shape),
        local.stride(),
        local.dtype,
    )


def unique_tensors(
    items: Iterable[tuple[str, Any]], aliases: dict[str, str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` pairs, each shared tensor once (under its first name).

    Args:
        items: state-dict items.
        aliases: if given, filled with ``{skipped name: kept name}``.

    Raises:
        TypeError: a value is not a tensor (e.g. a module's non-tensor extra state).
    """
    first: dict[tuple[Any, ...], str] = {}
    for name, value in items:
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"state entry {name!r} is a {type(value).__name__}, not a tensor; model "
                "checkpoints hold tensors only (move extra state into a buffer)."
            )
        key = _storage_key(value)
        if key is not None and key in first:
            if aliases is not None:
                aliases[name] = first[key]
            continue
        if key is not None:
            first[key] = name
        yield name, value


@dataclass(frozen=True)
class ModelLayout:
    """What a model expects to load: global shapes by name, and tied names.

    Attributes:
        shapes: ``name -> global shape`` of every state entry (tied names included).
        aliases: ``{tied name: the name it is saved under}``.
    """

    shapes: dict[str, tuple[int, ...]]
    aliases: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of_state_dict(cls, state_dict: Mapping[str, torch.Tensor]) -> ModelLayout:
        """The layout of a (full, unsharded) state dict."""
        aliases: dict[str, str] = {}
        for _ in unique_tensors(state_dict.items(), aliases):
            pass
        return cls({n: tuple(t.shape) for n, t in state_dict.items()}, aliases)


def compare_model_state(
    layout: ModelLayout, found: Mapping[str, TensorInfo]
) -> tuple[LoadReport, list[str]]:
    """Compare a checkpoint's tensors with a model's layout.

    Returns:
        The report (missing, unexpected, wrongly shaped), and the checkpoint names to load.
    """
    groups: dict[str, list[str]] = {}
    for name in layout.shapes:
        groups.setdefault(layout.aliases.get(name, name), []).append(name)
    missing = [
        canonical for canonical, names in groups.items() if not any(n in found for n in names)
    ]
    unexpected = [n for n in found if n not in layout.shapes]
    mismatched = [
        (n, tuple(info[0]), layout.shapes[n])
        for n, info in found.items()
        if n in layout.shapes and tuple(info[0]) != layout.shapes[n]
    ]
    bad = {n for n, _, _ in mismatched}
    wanted = [n for n in found if n in layout.shapes and n not in bad]
    return LoadReport(tuple(missing), tuple(unexpected), tuple(mismatched)), wanted


def finish_report(report: LoadReport, what: str, path: Any, strict: bool) -> LoadReport:
    """Raise :class:`CheckpointMismatchError` for a strict load with differences, else log them."""
    if report.ok:
        return report
    if strict:
        raise CheckpointMismatchError(what, path, report)
    _log.warning("loading %s checkpoint %r skipped: %s", what, str(path), report.describe())
    return report
