"""GeminiDDP + GeminiOptimizer (no plugin) vs single-process training of a tiny GPT-2 on CPU/gloo.

The reference keeps Gemini's precision recipe in one process: working weights in the working
dtype, fp32 master weights stepped by AdamW, fp16 loss scaling with the same scale. It trains on
the whole global batch; each Gemini rank on its shard. Chunks are 2048 elements, so the ~30k
parameters spread over ~16 chunks, tensors straddle rank shards, and the tied ``wte``/``lm_head``
appears once. One process group serves each sweep (``parameterize``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import assert_moved, global_mean, shard, snapshot
from kolossos.zero.gemini import GeminiDDP, GeminiOptimizer

STEPS = 8
GLOBAL_BATCH = 8
SEQ = 8
VOCAB = 128
SCALE = 2.0**10  # fp16 loss scale: no overflow with this model
CHUNK = {"chunk_size": 2048}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LR = 3e-2
# AdamW with eps=1e-3 (see ``adamw``) trains STEPS steps on one repeated batch, so that every
# parameter moves by several times LR (assert_moved). (loss, parameters) rtol = atol. fp32
# differs only in the order of gradient sums (measured 3e-7 on parameters). In fp16/bf16 each
# rank rounds its own shard's gradients and the reduce-scatter adds them in that dtype (measured
# worst on parameters, 2 and 4 ranks: fp16 1.1e-3, bf16 6.8e-3). With Adam's default eps=1e-8
# these tolerances were a few learning rates (fp32 1e-4, bf16 5e-2, fp16 3e-2), because Adam
# turned a rounding difference in a near-zero gradient into a whole lr-sized step; that also
# made them as large as the parameters' moves in 3 steps, so the check passed without any step.
TOL = {"fp32": (1e-5, 1e-5), "bf16": (2e-2, 1.5e-2), "fp16": (3e-3, 3e-3)}
# bf16 rounding differences come within 15x of the slowest parameter's move (a LayerNorm bias),
# so there every parameter must move by 2x the tolerance and the largest move by 10x.
EACH = {"fp32": None, "bf16": 2.0, "fp16": None}


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def batches(steps: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen) for _ in range(steps)]


def same_batch(steps: int) -> list[torch.Tensor]:
    """One global batch ``steps`` times: every step pushes a parameter the same way, so Adam
    moves it by up to LR per step (on fresh random batches the directions partly cancel)."""
    return batches(1) * steps


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss.float()


def adamw(params: Any) -> torch.optim.Optimizer:
    # eps=1e-3: Adam's update for a gradient below eps stays proportional to it, instead of a
    # whole lr-sized step whose sign is decided by rounding noise (the attention key biases'
    # true gradient is zero: softmax ignores a constant shift)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, eps=1e-3)


class Reference:
    """One process, Gemini's precision recipe: low-precision model, fp32 masters."""

    def __init__(self, model: nn.Module, precision: str) -> None:
        self.initial = snapshot(model)
        self.model = model.to(DTYPES[precision])
        self.scale = SCALE if precision == "fp16" else 1.0
        self.master_model = copy.deepcopy(model).float()
        self.opt = adamw(self.master_model.parameters())

    def backward(self, loss: torch.Tensor) -> list[torch.Tensor]:
        """Backward, then the unscaled fp32 gradients on the masters (returned)."""
        (loss * self.scale).backward()
        masters = list(self.master_model.parameters())
        for master, p in zip(masters, self.model.parameters(), strict=True):
            master.grad = None if p.grad is None else p.grad.float() / self.scale
            p.grad = None
        return [m for m in masters if m.grad is not None]

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for master, p in zip(self.master_model.parameters(), self.model.parameters(),
                                 strict=True):  # fmt: skip
                p.copy_(master)


