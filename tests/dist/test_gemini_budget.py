"""Gemini's ``auto`` placement with a device budget, on CPU/gloo: real GeminiDDP training.

On a CPU the device and the host are the same memory, so the placement's homes are bookkeeping
and the budget is the memory manager's promise made observable: the chunk bytes it keeps on the
"device" (resident shards plus gathered payloads) are sampled at every ``before_compute``, after
every all-gather and after every optimizer step, and must never exceed the budget, nor the
model-data cap of the moment (the budget minus the non-model peak measured in warm-up). In the
last step a second tracker measures non-model memory per period again, and chunk bytes plus
non-model bytes must stay within ``steady_cuda_cap_ratio`` of the budget: the whole promise. The
budget is chosen from an unbudgeted run so that it bites (evictions happen) and is feasible.
Training must not notice: losses equal the unbudgeted run's exactly and the single-process
reference's within fp32 tolerance.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from transformers import GPT2Config, GPT2LMHeadModel  # imported once, before ranks fork

from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import global_mean, shard
from kolossos.zero.gemini import GeminiDDP, GeminiOptimizer, gemini_optimizer
from kolossos.zero.gemini.memory_tracer import MemStats, MemStatsCollector, TrackerSampler
from kolossos.zero.gemini.optim_placement import optim_data_bytes

STEPS = 3
GLOBAL_BATCH = 8
SEQ = 8
VOCAB = 128
CHUNK = {"chunk_size": 2048}  # ~15 chunks for the ~30k parameters below
LOSS_TOL = 1e-5  # fp32: Gemini and the reference differ only in the order of gradient sums


def tiny_gpt2() -> nn.Module:
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen) for _ in range(STEPS)]


class Probe:
    """Samples the policy's device-resident chunk bytes during training.

    Per moment it keeps the largest resident bytes and the largest bytes that cannot be evicted
    then (gathered payloads plus the shards of the chunks being computed); every sample is also
    checked against the cap in force when a budget is set.
    """

    def __init__(self, gemini: GeminiDDP, budget: int | None) -> None:
        self.policy, self.manager, self.budget = gemini.policy, gemini.chunk_manager, budget
        self.moment, self.needed = 0, []
        self.full: defaultdict[int, int] = defaultdict(int)
        self.pinned: defaultdict[int, int] = defaultdict(int)
        self.samples = 0
        self.last: defaultdict[int, int] = defaultdict(int)  # resident per moment, last step
        self.steady: MemStatsCollector | None = None  # measures non-model data in the last step
        self.steady_stats: MemStats | None = None
        self.homes: list[bool] = []  # per moment: whether every chunk was placed right
        before_compute, gather = self.policy.before_compute, self.manager.gather

        def probed_before_compute(chunks: list[Any], step: int) -> None:
            self.sample()  # the previous moment's layout, payloads still gathered
            if self.steady is not None:
                self.steady.begin_moment([c.chunk_id for c in chunks])
                self.steady.end_moment(model_bytes=0)
            self.moment, self.needed = step, list(chunks)
            before_compute(chunks, step)
            self.sample()
            self.homes.append(all(map(self.placed_right, self.manager.chunks)))

        def probed_gather(chunk: Any, async_op: bool = False) -> None:
            gather(chunk, async_op)
            self.sample()

        self.policy.before_compute = probed_before_compute  # type: ignore[method-assign]
        self.manager.gather = probed_gather  # type: ignore[method-assign]

    def placed_right(self, chunk: Any) -> bool:
        """Needed chunks are on the device; others only if at home there or still in use."""
        on_device = self.policy.is_on_device(chunk)
        if chunk in self.needed:
            return on_device
        return not on_device or self.policy.home_on_device(chunk) or not chunk.can_move

    def sample(self) -> None:
        resident = self.policy.device_resident_bytes()
        pinned = sum(c.chunk_mem for c in self.manager.chunks if c.is_gathered)
        pinned += sum(c.shard_mem for c in self.needed)
        self.full[self.moment] = max(self.full[self.moment], resident)
        if self.steady is not None:
            self.last[self.moment] = max(self.last[self.moment], resident)
        self.pinned[self.moment] = max(self.pinned[self.moment], pinned)
        self.samples += 1
        if self.budget is not None:
            assert resident <= self.budget, (resident, self.budget)
            cap = self.policy.model_data_cap(self.moment)
            assert resident <= cap, (self.moment, resident, cap)


def train(
    budget: int | None, opt_kwargs: dict[str, Any] | None = None, **kwargs: Any
) -> tuple[list[float], GeminiDDP, Probe]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    gemini = GeminiDDP(
        tiny_gpt2(),
        chunk_config_dict=CHUNK,
        mixed_precision=torch.float32,
        device_memory_budget=budget,
        **kwargs,
    )
    opt = GeminiOptimizer(
        torch.optim.AdamW(gemini.parameters(), lr=1e-2), gemini, **(opt_kwargs or {})
    )
    probe = Probe(gemini, budget)
    losses = []
    for step, ids in enumerate(batches()):
        if step == STEPS - 1:
            probe.steady = MemStatsCollector(TrackerSampler())
        loss = gemini(input_ids=shard(ids, rank, world), labels=shard(ids, rank, world)).loss
        opt.backward(loss)
        if probe.steady is not None:
            probe.steady_stats = probe.steady.finish()
            probe.steady = None
        opt.step()
        opt.zero_grad()
        probe.sample()  # end of the step: nothing gathered
        losses.append(global_mean(loss))
    return losses, gemini, probe


def reference_losses() -> list[float]:
    torch.manual_seed(0)
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids in batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def biting_budget(probe: Probe, non_model: list[int], ratio: float) -> int:
    """A budget between the feasible minimum and what keeping every chunk would need, with
    ``ratio`` of it usable for model plus the period's non-model data."""
    moments = range(len(non_model))
    feasible = max(probe.pinned[m] + non_model[m] for m in moments)
    keep_all = max(probe.full[m] + non_model[m] for m in moments)
    assert feasible < keep_all, (feasible, keep_all)
    return int((feasible + keep_all) / 2 / ratio)


