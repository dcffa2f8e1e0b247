"""The record of a lazily built model: every operator that created or changed its tensors, in order.

A lazily built tensor is a meta tensor whose storage carries a :class:`LazyStorage` pointing into
one :class:`Tape`. The tape holds :class:`TapeOp` entries: the aten operator, its arguments with
every lazy tensor replaced by a :class:`TensorRef` (a storage key plus the view's geometry), which
storages it reads and writes, and — for random operators — which generator it drew from.
Replaying the tape on real tensors (``kolossos.lazy.replay``) computes what eager execution did.

Random generators are snapshotted as the ops are recorded (recording on the meta device draws
nothing, so a snapshot only changes when the program reseeds): the replay restores each snapshot
before the op that follows it, and so draws the same numbers as the eager build, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LAZY_ATTR", "LazyStorage", "Tape", "TapeOp", "TensorRef", "lazy_storage", "ref_of"]

LAZY_ATTR = "_kolossos_lazy"
"""Attribute set on the (meta) ``UntypedStorage`` of every lazily built tensor. Python storage
objects persist with their storage, so every view, ``.data`` alias and ``Parameter`` sees it."""


@dataclass(frozen=True)
class LazyStorage:
    """What a lazy storage is: the tape that can compute it and its key there."""

    tape: Tape
    """The tape whose ops define the storage's contents."""
    key: int
    """The storage's number in the tape."""


@dataclass(frozen=True)
class TensorRef:
    """A tensor as a view of a lazy storage: enough to rebuild it on the real storage."""

    key: int
    """The storage's key in the tape."""
    size: tuple[int, ...]
    """The view's shape."""
    stride: tuple[int, ...]
    """The view's strides (elements)."""
    offset: int
    """The view's storage offset (elements)."""
    dtype: torch.dtype
    """The view's element type."""

    def covers(self, nbytes: int) -> bool:
        """Whether the view is dense over the whole storage of ``nbytes`` (writing it all
        leaves nothing of the old contents)."""
        numel = 1
        for s in self.size:
            numel *= s
        itemsize = torch.empty((), dtype=self.dtype, device="meta").element_size()
        if self.offset != 0 or numel * itemsize != nbytes:
            return False
        expected = 1
        for size, stride in reversed(list(zip(self.size, self.stride, strict=True))):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


@dataclass
class TapeOp:
    """One recorded operator call."""

    func: Any
    """The aten overload (``torch._ops.OpOverload``)."""
    args: tuple[Any, ...]
    """Positional arguments, lazy tensors as :class:`TensorRef`."""
    kwargs: dict[str, Any]
    """Keyword arguments, lazy tensors as :class:`TensorRef`; ``device`` is the real device."""
    creates: list[tuple[Any, TensorRef]]
    """Outputs that are new storages: ``(pytree path, ref)`` pairs."""
    reads: frozenset[int]
    """Keys of the storages whose contents the op reads."""
    writes: frozenset[int]
    """Keys of the storages the op changes in place."""
    overwrites: frozenset[int]
    """Written keys whose old contents do not matter (a full-storage fill, draw or copy)."""
    generator: int | None = None
    """Index of the recorded generator the op draws from (random ops only)."""
    explicit_generator: bool = False
    """Whether the program passed ``generator=`` (else the op drew from the default one)."""
    reseed: torch.Tensor | None = None
    """A generator state to restore before the op (the program reseeded since the last draw)."""


@dataclass
class Tape:
    """The ops that build the lazy storages of one :class:`~kolossos.lazy.LazyInitContext`."""

    ops: list[TapeOp] = field(default_factory=list)
    """The recorded operator calls, in program order."""
    nbytes: dict[int, int] = field(default_factory=dict)
    """Size of each storage in bytes."""
    devices: dict[int, torch.device] = field(default_factory=dict)
    """The real device of each storage."""
    generators: list[tuple[torch.device, torch.Tensor]] = field(default_factory=list)
    """Per recorded generator: its device and its state when first used."""
    generator_ids: dict[int, int] = field(default_factory=dict)
    """``id`` of a live generator object -> its index in :attr:`generators`."""
    last_state: dict[int, torch.Tensor] = field(default_factory=dict)
    """Generator index -> the state snapshotted at its last draw."""

    def new_key(self, nbytes: int, device: torch.device) -> int:
        """Register a new storage and return its key."""
        key = len(self.nbytes)
        self.nbytes[key] = nbytes
        self.devices[key] = device
        return key

    def note_generator(self, generator: torch.Generator) -> tuple[int, torch.Tensor | None]:
        """The index of ``generator`` and, when its state changed since its last draw (a reseed),
        the state to restore before this draw."""
        state = generator.get_state()
        index = self.generator_ids.get(id(generator))
        if index is None:
            index = len(self.generators)
            self.generator_ids[id(generator)] = index
            self.generators.append((generator.device, state))
            self.last_state[index] = state
            return index, None
        if torch.equal(self.last_state[index], state):
            return index, None
        self.last_state[index] = state
        return index, state

    def __iter__(self) -> Iterator[TapeOp]:
        return iter(self.ops)


def lazy_storage(tensor: torch.Tensor) -> LazyStorage | None:
    """The :class:`LazyStorage` of ``tensor``, or ``None`` for an ordinary tensor."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
        return None
    try:
        record = getattr(tensor.untyped_storage(), LAZY_ATTR, None)
    except (NotImplementedError, RuntimeError):  # tensor subclasses without a storage
        return None
    return record if isinstance(record, LazyStorage) else None


def ref_of(tensor: torch.Tensor, key: int) -> TensorRef:
    """``tensor`` (a view of storage ``key``) as a :class:`TensorRef`."""
    return TensorRef(
        key=key,
        size=tuple(tensor.shape),
        stride=tuple(tensor.stride()),
        offset=int(tensor.storage_offset()),
        dtype=tensor.dtype,
    )