def wrap(
    model: nn.Module, precision: str, chunk: dict[str, int] = CHUNK, **opt_kwargs: Any
) -> tuple[GeminiDDP, GeminiOptimizer]:
    gemini = GeminiDDP(model, chunk_config_dict=chunk, mixed_precision=DTYPES[precision])
    opt = GeminiOptimizer(adamw(gemini.parameters()), gemini, initial_scale=SCALE, **opt_kwargs)
    return gemini, opt


def full_params(gemini: GeminiDDP) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in gemini.named_full_tensors()}


def assert_matches(gemini: GeminiDDP, ref: Reference, precision: str) -> None:
    """The gathered parameters equal the reference's masters, and moved well beyond the
    tolerance."""
    tol = TOL[precision][1]
    full = full_params(gemini)
    for name, p in ref.master_model.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=tol, atol=tol, msg=name)
    assert_moved(ref.initial, full, tol, each=EACH[precision])


Clip = Callable[[list[torch.Tensor]], Any]
Trained = tuple[list[float], list[float], GeminiDDP, Reference, GeminiOptimizer]


def train_both(
    precision: str,
    checkpointing: bool | str = False,
    clip: Clip | None = None,
    on_model: Callable[..., None] | None = None,
    steps: int = STEPS,
    chunk: dict[str, int] = CHUNK,
    **opt_kwargs: Any,
) -> Trained:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = tiny_gpt2()
    ref = Reference(copy.deepcopy(model), precision)
    if checkpointing:  # True: HF's default (non-reentrant); "reentrant": torch's reentrant one
        kwargs = {"use_reentrant": checkpointing == "reentrant"}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if on_model is not None:  # called at every forward of a layer (recomputation included)
        model.transformer.h[0].attn.c_attn.register_forward_pre_hook(on_model)
    gemini, opt = wrap(model, precision, chunk, **opt_kwargs)
    losses, ref_losses = [], []
    for ids in same_batch(steps):
        loss = lm_loss(gemini, shard(ids, rank, world))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
        ref_loss = lm_loss(ref.model, ids)
        grads = ref.backward(ref_loss)
        if clip is not None:
            clip(grads)
        ref.step()
        ref_losses.append(ref_loss.item())
    return losses, ref_losses, gemini, ref, opt


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_matches_single_process(world_size: int) -> None:
    @parameterize("precision", ["fp32", "bf16", "fp16"])
    @parameterize("checkpointing", [False, True])
    def case(precision: str, checkpointing: bool) -> None:
        losses, ref_losses, gemini, ref, _ = train_both(precision, checkpointing)
        loss_tol = TOL[precision][0]
        torch.testing.assert_close(losses, ref_losses, rtol=loss_tol, atol=loss_tol)
        assert_matches(gemini, ref, precision)

    case()


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_tied_embedding_alone_in_its_chunk_matches_single_process(world_size: int) -> None:
    """With chunks larger than the tied ``wte`` (4096 elements in 8192-element chunks) the
    embedding is still packed alone, in a chunk cut to its size, and training matches one
    process: the LM head's second use and backward find it in its own chunk."""
    chunk = {"chunk_size": 8192}
    losses, ref_losses, gemini, ref, _ = train_both("fp32", chunk=chunk)
    torch.testing.assert_close(losses, ref_losses, rtol=TOL["fp32"][0], atol=TOL["fp32"][0])
    assert_matches(gemini, ref, "fp32")
    manager = gemini.chunk_manager
    first, info = manager.locate(gemini.module.transformer.wte.weight)
    assert [i.name for i in first.tensors] == ["transformer.wte.weight"]
    assert info.numel == VOCAB * 32 < chunk["chunk_size"]  # it would fit beside others
    assert first.chunk_size == info.numel  # a multiple of 2 and 4: cut to its size
    assert len(manager.chunks[1].tensors) > 1  # the rest shares chunks as before


