"""Random state for tensor parallelism: the same dropout mask where activations are replicated
over the tensor-parallel group, different masks where they are sharded.

A :class:`TPRNGTracker` holds named *streams*. ``with tracker.fork(name):`` draws one number from
the default generator, seeds the CPU and accelerator generators from it mixed with the stream's
salt, runs the block, then puts the default generators back (advanced by that one draw only).

Because every mask is derived from the default generator, it is reproduced exactly when
``torch.utils.checkpoint`` re-runs a forward (it restores the default generators), and ranks whose
default generators agree (``kolossos.launch`` seeds every rank alike, and tensor-parallel layers
consume the same random numbers on every rank) draw the same number. The *replicated* stream of a
group uses one salt on every rank, so masks agree; the *parallel* stream salts with the rank, so
masks differ. :func:`default_rng_in_sync` checks the premise.

Example:
    >>> names = ensure_tp_rng_states(group)  # doctest: +SKIP
    >>> with get_tp_rng_tracker().fork(names.parallel):  # doctest: +SKIP
    ...     y = torch.nn.functional.dropout(x_shard, 0.1)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from kolossos.accelerator import get_accelerator

__all__ = [
    "TPRNGStateNames",
    "TPRNGTracker",
    "default_rng_in_sync",
    "ensure_tp_rng_states",
    "get_tp_rng_tracker",
]

_MASK63 = (1 << 63) - 1
_PARALLEL_SALT = 2718  # Megatron's offset for the tensor-parallel stream

_State = tuple[torch.Tensor, torch.Tensor | None]


def _capture() -> _State:
    accelerator = get_accelerator()
    device_state = None if accelerator.name == "cpu" else accelerator.get_rng_state()
    return torch.get_rng_state(), device_state


def _restore(state: _State) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        get_accelerator().set_rng_state(state[1])


def _mix(a: int, b: int) -> int:
    """A 63-bit seed from two integers (a hash, so nearby inputs give unrelated seeds)."""
    digest = hashlib.blake2b(f"{a}:{b}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK63


@dataclass
class _Frame:
    """One active fork: its stream, the number it was seeded from, and how many forks of other
    streams ran inside it."""

    name: str
    draw: int
    nested: int = 0


class TPRNGTracker:
    """Named random streams derived from the default generator (see the module docstring)."""

    def __init__(self) -> None:
        self._salts: dict[str, int] = {}
        self._stack: list[_Frame] = []  # active forks, outermost first

    def __contains__(self, name: object) -> bool:
        return name in self._salts

    def add(self, name: str, salt: int) -> None:
        """Register stream ``name``; streams with equal salts give equal masks.

        Raises:
            ValueError: ``name`` is already registered with another salt.
        """
        if self._salts.get(name, salt) != salt:
            raise ValueError(
                f"RNG stream {name!r} is already registered with salt {self._salts[name]}, not "
                f"{salt}; pick another name."
            )
        self._salts[name] = int(salt)

    @contextmanager
    def fork(self, name: str) -> Iterator[None]:
        """Run the block on stream ``name``.

        Re-entering the active stream (a forked module inside a block forked on the same stream)
        keeps using it. Another stream forked inside a block derives its number from the
        outermost fork's draw and a call counter, never from the (rank-dependent) generator the
        block runs on, so a replicated stream stays identical across ranks even there.

        Raises:
            KeyError: ``name`` is not registered.
        """
        if name not in self._salts:
            raise KeyError(f"RNG stream {name!r} is not registered; known: {sorted(self._salts)}.")
        if any(frame.name == name for frame in self._stack):
            yield
            return
        if self._stack:
            outer = self._stack[0]
            outer.nested += 1
            draw = _mix(outer.draw, outer.nested)
        else:
            draw = int(torch.randint(0, _MASK63, (1,)).item())  # the same on ranks in sync
        saved = _capture()
        seed = _mix(draw, self._salts[name])
        torch.manual_seed(seed)
        get_accelerator().manual_seed(seed)
        self._stack.append(_Frame(name=name, draw=draw))
        try:
            yield
        finally:
            self._stack.pop()
            _restore(saved)

    def get_states(self) -> dict[str, int]:
        """The registered streams and their salts."""
        return dict(self._salts)

    def reset(self) -> None:
        """Forget every stream."""
        self._salts.clear()


_TRACKER = TPRNGTracker()


def get_tp_rng_tracker() -> TPRNGTracker:
    """The process-wide :class:`TPRNGTracker`."""
    return _TRACKER


@dataclass(frozen=True, kw_only=True)
class TPRNGStateNames:
    """Names of a group's two streams in the tracker."""

    replicated: str
    """Same salt on every rank of the group: identical masks on replicated activations."""
    parallel: str
    """Salt offset by the rank: independent masks on sharded activations."""


def ensure_tp_rng_states(group: ProcessGroup, seed: int = 0) -> TPRNGStateNames:
    """Register the replicated and parallel streams of ``group`` unless already there (no
    communication).

    Args:
        group: the tensor-parallel group.
        seed: mixed into both salts (the same value on every rank of the group).
    """
    ranks = dist.get_process_group_ranks(group)
    key = "-".join(str(r) for r in ranks)
    names = TPRNGStateNames(replicated=f"tp-replicated[{key}]", parallel=f"tp-parallel[{key}]")
    tracker = get_tp_rng_tracker()
    rank = dist.get_rank(group)
    tracker.add(names.replicated, _mix(seed, -1))
    tracker.add(names.parallel, _mix(seed + _PARALLEL_SALT, rank))
    return names


def default_rng_in_sync(group: ProcessGroup | None = None) -> bool:
    """Whether every rank of ``group`` has the same default CPU (and accelerator) generator state
    — the premise of identical replicated masks. COLLECTIVE over ``group``."""
    digest = hashlib.sha256()
    for state in _capture():
        if state is not None:
            digest.update(bytes(state.cpu().view(torch.uint8).tolist()))
    value = int.from_bytes(digest.digest()[:7], "little")
    device = get_accelerator().get_current_device()
    mine = torch.tensor([value, -value], dtype=torch.int64, device=device)
    extremes = mine.clone()
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)  # SYNC POINT
    return bool(extremes[0] == value and extremes[1] == -value)
