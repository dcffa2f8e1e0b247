"""Gemini placement: the eviction rule on synthetic traces, policy configuration and aliases,
static fractions, the auto policy's budget on a synthetic memory trace, and CPU memory sampling.

The policies run on real chunks (``ChunkManager`` in one process, no process group); the eviction
planner runs on plain ids and byte counts, and its move counts are checked against an exhaustive
search for the optimum.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Sequence

import pytest
import torch
import torch.nn as nn

from kolossos.accelerator import TensorMemoryTracker
from kolossos.zero.gemini.chunk import ChunkManager, unique_params
from kolossos.zero.gemini.memory_tracer import (
    AllocatorSampler,
    MemStats,
    MemStatsCollector,
    TrackerSampler,
    model_data_scope,
)
from kolossos.zero.gemini.placement import (
    NEVER,
    AccessTrace,
    AutoPlacementPolicy,
    ChunkView,
    DeviceBudget,
    DeviceBudgetExceededError,
    PlacementConfig,
    StaticPlacementPolicy,
    create_placement_policy,
    fraction_prefix,
    plan_layout,
)

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------- helpers
def view(chunk_id: int, nbytes: int, *, on_device: bool = True, movable: bool = True) -> ChunkView:
    """A chunk whose bytes on the device are the same resident, computing and evicted."""
    return ChunkView(
        chunk_id=chunk_id,
        on_device=on_device,
        device_bytes=nbytes if on_device else 0,
        compute_bytes=nbytes,
        evict_bytes=nbytes if on_device else 0,
        movable=movable,
    )


def replay(trace: Sequence[Sequence[int]], sizes: dict[int, int], capacity: int, iterations: int):
    """Run ``plan_layout`` over ``iterations`` repetitions of ``trace``; return (loads, peak)."""
    access = AccessTrace(trace)
    resident: set[int] = set()
    loads, peak = 0, 0
    for moment in range(len(trace) * iterations):
        step = moment % len(trace)
        needed = [view(c, sizes[c], on_device=c in resident) for c in trace[step]]
        others = [view(c, sizes[c]) for c in sorted(resident) if c not in trace[step]]
        plan = plan_layout(
            needed=needed,
            resident=others,
            capacity=capacity,
            priority=access.victim_priority(step, [v.chunk_id for v in others]),
        )
        resident -= set(plan.evict)
        resident |= set(trace[step])
        loads += len(plan.load)
        assert sum(sizes[c] for c in resident) == plan.device_bytes_after <= capacity
        peak = max(peak, plan.device_bytes_after)
    return loads, peak


def optimal_loads(sequence: Sequence[int], slots: int) -> int:
    """Fewest loads of a demand-paged cache of ``slots`` equal chunks (exhaustive search)."""

    @functools.cache
    def best(position: int, cache: frozenset[int]) -> int:
        if position == len(sequence):
            return 0
        chunk = sequence[position]
        if chunk in cache:
            return best(position + 1, cache)
        if len(cache) < slots:
            return 1 + best(position + 1, cache | {chunk})
        return 1 + min(best(position + 1, (cache - {out}) | {chunk}) for out in cache)

    return best(0, frozenset())


def make_manager(layers: int = 4, width: int = 8, chunk_size: int | None = None) -> ChunkManager:
    """Real chunks of a small MLP: one chunk per layer (weight + bias) by default."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    size = chunk_size or width * width + width
    manager = ChunkManager(unique_params(model), size, torch.float16, None, CPU)
    for chunk in manager:
        chunk.initialise(torch.zeros(chunk.chunk_size))
    return manager


# ---------------------------------------------------------------------------- access trace
def test_next_use_is_cyclic_and_never_for_unused() -> None:
    trace = AccessTrace([[0], [1, 2], [1], [0]])
    assert trace.next_use(1, 1) == 1  # used again at moment 2
    assert trace.next_use(2, 1) == 4  # moment 1 of the next iteration
    assert trace.next_use(0, 3) == 1  # moment 0 of the next iteration
    assert trace.next_use(0, 0) == 3
    assert trace.next_use(7, 0) == NEVER
    assert trace.next_use(1, 5) == trace.next_use(1, 1)  # moments beyond the trace wrap
    assert AccessTrace([]).next_use(0, 0) == NEVER


# ---------------------------------------------------------------------------- planner
def test_nothing_moves_when_everything_fits() -> None:
    plan = plan_layout(
        needed=[view(0, 10, on_device=False)], resident=[view(1, 10)], capacity=20, priority={}
    )
    assert plan.evict == () and plan.load == (0,) and plan.device_bytes_after == 20