@distributed(2)
def test_checkpointing_adds_no_all_gather() -> None:
    """Recomputation re-uses the chunks backward gathers anyway: the same all-gather count, with
    the non-reentrant and the reentrant checkpoint."""
    steps = 3  # counts only: no parity check
    counts: dict[bool | str, int] = {}
    block_calls: dict[bool | str, int] = {}
    for checkpointing in (False, True, "reentrant"):
        calls = [0]

        def count(*_: Any, calls: list[int] = calls) -> None:
            calls[0] += 1

        _, _, gemini, _, _ = train_both("fp32", checkpointing, on_model=count, steps=steps)
        block_calls[checkpointing] = calls[0]
        counts[checkpointing] = gemini.chunk_manager.gathers
        assert gemini.chunk_manager.prefetches > 0  # the order is known after iteration 1
        assert len(gemini.chunk_manager.chunks) >= 10
    assert block_calls[True] == block_calls["reentrant"] == 2 * block_calls[False] == 2 * steps
    assert counts[True] == counts["reentrant"] == counts[False], counts
    # each chunk: at most twice in forward (wte is tied to lm_head) and once in backward
    assert counts[False] <= steps * 3 * len(gemini.chunk_manager.chunks)
    gemini.eval()
    with torch.no_grad():  # inference after training: prefetched chunks do not linger
        for ids in batches(2):
            gemini(input_ids=shard(ids, dist.get_rank(), 2))
    assert not any(c.is_gathered for c in gemini.chunk_manager.chunks)


@distributed(2)
def test_held_chunks_save_all_gathers() -> None:
    """From the second iteration on every chunk is gathered once in forward (the tied ``wte``
    chunk stays gathered from the embedding to the LM head) and once in backward, except the
    LM head's chunk, held from the end of forward into backward: ``2 C - 1`` all-gathers per
    step instead of ``2 C + 1``. Holding changes no number: losses are bit-identical, also after
    a forward whose held chunks no backward used and a step."""
    rank, steps = dist.get_rank(), 3  # counts and bit-identity: no parity check
    per_step: dict[bool, list[int]] = {}
    losses: dict[bool, list[float]] = {}
    for hold in (True, False):
        torch.manual_seed(0)
        gemini, opt = wrap(tiny_gpt2(), "fp32")
        gemini.hooks.hold = hold
        per_step[hold], losses[hold] = [], []
        for ids in batches(steps):
            before = gemini.chunk_manager.gathers
            loss = lm_loss(gemini, shard(ids, rank, 2))
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            per_step[hold].append(gemini.chunk_manager.gathers - before)
            losses[hold].append(loss.item())
        # a forward without backward before the step holds chunks; the step must drop them
        opt.backward(lm_loss(gemini, shard(ids, rank, 2)))
        lm_loss(gemini, shard(ids, rank, 2))
        opt.step()
        losses[hold].append(lm_loss(gemini, shard(ids, rank, 2)).item())
        n_chunks = len(gemini.chunk_manager.chunks)
        wte = gemini.chunk_manager.locate(gemini.module.transformer.wte.weight)[0].chunk_id
        assert gemini.hooks.backward_first == {wte}
    assert losses[True] == losses[False]
    assert per_step[True][1:] == [2 * n_chunks - 1] * (steps - 1), per_step
    assert per_step[False][1:] == [2 * n_chunks + 1] * (steps - 1), per_step