@distributed(2)
def test_auto_placement_stays_within_the_device_budget() -> None:
    ref = reference_losses()
    free_losses, free_gemini, free_probe = train(None, placement_policy="auto")
    torch.testing.assert_close(free_losses, ref, rtol=LOSS_TOL, atol=LOSS_TOL)
    stats = free_gemini.policy.memstats
    assert stats is not None and stats.max_non_model > 0
    assert free_gemini.policy.stats.moves_to_host == 0  # the host's RAM: nothing to evict

    @parameterize("mode", ["measured", "memstats", "const"])
    def case(mode: str) -> None:
        if mode == "const":  # a constant cap: (1 - warmup ratio) of the budget for model data
            budget = biting_budget(free_probe, [0] * stats.num_moments, 0.5)
            kwargs = {"placement_policy": "const", "warmup_non_model_data_ratio": 0.5}
        else:
            budget = biting_budget(free_probe, stats.non_model_bytes, 0.9)
            warmup = 1.0 - max(free_probe.pinned.values()) / budget - 0.05
            kwargs = {"placement_policy": "auto", "warmup_non_model_data_ratio": warmup}
            if mode == "memstats":
                kwargs = {"placement_policy": "auto", "memstats": copy.deepcopy(stats)}
        losses, gemini, probe = train(budget, **kwargs)
        policy = gemini.policy
        assert probe.samples > 10 * STEPS
        assert policy.stats.moves_to_host > 0  # the budget made the manager evict
        assert policy.stats.peak_device_bytes <= budget
        if mode != "const":
            assert policy.memstats.access_order == stats.access_order
            # The whole promise, measured in the last step: chunk bytes plus non-model bytes of
            # every period stay within steady_cuda_cap_ratio of the budget.
            steady = probe.steady_stats
            assert steady is not None and steady.num_moments == stats.num_moments
            for m, non_model in enumerate(steady.non_model_bytes):
                assert probe.last[m] + non_model <= 0.9 * budget, (m, probe.last[m], non_model)
                # what warm-up measured is what later steps use (model data labelled exactly)
                assert non_model <= policy.memstats.non_model_bytes[m], (m, non_model)
        torch.testing.assert_close(losses, free_losses, rtol=0.0, atol=0.0)

    case()

    # gpu_margin_mem_ratio: a budget with room for every chunk plus about half of the optimizer
    # data (fp32 master + gradient + two Adam states = 4 x the fp32 shard) on the device.
    chunks = free_gemini.chunk_manager.chunks
    demand = free_gemini.policy.steady_demand_bytes()
    room = 2 * sum(c.shard_mem for c in chunks)
    budget = int((demand + room) / 0.9) + 1
    # The grants come before the first step, so no granted chunk has states yet when its data
    # moves (they are created on the device), and the predicted size is the size they take.
    moved: list[tuple[Any, Any, list[nn.Parameter], bool]] = []

    def spy(optim: Any, chunk: Any, views: Any, device: torch.device) -> None:
        own = [view for *_, view in views]
        moved.append((optim, chunk, own, any(optim.state.get(v) for v in own)))
        real_move(optim, chunk, views, device)

    real_move = gemini_optimizer.move_optim_data
    gemini_optimizer.move_optim_data = spy
    try:
        losses, gemini, _ = train(
            budget, {"gpu_margin_mem_ratio": 1.0}, placement_policy="auto", memstats=stats
        )
    finally:
        gemini_optimizer.move_optim_data = real_move
    assert moved and not any(had_states for *_, had_states in moved)
    policy = gemini.policy
    held = sum(optim_data_bytes(optim, chunk, own) or 0 for optim, chunk, own, _ in moved)
    assert held == policy.optim_reserved_bytes
    granted = [c.chunk_id for c in gemini.chunk_manager.chunks if policy.optim_on_device(c)]
    assert 0 < len(granted) < len(chunks)
    assert granted == list(range(len(granted)))  # in chunk order
    assert 0 < policy.optim_reserved_bytes <= room
    assert policy.stats.peak_device_bytes <= 0.9 * budget
    torch.testing.assert_close(losses, free_losses, rtol=0.0, atol=0.0)


@distributed(2)
def test_cpu_alias_offloads_between_uses() -> None:
    """The older ``cpu`` policy (static, everything offloaded): at every moment the chunks being
    computed, and no others except those still in use, are on the device; training is
    unchanged."""
    free_losses, _, _ = train(None, placement_policy="static")
    losses, gemini, probe = train(None, placement_policy="cpu")
    policy, chunks = gemini.policy, gemini.chunk_manager.chunks
    assert not any(policy.home_on_device(c) or policy.optim_on_device(c) for c in chunks)
    assert probe.homes and all(probe.homes)
    assert policy.stats.moves_to_device == policy.stats.moves_to_host > 0
    torch.testing.assert_close(losses, free_losses, rtol=0.0, atol=0.0)