def test_evicts_latest_next_use_first() -> None:
    trace = AccessTrace([[0], [1], [2], [3], [1], [2], [3]])
    resident = [view(1, 10), view(2, 10), view(3, 10)]
    priority = trace.victim_priority(0, [1, 2, 3])
    assert priority == {1: 1, 2: 2, 3: 3}
    plan = plan_layout(
        needed=[view(0, 10, on_device=False)], resident=resident, capacity=30, priority=priority
    )
    assert plan.evict == (3,)
    plan = plan_layout(
        needed=[view(0, 20, on_device=False)], resident=resident, capacity=30, priority=priority
    )
    assert plan.evict == (3, 2)


def test_ties_go_to_the_larger_then_lower_id_and_unmovable_stay() -> None:
    resident = [view(1, 10), view(2, 30), view(3, 30), view(4, 50, movable=False)]
    plan = plan_layout(
        needed=[view(0, 20, on_device=False)], resident=resident, capacity=130, priority={}
    )
    assert plan.evict == (2,)  # all tie at NEVER: larger first, then the lower id


def test_no_needless_moves() -> None:
    """The latest-next-use victim is small; a second, larger one frees enough on its own, so
    the first one stays (it is given back by the second pass)."""
    resident = [view(1, 2), view(2, 10)]
    plan = plan_layout(
        needed=[view(0, 10, on_device=False)], resident=resident, capacity=12, priority={1: 9, 2: 5}
    )
    assert plan.evict == (2,)


def test_gathered_payloads_count_even_when_their_home_is_the_host() -> None:
    payload = ChunkView(chunk_id=1, on_device=False, device_bytes=20)  # gathered, shard on host
    plan = plan_layout(
        needed=[view(0, 10, on_device=False)],
        resident=[payload, view(2, 10)],
        capacity=30,
        priority={},
    )
    assert plan.evict == (2,) and plan.device_bytes_after == 30


def test_raises_when_the_needed_chunks_cannot_fit() -> None:
    resident = [view(1, 10, movable=False), view(2, 10)]
    with pytest.raises(DeviceBudgetExceededError, match="device_memory_budget"):
        plan_layout(
            needed=[view(0, 15, on_device=False)], resident=resident, capacity=20, priority={}
        )


@pytest.mark.parametrize("seed", range(6))
def test_synthetic_trace_within_budget_with_optimal_moves(seed: int) -> None:
    """Equal chunks, one per moment (a forward then a reversed backward, with repeats): the
    device never holds more than the capacity and the loads equal the exhaustive optimum."""
    rng = random.Random(seed)
    forward = [rng.randrange(6) for _ in range(5)]
    trace = [[c] for c in forward + forward[::-1]]
    slots, iterations = rng.choice([2, 3]), 2
    loads, peak = replay(trace, dict.fromkeys(range(6), 8), 8 * slots, iterations)
    assert peak <= 8 * slots
    flat = [c for ids in trace for c in ids] * iterations
    assert loads == optimal_loads(flat, slots)


def test_synthetic_trace_with_uneven_chunks_never_exceeds_capacity() -> None:
    rng = random.Random(7)
    sizes = {c: rng.choice([4, 8, 16]) for c in range(8)}
    trace = [sorted(rng.sample(range(8), rng.choice([1, 2]))) for _ in range(12)]
    capacity = max(sum(sizes[c] for c in ids) for ids in trace) + 8
    loads, peak = replay(trace, sizes, capacity, 3)
    assert peak <= capacity
    assert loads >= len({c for ids in trace for c in ids})  # every chunk loaded once at least


