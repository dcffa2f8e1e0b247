"""``GeminiManager``: Colossal-AI's name for a chunk manager together with its placement policy.

``GeminiDDP`` holds the two pieces itself (``model.chunk_manager``, ``model.policy``) and its
hooks call the policy; this class offers Colossal-AI's interface over the same pieces for code
that drives placement by hand: :meth:`GeminiManager.adjust_layout` before each compute moment,
:meth:`GeminiManager.post_iter` after each iteration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kolossos.zero.gemini.chunk import Chunk, ChunkManager
from kolossos.zero.gemini.memory_tracer import MemStats
from kolossos.zero.gemini.placement import (
    AutoPlacementPolicy,
    PlacementPolicy,
    create_placement_policy,
)

__all__ = ["GeminiManager"]


class GeminiManager:
    """Places the chunks of ``chunk_manager`` between the compute device and the host.

    Args:
        placement_policy: ``"static"`` or ``"auto"`` (or the older ``"cuda"``, ``"cpu"``,
            ``"const"``), see :mod:`kolossos.zero.gemini.placement`.
        chunk_manager: the chunks to place (their homes are set at once).
        memstats: ``"auto"`` only: statistics from an earlier run, instead of measuring the
            first iteration.
        **placement_kwargs: the policy's options (``shard_param_frac``, ``offload_optim_frac``,
            ``offload_param_frac`` for static; ``warmup_non_model_data_ratio``,
            ``steady_cuda_cap_ratio``, ``device_memory_budget`` for auto).

    Raises:
        ValueError, TypeError: an unknown policy or option, or an option the policy ignores.

    Example:
        >>> manager = init_chunk_manager(model, hidden_dim=768, search_range_m=32)
        >>> gemini = GeminiManager("auto", manager, device_memory_budget=2**30)
        >>> gemini.adjust_layout(tuple(manager.chunks[:1]))  # before computing chunk 0
        >>> gemini.post_iter()  # after the iteration's backward
    """

    def __init__(
        self,
        placement_policy: str,
        chunk_manager: ChunkManager,
        memstats: MemStats | None = None,
        **placement_kwargs: Any,
    ) -> None:
        self.policy_name = placement_policy
        self._chunk_manager = chunk_manager
        self._premade_memstats = memstats
        self._placement_policy = create_placement_policy(
            placement_policy,
            device=chunk_manager.compute_device,
            memstats=memstats,
            **placement_kwargs,
        )
        self._placement_policy.setup(chunk_manager)
        self._compute_idx = -1
        self._warmup = True

    @property
    def chunk_manager(self) -> ChunkManager:
        """The chunks this manager places."""
        return self._chunk_manager

    @property
    def placement_policy(self) -> PlacementPolicy:
        """The policy deciding each chunk's home (a kolossos name)."""
        return self._placement_policy

    @property
    def need_warmup(self) -> bool:
        """Whether the policy measures a warm-up iteration (``auto`` and its alias ``const``)."""
        return isinstance(self._placement_policy, AutoPlacementPolicy)

    def is_warmup(self) -> bool:
        """True until the first :meth:`post_iter`."""
        return self._warmup

    def memstats(self) -> MemStats:
        """The memory statistics the ``auto`` policy plans with: those given at construction,
        or those measured in the first iteration.

        Raises:
            RuntimeError: still warming up, or a static policy (it measures nothing).
        """
        if self._premade_memstats is not None:
            return self._premade_memstats
        policy = self._placement_policy
        if not isinstance(policy, AutoPlacementPolicy):
            raise RuntimeError(
                f"placement_policy={self.policy_name!r} collects no memory statistics; use "
                "placement_policy='auto'."
            )
        if policy.memstats is None:
            raise RuntimeError(
                "the memory statistics exist once the warm-up iteration ended; call "
                "post_iter() after the first iteration first."
            )
        return policy.memstats

    def pre_iter(self, *args: Any) -> None:
        """Start of an iteration: nothing to do (the auto policy samples in
        :meth:`adjust_layout`); kept for Colossal-AI's call sequence."""

    def post_iter(self) -> None:
        """End of an iteration (after backward): ends the warm-up and restarts the count of
        compute moments."""
        self._placement_policy.after_iteration()
        self._warmup = False
        self.reset_attributes()

    def reset_attributes(self) -> None:
        """Restart the count of compute moments (the next :meth:`adjust_layout` is moment 0)."""
        self._compute_idx = -1

    def adjust_layout(self, chunks: Sequence[Chunk]) -> None:
        """Before the chunks of one compute moment are gathered: bring them home to the
        device, evicting others to the host if the policy's budget requires it."""
        self._compute_idx += 1
        self._placement_policy.before_compute(list(chunks), self._compute_idx)

    @property
    def is_cuda_margin_mem_avail(self) -> bool:
        """Whether :attr:`cuda_margin_mem` can be known (the auto policy)."""
        return isinstance(self._placement_policy, AutoPlacementPolicy)

    @property
    def cuda_margin_mem(self) -> int | None:
        """Device bytes left over by training in the steady state (where optimizer states may
        go); ``None`` for a static policy or while warming up."""
        policy = self._placement_policy
        if isinstance(policy, AutoPlacementPolicy):
            return policy.spare_device_bytes()
        return None