@distributed(4)
def test_chunk_comm_matches_torch_collectives() -> None:
    """Two gloo ranks exchange point to point (``pairwise``), in a sub-group too (peer ranks
    mapped to world ranks); four ranks use the collectives. Same results as torch's flat
    all-gather and reduce-scatter, synchronous and asynchronous."""
    from kolossos.zero.gemini.chunk.comm import ChunkComm

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for group in (pairs[rank // 2], None):
        comm = ChunkComm(group)
        n = dist.get_world_size(group)
        assert comm.pairwise == (n == 2)
        shard = torch.arange(6, dtype=torch.float32) + 10 * rank
        expected = torch.empty(6 * n)
        dist.all_gather_into_tensor(expected, shard, group=group)
        for async_op in (False, True):
            payload = torch.full((6 * n,), float("nan"))
            pending = comm.all_gather(payload, shard, tag=3, async_op=async_op)
            if pending is not None:
                pending.wait()
            torch.testing.assert_close(payload, expected, rtol=0, atol=0)
        full = torch.randn(6 * n, generator=torch.Generator().manual_seed(rank))
        mine = torch.empty(6)
        dist.reduce_scatter_tensor(mine, full.clone(), group=group)
        out = torch.empty(6)
        comm.reduce_scatter(out, full, tag=3)
        torch.testing.assert_close(out, mine)  # the same sum, up to the order of additions


@distributed(2)
def test_clipping_matches_single_process() -> None:
    """``max_norm`` clips by the global norm over every rank's gradient shards."""
    max_norm = 0.5  # gradient norms here are 1-3: active at every step

    @parameterize("precision", ["fp32", "bf16"])
    def case(precision: str) -> None:
        norms: list[float] = []

        def clip(grads: list[torch.Tensor]) -> None:
            norms.append(float(nn.utils.clip_grad_norm_(grads, max_norm)))

        losses, ref_losses, gemini, ref, _ = train_both(precision, clip=clip, max_norm=max_norm)
        assert min(norms) > max_norm  # the clip was active
        loss_tol = TOL[precision][0]
        torch.testing.assert_close(losses, ref_losses, rtol=loss_tol, atol=loss_tol)
        assert_matches(gemini, ref, precision)

    case()


@distributed(2)
def test_accumulation_under_no_sync_equals_large_batch() -> None:
    """Micro-batches under ``no_sync`` (and without it) add up to one step on their union."""
    rank, world_size, accum = dist.get_rank(), dist.get_world_size(), 2

    @parameterize("precision", ["fp32", "bf16", "fp16"])
    @parameterize("use_no_sync", [True, False])
    def case(precision: str, use_no_sync: bool) -> None:
        if not use_no_sync and precision != "fp32":
            return  # plain repeated backward takes the same path; fp32 shows it exactly
        torch.manual_seed(0)
        model = tiny_gpt2()
        ref = Reference(copy.deepcopy(model), precision)
        gemini, opt = wrap(model, precision)
        micro = batches(accum, seed=3) * STEPS  # STEPS windows of the same micro-batches
        for i, ids in enumerate(micro):
            last = (i + 1) % accum == 0
            loss = lm_loss(gemini, shard(ids, rank, world_size)) / accum
            if use_no_sync and not last:
                with opt.no_sync():
                    opt.backward(loss)
            else:
                opt.backward(loss)
            if last:
                opt.step()
                opt.zero_grad()
                ref.backward(lm_loss(ref.model, torch.cat(micro[i + 1 - accum : i + 1])))
                ref.step()
        assert_matches(gemini, ref, precision)

    case()


@distributed(2)
def test_static_placement_fractions_and_hybrid_adam() -> None:
    """Kept-gathered chunks (``shard_param_frac``), host-resident shards and optimizer states
    (``offload_*_frac``, the ``cpu`` alias) and ``GeminiAdamOptimizer`` train like the
    reference (HybridAdam on fp32 masters)."""
    from kolossos.nn.optimizer import HybridAdam
    from kolossos.zero.gemini import GeminiAdamOptimizer

    rank = dist.get_rank()
    placements: dict[str, dict[str, Any]] = {
        "half_sharded": {"shard_param_frac": 0.5, "offload_optim_frac": 0.5},
        "offloaded": {"offload_optim_frac": 1.0, "offload_param_frac": 0.5},
        "cpu_alias": {"placement_policy": "cpu"},
        "auto_margin": {"placement_policy": "auto", "device_memory_budget": 1_000_000},
    }

    @parameterize("placement", list(placements))
    def case(placement: str) -> None:
        torch.manual_seed(0)
        model = tiny_gpt2()
        ref = Reference(copy.deepcopy(model), "fp32")
        ref.opt = HybridAdam(ref.master_model.parameters(), lr=LR, weight_decay=0.1, eps=1e-3)
        gemini = GeminiDDP(model, chunk_config_dict=CHUNK, mixed_precision=torch.float32,
                           **placements[placement])  # fmt: skip
        margin = 0.5 if placement == "auto_margin" else 0.0
        opt = GeminiAdamOptimizer(
            gemini, lr=LR, weight_decay=0.1, eps=1e-3, gpu_margin_mem_ratio=margin
        )
        chunks = gemini.chunk_manager.chunks
        if placement == "half_sharded":
            assert 0 < sum(c.keep_gathered for c in chunks) < len(chunks)
        if placement != "half_sharded":
            assert all(c.optim_on_host for c in chunks)  # auto: until the margin grants
        for ids in same_batch(STEPS):
            loss = lm_loss(gemini, shard(ids, rank, 2))
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            ref_loss = lm_loss(ref.model, ids)
            ref.backward(ref_loss)
            ref.step()
            torch.testing.assert_close(global_mean(loss), ref_loss.item(), rtol=1e-5, atol=1e-5)
        assert_matches(gemini, ref, "fp32")
        if placement == "auto_margin":  # after warm-up, the margin took some optimizer data
            granted = sum(not c.optim_on_host for c in chunks)
            assert 0 < granted < len(chunks)

    case()


@distributed(2)
def test_full_tensors_and_states_round_trip() -> None:
    """``named_full_tensors`` / ``full_state_items`` give the reference's full values; loading
    them into a fresh wrap resumes training identically."""
    rank = dist.get_rank()
    _, _, gemini, ref, opt = train_both("bf16")
    states = {n: {k: v.clone() for k, v in s.items()} for n, s in opt.full_state_items()}
    ref_names = {p: n for n, p in ref.master_model.named_parameters()}
    for p, s in ref.opt.state.items():
        # bf16 gradients round differently on other CPUs (torch picks kernels by instruction
        # set): single elements differ by up to ~7e-3, and tensors of rounding-noise size
        # (the key bias, whose gradient is zero in exact arithmetic) by ~26% of their norm.
        # Another parameter's state, or a fresh zero state, is off by >= 100%.
        got, want = states[ref_names[p]]["exp_avg"], s["exp_avg"]
        torch.testing.assert_close(got, want, rtol=0.05, atol=1e-2)
        assert float((got - want).norm() / want.norm()) < 0.5, ref_names[p]
        assert float(states[ref_names[p]]["step"]) == float(s["step"]) == STEPS
    tensors = full_params(gemini)
    assert "lm_head.weight" not in tensors and gemini.tied_aliases() == {
        "lm_head.weight": "transformer.wte.weight"
    }
    assert gemini.full_shapes()["lm_head.weight"] == (VOCAB, 32)
    torch.manual_seed(1)
    fresh, fresh_opt = wrap(tiny_gpt2(), "bf16")
    assert fresh.load_full_tensors(tensors.items()) >= set(tensors) - {"lm_head.weight"}
    assert fresh_opt.load_full_states(states.items()) == set(states)
    ids = shard(batches(1, seed=9)[0], rank, 2)
    for model, optim in ((gemini, opt), (fresh, fresh_opt)):
        optim.backward(lm_loss(model, ids))
        optim.step()
        optim.zero_grad()
    a, b = full_params(gemini), full_params(fresh)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)
    assert_moved(tensors, b, TOL["fp32"][1])  # the resumed step really moved the weights


@distributed(2)
def test_fp16_overflow_skips_the_step_on_every_rank() -> None:
    """A loss scale too large for fp16 overflows the gradients: the step is skipped on every rank
    (parameters unchanged, gradients dropped) and the scale backs off after ``hysteresis``."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    gemini = GeminiDDP(
        tiny_gpt2(), chunk_config_dict=CHUNK, mixed_precision=torch.float16, force_outputs_fp32=True
    )
    out = gemini(input_ids=batches(1)[0])
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"  # the container survives
    assert out.logits.dtype == torch.float32
    opt = GeminiOptimizer(adamw(gemini.parameters()), gemini, hysteresis=2)  # scale 2**32
    before = full_params(gemini)
    scales = []
    for ids in batches(2):
        opt.backward(lm_loss(gemini, shard(ids, rank, 2)))
        assert opt.step() is None and opt.last_step_skipped
        scales.append(opt.loss_scale)
        assert all(c.grad_shard is None for c in gemini.chunk_manager.chunks)
    assert scales == [2.0**32, 2.0**31]  # tolerated once, then backed off
    after = full_params(gemini)
    assert all(torch.equal(before[n], after[n]) for n in before)


class TwoGroupNet(nn.Module):
    """Parameters for two optimizer groups, one frozen and one never used in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 24)
        self.head = nn.Linear(24, 8)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.unused = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.frozen(x))))


