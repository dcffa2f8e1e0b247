"""The placement-policy interface GeminiDDP calls and the residency bookkeeping every policy
shares (:func:`~kolossos.zero.gemini.placement.factory.create_placement_policy` builds a policy).

A chunk's *home* is where its working shard lives between uses: the compute device or the host
(CPU memory). While gathered, its payload is on the compute device whatever the home. GeminiDDP
calls, per rank and without communication:

* :meth:`PlacementPolicy.setup` once the chunks exist: initial homes;
* :meth:`PlacementPolicy.before_compute` right before gathering the chunks of a forward or backward
  compute moment: the policy moves homes (evicting others to the host) so that the device stays
  within its budget;
* :meth:`PlacementPolicy.after_iteration` after the backward pass of every iteration.

When the compute device is the CPU, device and host are the same memory: homes are then pure
bookkeeping (no tensor moves), which keeps the decisions, and the budget they honour, observable
and testable. When they differ (a GPU), every home change is a real
``chunk_manager.move_chunk(chunk, device)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kolossos.accelerator import get_accelerator
from kolossos.zero.gemini.placement.config import PlacementConfig

__all__ = [
    "ChunkLike",
    "ChunkManagerLike",
    "PlacementPolicy",
    "PlacementStats",
]

HOST = torch.device("cpu")


class ChunkLike(Protocol):
    """What a policy reads from a chunk (see ``kolossos.zero.gemini.chunk.chunk.Chunk``)."""

    chunk_id: int
    device_type: str
    keep_gathered: bool

    @property
    def chunk_mem(self) -> int: ...
    @property
    def shard_mem(self) -> int: ...
    @property
    def grad_widening_bytes(self) -> int: ...
    @property
    def holds_grad_shard(self) -> bool: ...
    @property
    def grad_widened(self) -> bool: ...
    @property
    def is_gathered(self) -> bool: ...
    @property
    def can_move(self) -> bool: ...


class ChunkManagerLike(Protocol):
    """What a policy needs from the chunk manager."""

    @property
    def chunks(self) -> Sequence[Any]: ...
    def move_chunk(self, chunk: Any, device: torch.device) -> None: ...


@dataclass(kw_only=True)
class PlacementStats:
    """Counters of the moves a policy made (per rank)."""

    moves_to_device: int = 0
    """Chunks whose home moved host -> device."""
    moves_to_host: int = 0
    """Chunks whose home moved device -> host (evictions and offloads)."""
    bytes_to_device: int = 0
    """Shard bytes moved host -> device."""
    bytes_to_host: int = 0
    """Shard bytes moved device -> host."""
    peak_device_bytes: int = 0
    """Largest device-resident chunk bytes any layout decision left (payloads of the chunks being
    computed included)."""


class PlacementPolicy(ABC):
    """Decides where chunks live; subclasses: ``StaticPlacementPolicy``, ``AutoPlacementPolicy``.

    Args:
        config: validated options.
        device: the compute device (default: the accelerator's current device).
    """

    #: whether the policy measures memory during a warm-up iteration (now)
    need_mem_stats: bool = False

    def __init__(self, config: PlacementConfig, *, device: torch.device | None = None) -> None:
        if device is None:
            device = get_accelerator().get_current_device()
        self.config = config
        self.device = torch.device(device)
        self.stats = PlacementStats()
        self._manager: ChunkManagerLike | None = None
        self._home_on_device: dict[int, bool] = {}
        # Device and host are distinct memories: homes are real tensor moves.
        self._real_moves = self.device.type != HOST.type

    # ------------------------------------------------------------------ interface
    def setup(self, chunk_manager: ChunkManagerLike) -> None:
        """Give every chunk its initial home (per :meth:`home_on_device`); call once."""
        self._manager = chunk_manager
        for chunk in chunk_manager.chunks:
            self._home_on_device[chunk.chunk_id] = chunk.device_type == self.device.type
            if chunk.keep_gathered:
                self._home_on_device[chunk.chunk_id] = True
            elif self.home_on_device(chunk) != self.is_on_device(chunk):
                self._move(chunk, to_device=self.home_on_device(chunk))

    @abstractmethod
    def before_compute(self, chunks: Sequence[Any], step: int) -> None:
        """Make room for, and bring home to the device, the chunks about to be gathered.

        Args:
            chunks: the chunks of this compute moment (a module's forward or backward).
            step: the index of this moment within the iteration: 0 at the first moment of
                every forward pass, counting on through its backward pass.
        """

    def after_iteration(self) -> None:  # noqa: B027  # optional hook, a no-op by default
        """Called by GeminiDDP after each iteration's backward pass."""

    # ------------------------------------------------------------------ static queries
    def home_on_device(self, chunk: ChunkLike) -> bool:
        """Where ``chunk``'s shard lives between uses (True: the device)."""
        return True

    def keep_params_sharded(self, chunk: ChunkLike) -> bool:
        """Whether ``chunk`` is sharded (False: kept gathered on the device on every rank)."""
        return True

    def optim_on_device(self, chunk: ChunkLike) -> bool:
        """Whether ``chunk``'s fp32 master and optimizer states live on the device."""
        return True

    def check_gpu_margin_mem_ratio(self, gpu_margin_mem_ratio: float) -> None:
        """Raise unless this policy can honour ``gpu_margin_mem_ratio`` (only ``auto`` can)."""
        if gpu_margin_mem_ratio != 0.0:
            raise ValueError(
                f"gpu_margin_mem_ratio={gpu_margin_mem_ratio} needs placement_policy='auto' "
                f"(this policy is {self.config.alias or self.config.policy!r}); set it to 0.0."
            )

    def place_optim_states(
        self, state_bytes: Sequence[tuple[Any, int]], gpu_margin_mem_ratio: float
    ) -> list[Any]:
        """Return the chunks whose optimizer states should move to the device now.

        Args:
            state_bytes: ``(chunk, bytes its fp32 master, gradient and optimizer states take)``
                for the chunks whose states are on the host, in the order to consider them.
            gpu_margin_mem_ratio: share of the spare device memory the states may use.

        Returns:
            A prefix of the chunks, whose bytes the policy now reserves on the device; empty
            while the policy cannot tell yet (``auto`` before its warm-up ends).
        """
        self.check_gpu_margin_mem_ratio(gpu_margin_mem_ratio)
        return []

    # ------------------------------------------------------------------ residency
    @property
    def chunk_manager(self) -> ChunkManagerLike:
        """The chunk manager given to :meth:`setup`."""
        return self._require_setup()

    def _require_setup(self) -> ChunkManagerLike:
        if self._manager is None:
            raise RuntimeError("call PlacementPolicy.setup(chunk_manager) first.")
        return self._manager

    def is_on_device(self, chunk: ChunkLike) -> bool:
        """Whether ``chunk``'s home is the compute device now."""
        if self._real_moves:
            return chunk.device_type == self.device.type
        return self._home_on_device.get(chunk.chunk_id, True)

    def chunk_device_bytes(self, chunk: ChunkLike) -> int:
        """Bytes ``chunk`` holds on the device now: payload while gathered, shard if at home
        there (a kept-gathered chunk's shard is a view of its payload)."""
        payload = chunk.chunk_mem if chunk.is_gathered else 0
        if chunk.keep_gathered:
            return max(payload, chunk.chunk_mem)
        return payload + (chunk.shard_mem if self.is_on_device(chunk) else 0)

    def device_resident_bytes(self) -> int:
        """Bytes of chunk data on the compute device now (every chunk)."""
        return sum(self.chunk_device_bytes(c) for c in self.chunk_manager.chunks)

    def _move(self, chunk: Any, *, to_device: bool) -> None:
        """Change ``chunk``'s home; a real ``move_chunk`` when device and host differ."""
        if self._real_moves:
            self.chunk_manager.move_chunk(chunk, self.device if to_device else HOST)
        self._home_on_device[chunk.chunk_id] = to_device
        if to_device:
            self.stats.moves_to_device += 1
            self.stats.bytes_to_device += chunk.shard_mem
        else:
            self.stats.moves_to_host += 1
            self.stats.bytes_to_host += chunk.shard_mem

    def _note_peak(self, device_bytes: int) -> None:
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, device_bytes)

    @staticmethod
    def _ids(chunks: Iterable[ChunkLike]) -> list[int]:
        return [c.chunk_id for c in chunks]