# ---------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    ("name", "policy", "optim", "param", "stats"),
    [
        ("static", "static", 0.0, 0.0, True),
        ("cuda", "static", 0.0, 0.0, True),
        ("cpu", "static", 1.0, 1.0, True),
        ("CPU", "static", 1.0, 1.0, True),
        ("auto", "auto", 0.0, 0.0, True),
        ("const", "auto", 0.0, 0.0, False),
    ],
)
def test_aliases(name: str, policy: str, optim: float, param: float, stats: bool) -> None:
    config = PlacementConfig.from_user(name)
    assert (config.policy, config.offload_optim_frac, config.offload_param_frac) == (
        policy,
        optim,
        param,
    )
    assert config.use_mem_stats is stats
    assert config.alias == (name.lower() if name.lower() in ("cuda", "cpu", "const") else None)
    built = create_placement_policy(name, device=CPU, device_memory_budget=None)
    assert isinstance(built, AutoPlacementPolicy if policy == "auto" else StaticPlacementPolicy)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"placement_policy": "gpu"}, ValueError, "unknown"),
        ({"placement_policy": None}, TypeError, "must be a str"),
        ({"shard_param_frac": 1.5}, ValueError, r"\[0, 1\]"),
        ({"offload_optim_frac": "half"}, TypeError, "number"),
        (
            {"offload_param_frac": 0.5, "offload_optim_frac": 1.0, "shard_param_frac": 0.5},
            ValueError,
            "shard_param_frac=1.0",
        ),
        ({"offload_param_frac": 0.5, "offload_optim_frac": 0.25}, ValueError, "must not exceed"),
        ({"warmup_non_model_data_ratio": 0.5}, ValueError, "no effect"),
        ({"placement_policy": "auto", "shard_param_frac": 0.5}, ValueError, "no effect"),
        ({"placement_policy": "auto", "warmup_non_model_data_ratio": 1.0}, ValueError, "no "),
        ({"placement_policy": "auto", "steady_cuda_cap_ratio": 0.0}, ValueError, "no device"),
        ({"placement_policy": "auto", "device_memory_budget": 0}, ValueError, "positive"),
        ({"placement_policy": "auto", "device_memory_budget": 1.5}, TypeError, "int"),
        ({"device_memory_budget": 2**20}, ValueError, "only honoured"),
        ({"placement_policy": "cpu", "offload_optim_frac": 0.5}, ValueError, "contradicts"),
        ({"placement_policy": "auto", "chunk_size": 3}, TypeError, "unknown placement"),
    ],
)
def test_config_errors(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        create_placement_policy(device=CPU, **kwargs)


def test_memstats_and_margin_only_for_auto() -> None:
    with pytest.raises(ValueError, match="memstats"):
        create_placement_policy("static", device=CPU, memstats=MemStats())
    with pytest.raises(ValueError, match="gpu_margin_mem_ratio"):
        create_placement_policy("cpu", device=CPU).check_gpu_margin_mem_ratio(0.5)
    auto = create_placement_policy("auto", device=CPU)
    auto.check_gpu_margin_mem_ratio(0.5)
    with pytest.raises(ValueError, match="gpu_margin_mem_ratio"):
        auto.check_gpu_margin_mem_ratio(1.5)


def test_device_budget() -> None:
    assert DeviceBudget.resolve(1000).capacity_bytes == 1000
    from kolossos.accelerator import get_accelerator

    total = get_accelerator().total_memory()
    default = DeviceBudget.resolve(None, fraction=0.5)
    assert (default.source, default.capacity_bytes) == ("accelerator", total // 2)
    assert DeviceBudget.resolve(1000).share(0.9) == 900
    with pytest.raises(ValueError, match="positive"):
        DeviceBudget.resolve(-1)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        DeviceBudget.resolve(None, fraction=0.0)


# ---------------------------------------------------------------------------- static policy
def test_fraction_prefix_rounds_to_the_nearest_boundary() -> None:
    assert [fraction_prefix([4] * 4, f) for f in (0.0, 0.1, 0.2, 0.5, 0.6, 0.9, 1.0)] == [
        0,
        0,
        1,
        2,
        2,
        4,
        4,
    ]
    assert fraction_prefix([10, 1, 1], 0.5) == 1
    assert fraction_prefix([], 0.5) == 0


def test_static_fractions_select_whole_chunks_in_order() -> None:
    manager = make_manager(layers=4)
    policy = create_placement_policy(
        "static", device=CPU, shard_param_frac=0.5, offload_optim_frac=0.75
    )
    with pytest.raises(RuntimeError, match="setup"):
        policy.optim_on_device(manager.chunks[0])
    policy.setup(manager)
    assert [policy.keep_params_sharded(c) for c in manager] == [True, True, False, False]
    # the third chunk would be offloaded but is kept gathered: its optimizer steps on the device
    assert [policy.optim_on_device(c) for c in manager] == [False, False, True, True]
    assert all(policy.home_on_device(c) for c in manager)
    assert policy.stats.moves_to_host == policy.stats.moves_to_device == 0


def test_static_offloaded_params_visit_the_device_for_compute_only() -> None:
    manager = make_manager(layers=4)
    policy = create_placement_policy(
        "static", device=CPU, offload_optim_frac=1.0, offload_param_frac=0.5
    )
    policy.setup(manager)
    chunks = manager.chunks
    shard = chunks[0].shard_mem
    assert [policy.is_on_device(c) for c in chunks] == [False, False, True, True]
    assert policy.device_resident_bytes() == 2 * shard
    policy.before_compute([chunks[0]], 0)
    assert policy.is_on_device(chunks[0])
    policy.before_compute([chunks[2]], 1)  # chunk 0 is done: back to the host
    assert [policy.is_on_device(c) for c in chunks] == [False, False, True, True]
    policy.before_compute([chunks[1]], 2)
    policy.after_iteration()
    assert [policy.is_on_device(c) for c in chunks] == [False, False, True, True]
    assert (policy.stats.moves_to_device, policy.stats.moves_to_host) == (2, 2)


# ---------------------------------------------------------------------------- auto policy
def synthetic_stats(manager: ChunkManager) -> MemStats:
    """Forward over the chunks then backward in reverse; non-model memory grows through the
    forward (activations) and shrinks through the backward."""
    ids = [c.chunk_id for c in manager]
    order = [(i,) for i in ids + ids[::-1]]
    non_model = [100 * (k + 1) for k in range(len(ids))] + [100 * (len(ids) - k) for k in ids]
    return MemStats(access_order=order, non_model_bytes=non_model, model_bytes=[0] * len(order))


def test_auto_keeps_model_plus_non_model_within_the_budget() -> None:
    """With statistics given (a synthetic memory trace), every moment's chunk bytes plus the
    period's non-model peak stay within ``steady_cuda_cap_ratio`` of the budget, evictions
    happen, and they follow the next use (the chunk computed next in backward stays)."""
    manager = make_manager(layers=4)
    stats = synthetic_stats(manager)
    chunk = manager.chunks[0]
    compute = chunk.chunk_mem + chunk.shard_mem
    budget = int((compute + 2 * chunk.shard_mem + max(stats.non_model_bytes)) / 0.9) + 1
    policy = create_placement_policy(
        "auto", device=CPU, memstats=stats, device_memory_budget=budget
    )
    assert isinstance(policy, AutoPlacementPolicy) and not policy.need_mem_stats
    policy.setup(manager)
    assert policy.device_resident_bytes() == 0  # chunks start on the host
    for _ in range(2):
        for step, ids in enumerate(stats.access_order):
            chunks = [manager.chunks[i] for i in ids]
            policy.before_compute(chunks, step)
            # the payload of the computed chunk joins the resident shards while gathered
            resident = policy.device_resident_bytes() + chunk.chunk_mem
            assert resident <= policy.model_data_cap(step)
            assert resident + stats.non_model_bytes[step] <= budget * 0.9
        policy.after_iteration()
    assert policy.stats.moves_to_host > 0
    assert policy.stats.peak_device_bytes <= budget * 0.9


def test_auto_warmup_cap_lru_and_measured_statistics() -> None:
    """No statistics: warm-up caps model data at ``1 - warmup_non_model_data_ratio`` of the
    budget, evicts the least recently used chunk, and measures the iteration on the CPU."""
    manager = make_manager(layers=3)
    chunk = manager.chunks[0]
    budget = (chunk.chunk_mem + 2 * chunk.shard_mem) * 2  # warm-up cap: 1 computed + 1 resident
    policy = create_placement_policy(
        "auto", device=CPU, device_memory_budget=budget, warmup_non_model_data_ratio=0.5
    )
    assert isinstance(policy, AutoPlacementPolicy) and policy.need_mem_stats
    policy.setup(manager)
    activations = []
    for step, i in enumerate([0, 1, 2, 1]):
        policy.before_compute([manager.chunks[i]], step)
        activations.append(torch.empty(256, dtype=torch.uint8))  # 256 non-model bytes each
        assert policy.device_resident_bytes() <= policy.model_data_cap(step)
    on_device = [policy.is_on_device(c) for c in manager]
    assert on_device == [False, True, True]  # chunk 0 was used longest ago
    policy.after_iteration()
    stats = policy.memstats
    assert stats is not None and not policy.warming_up and not policy.need_mem_stats
    assert stats.access_order == [(0,), (1,), (2,), (1,)]
    assert stats.non_model_bytes == [256, 512, 768, 1024]


def test_auto_warmup_restarts_after_a_forward_without_backward() -> None:
    """An evaluation forward (moments 0, 1, no backward) before the first training iteration
    is not recorded as part of it."""
    manager = make_manager(layers=3)
    policy = create_placement_policy("auto", device=CPU)
    policy.setup(manager)
    for step, i in enumerate([2, 1]):
        policy.before_compute([manager.chunks[i]], step)
    for step, i in enumerate([0, 1, 1, 0]):
        policy.before_compute([manager.chunks[i]], step)
    policy.after_iteration()
    assert isinstance(policy, AutoPlacementPolicy) and policy.memstats is not None
    assert policy.memstats.access_order == [(0,), (1,), (1,), (0,)]


def test_const_alias_keeps_the_warmup_cap() -> None:
    manager = make_manager(layers=2)
    policy = create_placement_policy("const", device=CPU, device_memory_budget=10_000)
    policy.setup(manager)
    for step, chunk in enumerate(manager):
        policy.before_compute([chunk], step)
    policy.after_iteration()
    assert isinstance(policy, AutoPlacementPolicy) and policy.memstats is not None
    assert policy.memstats.non_model_bytes == [0, 0]  # no sampling, order only
    assert policy.model_data_cap(0) == int(10_000 * (1 - 0.8))


def test_gpu_margin_grants_optimizer_states_out_of_spare_memory() -> None:
    manager = make_manager(layers=4)
    stats = synthetic_stats(manager)
    budget = 1_000_000
    policy = create_placement_policy(
        "auto", device=CPU, device_memory_budget=budget, memstats=stats
    )
    policy.setup(manager)
    spare = policy.spare_device_bytes()
    resident = sum(c.shard_mem for c in manager) + manager.chunks[0].chunk_mem
    assert spare == int(budget * 0.9) - max(stats.non_model_bytes) - resident
    state = (spare // 2) // 3 + 1  # three chunks' states would exceed half the spare memory
    requests = [(c, state) for c in manager]
    cap = policy.model_data_cap(0)
    granted = policy.place_optim_states(requests, 0.5)
    assert granted == manager.chunks[:2]
    assert [policy.optim_on_device(c) for c in manager] == [True, True, False, False]
    assert policy.model_data_cap(0) == cap - 2 * state  # granted bytes are reserved
    assert policy.place_optim_states(requests, 0.5) == []


# ---------------------------------------------------------------------------- memory tracer
def test_cpu_sampler_separates_model_and_non_model_data() -> None:
    collector = MemStatsCollector(TrackerSampler())
    kept = []
    collector.begin_moment([0])
    collector.end_moment(model_bytes=0)
    with model_data_scope():
        kept.append(torch.empty(4096, dtype=torch.uint8))  # model data: not counted
    temp = torch.empty(1000, dtype=torch.uint8)  # peak of period 0: 1000 bytes
    del temp
    collector.begin_moment([1])
    collector.end_moment(model_bytes=4096)
    kept.append(torch.empty(300, dtype=torch.uint8))
    stats = collector.finish()
    assert stats.non_model_bytes == [1000, 300]
    assert stats.access_order == [(0,), (1,)] and stats.model_bytes == [0, 4096]
    assert stats.max_overall == 4396 and stats.period_non_model(5) == 1000


def test_allocator_sampler_subtracts_model_data() -> None:
    """The GPU sampler's arithmetic, fed by the CPU accelerator's tracker-backed statistics:
    the allocator peak of the period minus the model data of the period."""
    with TensorMemoryTracker(CPU):
        sampler = AllocatorSampler(CPU)
        sampler.start()
        model = torch.empty(4096, dtype=torch.uint8)
        temp = torch.empty(1000, dtype=torch.uint8)
        del temp
        assert sampler.sample(model_bytes=4096) == 1000
        assert sampler.sample(model_bytes=4096) == 0  # the peak restarted at the sample
        sampler.stop()
    del model


def test_memstats_validation() -> None:
    with pytest.raises(ValueError, match="one entry per moment"):
        MemStats(access_order=[(0,)], non_model_bytes=[], model_bytes=[0])
    with pytest.raises(ValueError, match=">= 0"):
        MemStats(access_order=[(0,)], non_model_bytes=[-1], model_bytes=[0])
    stats = MemStats(access_order=[(0, 1), (1,)], non_model_bytes=[0, 0], model_bytes=[0, 0])
    assert stats.max_gather_bytes({0: 5, 1: 7}) == 12
    assert list(itertools.chain.from_iterable(stats.access_order)) == [0, 1, 1]
