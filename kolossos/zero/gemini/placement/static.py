"""The ``static`` placement policy: fixed fractions of the chunks sharded and offloaded.

The fractions are shares of the total chunk bytes, applied to whole chunks in chunk (initialisation)
order, rounding to the nearest chunk boundary (ties: fewer chunks):

* ``offload_optim_frac``: the *first* chunks keep their fp32 masters and optimizer states on the
  host (the optimizer steps them there); kept-gathered chunks always step on the device;
* ``offload_param_frac``: the *first* chunks keep their parameter shards on the host between uses;
  they move to the device for each compute moment and back afterwards;
* ``shard_param_frac``: the *last* ``1 - shard_param_frac`` of the chunks stay gathered on the
  device on every rank (no all-gather per use, at the cost of memory).

Nothing depends on measured memory, so the policy needs no warm-up and moves only the offloaded
parameter chunks. The ``cuda`` and ``cpu`` aliases are this policy with fractions 0 and 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kolossos.zero.gemini.placement.base import (
    ChunkLike,
    ChunkManagerLike,
    PlacementPolicy,
    PlacementStats,
)
from kolossos.zero.gemini.placement.config import PlacementConfig

__all__ = ["StaticPlacementPolicy", "fraction_prefix"]


def fraction_prefix(sizes: Sequence[int], fraction: float) -> int:
    """Return how many leading chunks make up ``fraction`` of the total bytes, to the nearest
    chunk boundary (ties: fewer chunks).

    Example:
        >>> fraction_prefix([4, 4, 4, 4], 0.5), fraction_prefix([4, 4, 4, 4], 0.6)
        (2, 2)
        >>> fraction_prefix([10, 1, 1], 0.5), fraction_prefix([10, 1, 1], 1.0)
        (1, 3)
    """
    if fraction <= 0.0:
        return 0
    if fraction >= 1.0:
        return len(sizes)
    target = fraction * sum(sizes)
    best, best_error, running = 0, target, 0
    for count, size in enumerate(sizes, start=1):
        running += size
        error = abs(running - target)
        if error < best_error:
            best, best_error = count, error
    return best


class StaticPlacementPolicy(PlacementPolicy):
    """Fixed fractions of sharded, offloaded-parameter and offloaded-optimizer chunks.

    Example:
        >>> policy = create_placement_policy("static", offload_optim_frac=0.5)
        >>> policy.setup(chunk_manager)
        >>> [policy.optim_on_device(c) for c in chunk_manager.chunks]  # e.g. 4 equal chunks
        [False, False, True, True]
    """

    need_mem_stats = False

    def __init__(self, config: PlacementConfig, *, device: torch.device | None = None) -> None:
        if config.policy != "static":
            raise ValueError(f"StaticPlacementPolicy needs a static config, got {config.policy!r}.")
        super().__init__(config, device=device)
        self._gathered: set[int] = set()
        self._optim_host: set[int] = set()
        self._param_host: set[int] = set()

    def setup(self, chunk_manager: ChunkManagerLike) -> None:
        """Select the chunks each fraction applies to, then give every chunk its home."""
        chunks = list(chunk_manager.chunks)
        sizes = [c.chunk_mem for c in chunks]
        ids = [c.chunk_id for c in chunks]
        n_gathered = len(chunks) - fraction_prefix(sizes, self.config.shard_param_frac)
        self._gathered = set(ids[len(ids) - n_gathered :])
        n_optim = fraction_prefix(sizes, self.config.offload_optim_frac)
        self._optim_host = set(ids[:n_optim]) - self._gathered
        n_param = fraction_prefix(sizes, self.config.offload_param_frac)
        self._param_host = set(ids[:n_param])
        super().setup(chunk_manager)
        self.stats = PlacementStats()  # initial homes are not moves

    def keep_params_sharded(self, chunk: ChunkLike) -> bool:
        """False for the last ``1 - shard_param_frac`` of the chunks."""
        self._require_setup()
        return chunk.chunk_id not in self._gathered

    def optim_on_device(self, chunk: ChunkLike) -> bool:
        """False for the first ``offload_optim_frac`` of the chunks."""
        self._require_setup()
        return chunk.chunk_id not in self._optim_host

    def home_on_device(self, chunk: ChunkLike) -> bool:
        """False for the first ``offload_param_frac`` of the chunks."""
        return chunk.chunk_id not in self._param_host

    def before_compute(self, chunks: Sequence[Any], step: int) -> None:
        """Send offloaded chunks that are done back to the host; bring the needed ones over."""
        needed = {c.chunk_id for c in chunks}
        for chunk in self.chunk_manager.chunks:
            if (
                chunk.chunk_id not in needed
                and not self.home_on_device(chunk)
                and self.is_on_device(chunk)
                and chunk.can_move
                and not chunk.keep_gathered
            ):
                self._move(chunk, to_device=False)
        for chunk in chunks:
            if not self.is_on_device(chunk) and not chunk.keep_gathered:
                self._move(chunk, to_device=True)
        moment = self.device_resident_bytes() + sum(
            c.chunk_mem for c in chunks if not c.is_gathered
        )
        self._note_peak(moment)

    def after_iteration(self) -> None:
        """Send the offloaded chunks home to the host at the end of the iteration."""
        for chunk in self.chunk_manager.chunks:
            if not self.home_on_device(chunk) and self.is_on_device(chunk) and chunk.can_move:
                self._move(chunk, to_device=False)
