"""Device memory granted to optimizer data in bf16 (``gpu_margin_mem_ratio`` under ``auto``).

With HybridAdam in bf16 a chunk's gradient shard stays bf16 unless a second backward accumulates
onto it before the step (then it is widened to fp32). The grant reserves what the chunk's
optimizer data really takes: fp32 master, the states and the gradient shard as one backward
leaves it (14 bytes a parameter with Adam, not 16), plus the widening from the first moment of an
iteration that accumulates until the next forward begins (``AutoPlacementPolicy`` module doc).

Checked on CPU/gloo with real GeminiDDP training: at every compute moment and around every step
the granted chunks' real bytes (master, gradient shard at its width, states) stay within the
reservation; right after each step the reservation equals them exactly; a step's accumulation
is reserved from its first moment and released at the next single-pass step; the policy keeps
its budget; and training equals the run without grants bit for bit (losses every pass, parameters
at the end), with the parameters moved 10x beyond 1e-3.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel  # imported once, before ranks fork

from kolossos.nn.optimizer import HybridAdam
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import assert_moved, global_mean, shard, snapshot
from kolossos.zero.gemini import GeminiDDP, GeminiOptimizer
from kolossos.zero.gemini.memory_tracer import MemStats

BATCH, SEQ, VOCAB = 8, 8, 128
CHUNK = {"chunk_size": 2048}


def tiny_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def granted_bytes(opt: GeminiOptimizer, gemini: GeminiDDP) -> tuple[int, int, int]:
    """(master + states, gradient shards, gradient shards at ``grad_dtype``) of the granted
    chunks, in bytes."""
    policy = gemini.policy
    granted = [c for c in gemini.chunk_manager.chunks if policy.optim_on_device(c)]
    held = sum(c.master.nbytes for c in granted)
    for chunk, *_, view in opt.slices:
        if policy.optim_on_device(chunk):
            state = opt.optim.state.get(view, {})
            held += sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))
    grads = sum(c.grad_shard.nbytes for c in granted if c.grad_shard is not None)
    narrow = sum(c.shard_size * c.grad_dtype.itemsize for c in granted)
    return held, grads, narrow


def train(
    passes: list[int], budget: int | None, memstats: MemStats | None, margin: float, nvme: float
) -> tuple[list[float], GeminiOptimizer, list[tuple[int, int, int]]]:
    """Train with ``passes[i]`` backward passes before step ``i``; return the losses, the model
    and, for each forward, ``(step, pass, the reservation at its first moment)``. ``nvme``:
    HybridAdam's ``nvme_offload_fraction``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    gemini = GeminiDDP(
        tiny_gpt2(), chunk_config_dict=CHUNK, mixed_precision=torch.bfloat16,
        placement_policy="auto", device_memory_budget=budget, memstats=memstats,
    )  # fmt: skip
    opt = GeminiOptimizer(
        HybridAdam(gemini.parameters(), lr=1e-2, nvme_offload_fraction=nvme),
        gemini,
        gpu_margin_mem_ratio=margin,
    )
    policy = gemini.policy
    streamed = {c.chunk_id for c, *_, view in opt.slices if opt.optim.is_streamed(view)}
    for chunk in gemini.chunk_manager.chunks:  # bf16 shards but where states are streamed
        assert chunk.grad_dtype == (torch.float32 if chunk.chunk_id in streamed else torch.bfloat16)
    first_moment: list[tuple[int, int, int]] = []
    where = [0, 0]  # the step and the pass running
    before_compute = policy.before_compute

    def probed(chunks: list[Any], step: int) -> None:
        before_compute(chunks, step)
        if step == 0:
            first_moment.append((*where, policy.optim_reserved_bytes))
        held, grads, _ = granted_bytes(opt, gemini)
        assert held + grads <= policy.optim_reserved_bytes, (step, held, grads)

    policy.before_compute = probed  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(0)
    losses = []
    for i, n in enumerate(passes):
        for j in range(n):
            where[:] = [i, j]
            ids = shard(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), rank, world)
            loss = gemini(input_ids=ids, labels=ids).loss
            opt.backward(loss)
            losses.append(global_mean(loss))
        held, grads, narrow = granted_bytes(opt, gemini)
        assert held + grads <= policy.optim_reserved_bytes
        assert grads == (2 if n > 1 else 1) * narrow  # accumulation widened bf16 to fp32
        opt.step()  # grants (before the step), the step, the gradients dropped
        held, _, narrow = granted_bytes(opt, gemini)
        wide = narrow if n > 1 else 0
        assert policy.optim_reserved_bytes == held + narrow + wide  # exact: nothing to spare
        opt.zero_grad()
    return losses, opt, first_moment


@distributed(2)
def test_grants_reserve_narrow_gradients_and_widen_while_accumulating() -> None:
    @parameterize("passes", [[1, 2, 1, 2], [2, 1, 2]])
    @parameterize("nvme", [0.0, 0.5])
    def case(passes: list[int], nvme: float) -> None:
        free_losses, free_opt, _ = train(passes, None, None, 0.0, nvme)
        free = free_opt.module
        stats = free.policy.memstats
        assert stats is not None
        # room for every chunk plus about half of the optimizer data (7 x the bf16 shard)
        chunks = free.chunk_manager.chunks
        demand = free.policy.steady_demand_bytes()
        assert demand is not None
        room = 3 * sum(c.shard_mem for c in chunks)
        budget = int((demand + room) / 0.9) + 1
        losses, opt, first_moment = train(passes, budget, stats, 1.0, nvme)
        policy = opt.module.policy
        granted = [c for c in opt.module.chunk_manager.chunks if policy.optim_on_device(c)]
        assert 0 < len(granted) < len(chunks)
        # NVMe-streamed states stay with the host: the grants go to the other chunks
        streamed = {c.chunk_id for c, *_, view in opt.slices if opt.optim.is_streamed(view)}
        assert bool(streamed) == (nvme > 0)
        assert not streamed & {c.chunk_id for c in granted}
        widening = sum(2 * c.shard_size for c in granted)  # bf16 -> fp32
        # after the first step's grant, each forward's first moment reserves the widening
        # exactly when it accumulates onto held gradients (its step's second pass)
        later = [(j, reserved) for i, j, reserved in first_moment if i > 0]
        base = min(reserved for _, reserved in later)
        assert [reserved - base for _, reserved in later] == [widening * (j > 0) for j, _ in later]
        if passes[0] > 1:  # the grants knew the steps accumulate: the quota holds throughout
            spare = policy.spare_device_bytes()
            assert spare is not None and max(reserved for _, reserved in later) <= spare
        assert policy.stats.peak_device_bytes <= 0.9 * budget
        # where the optimizer data lives changes no value: every loss and, at the end, every
        # parameter equal the run without grants bit for bit (that run's parity against
        # single-process training: tests/parity/test_gemini_parity.py), and training moved them
        torch.testing.assert_close(losses, free_losses, rtol=0.0, atol=0.0)
        trained = dict(opt.module.named_full_tensors())
        for name, value in free.named_full_tensors():
            torch.testing.assert_close(trained[name], value, rtol=0.0, atol=0.0, msg=name.__add__)
        torch.manual_seed(0)
        initial = snapshot(tiny_gpt2())
        assert_moved(initial, {n: trained[n] for n in initial}, atol=1e-3)  # Adam, lr 1e-2

    case()