def two_groups(model: nn.Module) -> torch.optim.Optimizer:
    net: Any = model
    decay = [net.body.weight, net.head.weight]
    rest = [net.body.bias, net.head.bias, net.unused, *net.frozen.parameters()]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "lr": 3e-3, "weight_decay": 0.5}],
        lr=1e-2,
    )


@distributed(2)
def test_param_groups_frozen_and_unused_parameters() -> None:
    """Groups keep their hyper-parameters (an LR scheduler still drives them); a frozen parameter
    is left alone; a parameter without gradients is not stepped (not even decayed), as in torch;
    ``param_names`` lists each group's parameters."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TwoGroupNet()
    reference = copy.deepcopy(model)
    initial = snapshot(model)
    gemini = GeminiDDP(model, chunk_config_dict={"chunk_size": 64}, mixed_precision=torch.float32)
    opt = GeminiOptimizer(two_groups(gemini.module), gemini)
    assert opt.param_names() == [
        ["body.weight", "head.weight"],
        ["body.bias", "head.bias", "unused", "frozen.weight", "frozen.bias"],
    ]
    sched = torch.optim.lr_scheduler.StepLR(opt.optim, step_size=1, gamma=0.5)
    ref_opt = two_groups(reference)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    gen = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 8, (8,), generator=gen)
        loss = nn.functional.cross_entropy(gemini(shard(x, rank, 2)), shard(y, rank, 2))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        sched.step()
        nn.functional.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
    full = full_params(gemini)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-5, msg=name)
    assert_moved(initial, full, 1e-5, exclude=("frozen.weight", "frozen.bias", "unused"))


@distributed(2)
def test_nvme_offloaded_states_match_in_memory_ones() -> None:
    """HybridAdam's NVMe offload chooses among the master shards (host chunks, ``cpu``
    placement): states go to disk, training and ``full_state_items`` are bit-identical."""
    from kolossos.nn.optimizer import HybridAdam

    rank = dist.get_rank()
    params, states = {}, {}
    for fraction in (0.0, 1.0):
        torch.manual_seed(0)
        model = tiny_gpt2()
        initial = snapshot(model)
        gemini = GeminiDDP(model, chunk_config_dict=CHUNK, mixed_precision=torch.float32,
                           placement_policy="cpu")  # fmt: skip
        adam = HybridAdam(gemini.parameters(), lr=1e-2, nvme_offload_fraction=fraction)
        opt = GeminiOptimizer(adam, gemini)
        assert (adam.nvme_offloaded_bytes > 0) == (fraction > 0)
        for ids in batches(2):
            opt.backward(lm_loss(gemini, shard(ids, rank, 2)))
            opt.step()
            opt.zero_grad()
        params[fraction] = full_params(gemini)
        states[fraction] = {n: {k: v.clone() for k, v in s.items()} for n, s in
                            opt.full_state_items()}  # fmt: skip
        adam.close()
    for name, value in params[0.0].items():
        assert torch.equal(value, params[1.0][name]), name
    assert_moved(initial, params[1.0], TOL["fp32"][1])  # bit-identical after real steps
    assert states[0.0].keys() == states[1.0].keys()
    for name, entry in states[0.0].items():
        assert entry.keys() == states[1.0][name].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(v, states[1.0][name][k]) for k, v in entry.items()), name
