"""The ``auto`` placement policy: Gemini's memory manager.

Chunks live on the host until needed. At each compute moment the policy brings the needed chunks to
the device and, when the device memory left for model data is short, evicts resident chunks to the
host, the one whose next use is latest first (Belady's rule; the access order comes from the
warm-up iteration, so the rule looks ahead exactly). The memory left for model data is:

* during the warm-up iteration (first iteration): ``budget * (1 - warmup_non_model_data_ratio)``;
  meanwhile a :class:`~kolossos.zero.gemini.memory_tracer.MemStatsCollector` samples the peak
  non-model memory of every period and records which chunks each moment computes;
* afterwards: ``budget * steady_cuda_cap_ratio`` minus the non-model peak measured for the period
  that starts now, so model and non-model data together stay within the budget.

The ``const`` alias is this policy without memory sampling: the warm-up cap stays for the whole
run (the access order is still recorded, so evictions still look ahead). Optimizer states live on
the host unless :meth:`AutoPlacementPolicy.place_optim_states` grants them device memory out of the
spare memory measured in warm-up (``gpu_margin_mem_ratio``); granted bytes are reserved: the fp32
master, the states and the gradient shard as one backward leaves it (bf16 with HybridAdam in
bf16), plus what the granted shards gain when accumulation widens them to fp32, from the first
moment of an iteration that accumulates onto existing gradients to the first moment of one that
does not. Once any step has accumulated, later grants must fit with that widening counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kolossos.zero.gemini.memory_tracer import MemStats, MemStatsCollector, default_sampler
from kolossos.zero.gemini.placement.base import (
    ChunkLike,
    ChunkManagerLike,
    PlacementPolicy,
    PlacementStats,
)
from kolossos.zero.gemini.placement.budget import DeviceBudget, check_fraction
from kolossos.zero.gemini.placement.config import PlacementConfig
from kolossos.zero.gemini.placement.eviction import (
    NEVER,
    AccessTrace,
    ChunkView,
    plan_layout,
)

__all__ = ["AutoPlacementPolicy"]


class AutoPlacementPolicy(PlacementPolicy):
    """Moves chunks between device and host so that the device stays within its budget.

    Args:
        config: validated options (``policy == "auto"``).
        device: the compute device (default: the accelerator's current one).
        memstats: statistics from an earlier run; skips the warm-up measurement.

    Example:
        >>> policy = create_placement_policy("auto", device_memory_budget=64 * 2**20)
        >>> policy.setup(chunk_manager)
        >>> policy.before_compute([chunk], step=0)  # GeminiDDP's hooks do this
    """

    def __init__(
        self,
        config: PlacementConfig,
        *,
        device: torch.device | None = None,
        memstats: MemStats | None = None,
    ) -> None:
        if config.policy != "auto":
            raise ValueError(f"AutoPlacementPolicy needs an auto config, got {config.policy!r}.")
        if memstats is not None and not isinstance(memstats, MemStats):
            raise TypeError(f"memstats={memstats!r} must be a MemStats (or None).")
        super().__init__(config, device=device)
        self.budget = DeviceBudget.resolve(config.device_memory_budget)
        self.memstats: MemStats | None = memstats
        self._trace: AccessTrace | None = memstats.trace() if memstats is not None else None
        self.need_mem_stats = config.use_mem_stats and memstats is None
        sampler = default_sampler(self.device) if self.need_mem_stats else None
        self._collector = MemStatsCollector(sampler) if memstats is None else None
        self._clock = 0  # moments since the start, for least-recently-used order in warm-up
        self._last_use: dict[int, int] = {}
        self._granted: dict[int, ChunkLike] = {}
        self._optim_reserved = 0
        self._widening = 0  # what the granted shards gain when accumulation widens them
        self._accumulating = False  # this iteration accumulates onto held gradients
        self._accumulated = False  # some iteration has
        self._optim_quota: int | None = None

    # ------------------------------------------------------------------ queries
    @property
    def warming_up(self) -> bool:
        """True until the first iteration's statistics exist."""
        return self.memstats is None

    def home_on_device(self, chunk: ChunkLike) -> bool:
        """Chunks start on the host (kept-gathered ones stay on the device)."""
        return chunk.keep_gathered

    def optim_on_device(self, chunk: ChunkLike) -> bool:
        """True only for chunks granted device memory by :meth:`place_optim_states`."""
        return chunk.chunk_id in self._granted

    def model_data_cap(self, step: int) -> int:
        """Device bytes that chunk data may use during the period of moment ``step``."""
        cfg = self.config
        if self.memstats is None or not cfg.use_mem_stats:
            cap = self.budget.share(1.0 - cfg.warmup_non_model_data_ratio)
        else:
            steady = self.budget.share(cfg.steady_cuda_cap_ratio)
            cap = steady - self.memstats.period_non_model(step)
        return cap - self.optim_reserved_bytes

    # ------------------------------------------------------------------ interface
    def setup(self, chunk_manager: ChunkManagerLike) -> None:
        """Send every chunk (except kept-gathered ones) to the host."""
        super().setup(chunk_manager)
        self.stats = PlacementStats()  # initial homes are not moves

    def before_compute(self, chunks: Sequence[Any], step: int) -> None:
        """Sample (warm-up), evict what must go, and bring ``chunks`` to the device."""
        ids = self._ids(chunks)
        if step == 0:  # a forward begins: gradients still held now are accumulated onto
            self._accumulating = any(c.holds_grad_shard for c in self._granted.values())
            self._accumulated |= self._accumulating
        collector = self._collector
        if collector is not None:
            if step == 0 and collector.collecting:
                # A new forward began without a backward (an evaluation pass): record afresh.
                collector.abort()
            collector.begin_moment(ids, model_bytes=self.device_resident_bytes())
        try:
            device_after = self._adjust_layout(chunks, step)
        except BaseException:
            if collector is not None:
                collector.abort()
            raise
        if collector is not None:
            collector.end_moment(model_bytes=device_after)
        self._clock += 1
        for chunk_id in ids:
            self._last_use[chunk_id] = self._clock

    def after_iteration(self) -> None:
        """End the warm-up: its statistics drive every later decision."""
        if self._collector is not None and self._collector.collecting:
            self.memstats = self._collector.finish(model_bytes=self.device_resident_bytes())
            self._trace = self.memstats.trace()
            self._collector = None
            self.need_mem_stats = False

    # ------------------------------------------------------------------ decisions
    def _view(self, chunk: Any, needed: bool) -> ChunkView:
        on_device = self.is_on_device(chunk) or chunk.keep_gathered
        shard = 0 if chunk.keep_gathered else chunk.shard_mem
        return ChunkView(
            chunk_id=chunk.chunk_id,
            on_device=on_device,
            device_bytes=self.chunk_device_bytes(chunk),
            compute_bytes=chunk.chunk_mem + shard if needed else 0,
            evict_bytes=shard if on_device else 0,
            movable=chunk.can_move and not chunk.keep_gathered,
        )

    def _priority(self, step: int, ids: Sequence[int]) -> dict[int, int]:
        """Larger = evict earlier: next-use distance from the trace, else age since last use."""
        if self._trace is not None:
            return self._trace.victim_priority(step, ids)
        return {i: self._clock - self._last_use[i] if i in self._last_use else NEVER for i in ids}

    def _adjust_layout(self, chunks: Sequence[Any], step: int) -> int:
        """Plan and perform the moves of one moment; return the device bytes afterwards."""
        needed_ids = {c.chunk_id for c in chunks}
        by_id = {c.chunk_id: c for c in self.chunk_manager.chunks}
        resident = [
            self._view(c, needed=False)
            for c in by_id.values()
            if c.chunk_id not in needed_ids and self.chunk_device_bytes(c) > 0
        ]
        plan = plan_layout(
            needed=[self._view(c, needed=True) for c in chunks],
            resident=resident,
            capacity=self.model_data_cap(step),
            priority=self._priority(step, [v.chunk_id for v in resident]),
        )
        for chunk_id in plan.evict:
            self._move(by_id[chunk_id], to_device=False)
        for chunk_id in plan.load:
            self._move(by_id[chunk_id], to_device=True)
        self._note_peak(plan.device_bytes_after + self.optim_reserved_bytes)
        return plan.device_bytes_after

    # ------------------------------------------------------------------ optimizer states
    def check_gpu_margin_mem_ratio(self, gpu_margin_mem_ratio: float) -> None:
        """Accept any ratio in [0, 1]."""
        check_fraction("gpu_margin_mem_ratio", gpu_margin_mem_ratio)

    @property
    def optim_reserved_bytes(self) -> int:
        """Device bytes granted to optimizer data by :meth:`place_optim_states`, with the
        gradient shards' widening while gradients accumulate (module doc)."""
        return self._optim_reserved + (self._widening if self._accumulating else 0)

    def steady_demand_bytes(self) -> int | None:
        """Device bytes training needs with every chunk resident: all shards, the largest
        moment's gathered payloads and the non-model peak; ``None`` while warming up."""
        if self.memstats is None:
            return None
        chunks = list(self.chunk_manager.chunks)
        resident = sum(c.chunk_mem if c.keep_gathered else c.shard_mem for c in chunks)
        gather = self.memstats.max_gather_bytes(
            {c.chunk_id: 0 if c.keep_gathered else c.chunk_mem for c in chunks}
        )
        non_model = self.memstats.max_non_model if self.config.use_mem_stats else 0
        return resident + gather + non_model

    def spare_device_bytes(self) -> int | None:
        """Device memory (within ``steady_cuda_cap_ratio`` of the budget) left over by
        :meth:`steady_demand_bytes`; ``None`` while warming up."""
        demand = self.steady_demand_bytes()
        if demand is None:
            return None
        return max(0, self.budget.share(self.config.steady_cuda_cap_ratio) - demand)

    def place_optim_states(
        self, state_bytes: Sequence[tuple[Any, int]], gpu_margin_mem_ratio: float
    ) -> list[Any]:
        """Grant device memory to optimizer states out of ``gpu_margin_mem_ratio`` of the spare
        device memory measured in warm-up; chunks in the given order, while they fit.

        Returns:
            The newly granted chunks (their bytes are now reserved); empty while warming up.
        """
        self.check_gpu_margin_mem_ratio(gpu_margin_mem_ratio)
        spare = self.spare_device_bytes()
        if spare is None or gpu_margin_mem_ratio == 0.0:
            return []
        if self._optim_quota is None:
            self._optim_quota = int(spare * gpu_margin_mem_ratio)
        granted = []
        for chunk, nbytes in state_bytes:
            if chunk.chunk_id in self._granted:
                continue
            if chunk.grad_widened:  # the step about to run accumulated several backward passes
                self._accumulating = self._accumulated = True
            widening = self._widening + chunk.grad_widening_bytes if self._accumulated else 0
            if self._optim_reserved + nbytes + widening > self._optim_quota:
                break
            self._granted[chunk.chunk_id] = chunk
            self._optim_reserved += nbytes
            self._widening += chunk.grad_widening_bytes
            granted.append(chunk)
        return granted
