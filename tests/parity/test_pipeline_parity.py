"""Pipeline schedules vs single-process training on CPU/gloo.

Every rank builds the same seeded ``nn.Sequential``; the reference trains the whole model on the
global batch in-process, the pipelined copy keeps this rank's layers (``build_pipeline_model``)
and runs ``forward_backward_step`` over the micro-batches. Losses are compared at every step
(broadcast from the rank holding the last stage), parameters at the end (each rank checks its own
layers, whose names match the full model's), and the losses of all schedules against each
other. One spawned job per world size; schedules are swept inside it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kolossos.cluster import ProcessGroupMesh
from kolossos.pipeline import (
    PipelineSharedModuleWrapper,
    PipelineStageManager,
    build_pipeline_model,
    create_schedule,
)
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import assert_moved, make_classification_batches

STEPS = 3
GLOBAL_BATCH = 16
# fp32 throughout. The pipeline sums per-micro-batch means and accumulates per-micro-batch
# gradients where the reference reduces the whole batch at once: only the summation order
# differs, a few ulps, which AdamW's normalisation can grow to ~1e-6 on near-zero gradients.
TOL = 1e-5
SCHEDULES = {"gpipe": (1, "loop"), "1f1b": (1, "loop"), "interleaved": (2, "loop"),
             "zbh1": (1, "loop"), "zbv": (2, "v")}  # fmt: skip


def mlp() -> nn.Sequential:
    """Eight layers with parameters, so 4 ranks x 2 chunks get one layer each."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6)]
    return nn.Sequential(nn.Sequential(nn.Linear(16, 32), nn.GELU()), *blocks, nn.Linear(32, 8))


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def manager(mesh: ProcessGroupMesh, schedule: str) -> PipelineStageManager:
    chunks, layout = SCHEDULES[schedule]
    return PipelineStageManager(mesh, "pp", num_model_chunks=chunks, layout=layout)


def last_stage_value(value: torch.Tensor | None, sm: PipelineStageManager) -> float:
    """The loss, broadcast from the rank holding the last virtual stage."""
    owner = sm.global_rank(sm.owner(sm.num_virtual_stages - 1)[0])
    t = value.detach().reshape(1).clone() if value is not None else torch.zeros(1)
    dist.broadcast(t, src=owner, group=sm.group)
    return float(t.item())


def train_reference(model: nn.Module, batches: list[Any], loss_fn: Any) -> list[float]:
    opt, losses = adamw(model.parameters()), []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_pipeline(
    model: nn.Module, sm: PipelineStageManager, schedule: str, batches: list[Any], loss_fn: Any,
    m: int, wrap: Any = None,
) -> tuple[list[float], nn.Module, Any]:  # fmt: skip
    chunks = build_pipeline_model(model, sm.num_model_chunks, stage_manager=sm)
    if wrap is not None:
        wrap(chunks)
    runner = create_schedule(schedule, sm, num_microbatches=m)
    opt, losses = adamw(chunks.parameters()), []
    for batch in batches:
        out = runner.forward_backward_step(chunks, iter([batch]), loss_fn)
        opt.step()
        opt.zero_grad()
        losses.append(last_stage_value(out["loss"], sm))
    return losses, chunks, runner


def initial_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The untrained parameters by name, tied ones under each of their names."""
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def assert_layers_match(
    chunks: nn.Module, reference: nn.Module, initial: dict[str, torch.Tensor]
) -> None:
    """This rank's layers equal the reference's, and moved by 10x the tolerance."""
    expected = dict(reference.named_parameters(remove_duplicate=False))
    mods = chunks if isinstance(chunks, nn.ModuleList) else [chunks]
    mine = {}
    for chunk in mods:
        for name, p in chunk.named_parameters(remove_duplicate=False):
            torch.testing.assert_close(p, expected[name], rtol=TOL, atol=TOL, msg=name)
            mine[name] = p
    assert_moved(initial, mine, TOL)


@pytest.mark.parametrize("world_size", [2, 4])
@distributed(timeout=120)
def test_schedules_match_single_process(world_size: int) -> None:
    mesh = ProcessGroupMesh(world_size, axis_names=("pp",))
    batches = make_classification_batches(STEPS, GLOBAL_BATCH)
    m = 2 * world_size
    ref_model = mlp()
    ref_losses = train_reference(ref_model, batches, F.cross_entropy)
    all_losses: dict[str, list[float]] = {}

    @parameterize("schedule", list(SCHEDULES))
    def case(schedule: str) -> None:
        sm = manager(mesh, schedule)
        losses, chunks, runner = train_pipeline(mlp(), sm, schedule, batches, F.cross_entropy, m)
        torch.testing.assert_close(losses, ref_losses, rtol=TOL, atol=TOL)
        assert_layers_match(chunks, ref_model, initial_params(mlp()))
        all_losses[schedule] = losses
        check_live_activations(schedule, sm, runner.last_stats, m)

    case()
    for schedule, losses in all_losses.items():  # every schedule computes the same numbers
        torch.testing.assert_close(losses, all_losses["1f1b"], rtol=1e-6, atol=1e-7, msg=schedule)


def check_live_activations(schedule: str, sm: PipelineStageManager, stats: Any, m: int) -> None:
    """The executor's counter (activations alive from F to the last backward part) against each
    schedule's design: 1F1B keeps at most p - r micro-batches on rank r (<= p), GPipe all m."""
    p, r = sm.pp_size, sm.stage
    expected = {"gpipe": m, "1f1b": p - r, "zbh1": p}
    if schedule in expected:
        assert stats.peak_live == expected[schedule], (schedule, r, stats.peak_live)
    if schedule == "1f1b":
        assert stats.peak_live <= p
    assert stats.split_fallbacks == 0  # zero-bubble schedules really split every backward
    if schedule == "zbv":  # 2p chunk-micro-batches: the activations of p whole-rank ones
        assert stats.peak_live <= 2 * p
    if schedule == "interleaved":  # Megatron's warm-up, plus the one of the steady state
        v = sm.num_model_chunks
        assert stats.peak_live == min(2 * (p - r - 1) + (v - 1) * p + 1, v * m)


class Tied(nn.Sequential):
    """Token embedding, blocks, and an LM head tied to the embedding (GPT-style)."""


def tied_lm() -> nn.Sequential:
    torch.manual_seed(0)
    emb = nn.Embedding(32, 16)
    head = nn.Linear(16, 32, bias=False)
    head.weight = emb.weight
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)]
    return nn.Sequential(emb, *blocks, head)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))


@distributed(4, timeout=120)
def test_tied_weights_across_stages() -> None:
    """PipelineSharedModuleWrapper([0, p-1]) keeps the embedding (first stage) and the head
    (last stage) equal to the single-process tied parameter; with ZB-V both ends live on rank 0
    and plain tying inside the rank suffices."""
    mesh = ProcessGroupMesh(4, axis_names=("pp",))
    gen = torch.Generator().manual_seed(3)
    batches = [
        (ids, ids) for ids in (torch.randint(0, 32, (8, 6), generator=gen) for _ in range(3))
    ]
    ref_model = tied_lm()
    ref_losses = train_reference(ref_model, batches, lm_loss)

    @parameterize("schedule", ["1f1b", "zbh1", "zbv"])
    def case(schedule: str) -> None:
        sm = manager(mesh, schedule)
        wrapper = PipelineSharedModuleWrapper([0, 3], stage_manager=sm)

        def share(chunks: nn.Module) -> None:
            if schedule == "zbv":
                return
            if sm.is_first_stage():
                wrapper.register_parameter(chunks[0].weight)
            elif sm.is_last_stage():
                wrapper.register_parameter(chunks[-1].weight)

        losses, chunks, runner = train_pipeline(tied_lm(), sm, schedule, batches, lm_loss, 4, share)
        torch.testing.assert_close(losses, ref_losses, rtol=TOL, atol=TOL)
        assert_layers_match(chunks, ref_model, initial_params(tied_lm()))
        # accumulating two steps gives twice one step's gradient, shared parameters included
        grads = []
        for calls in (1, 2):
            chunks.zero_grad()
            for _ in range(calls):
                runner.forward_backward_step(chunks, iter([batches[0]]), lm_loss)
            grads.append([p.grad.clone() for p in chunks.parameters()])
        for once, twice in zip(*grads, strict=True):
            torch.testing.assert_close(twice, 2 * once, rtol=1e-5, atol=1e-7)

    case()


@pytest.fixture(scope="module")
def gpt2() -> Any:
    """transformers' GPT-2, imported once in the parent so that forked ranks inherit it."""
    modeling = pytest.importorskip("transformers.models.gpt2.modeling_gpt2")
    config = modeling.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip

    def build() -> nn.Module:
        torch.manual_seed(0)
        return modeling.GPT2LMHeadModel(config)

    return build


class Embedding(nn.Module):
    def __init__(self, transformer: Any) -> None:
        super().__init__()
        self.wte, self.wpe = transformer.wte, transformer.wpe

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))[None]


class Block(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.block(hidden)  # causal: SDPA without a mask
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    def __init__(self, transformer: Any, lm_head: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = transformer.ln_f, lm_head  # lm_head.weight is wte.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


def gpt2_stages(model: Any) -> nn.Sequential:
    """The HF model cut by hand: embedding, one stage per block, head (sharing its modules)."""
    t = model.transformer
    return nn.Sequential(Embedding(t), *(Block(b) for b in t.h), Head(t, model.lm_head))


def shifted_lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@distributed(2, timeout=120)
def test_gpt2_split_by_hand(gpt2: Any) -> None:
    """A tiny GPT-2 cut into embedding / blocks / head stages trains like the HF model; the tied
    embedding and LM head live on different ranks (shared through the wrapper) or on the same
    rank (ZB-V: plain tying)."""
    mesh = ProcessGroupMesh(2, axis_names=("pp",))
    gen = torch.Generator().manual_seed(5)
    batches = [
        (ids, ids) for ids in (torch.randint(0, 64, (8, 8), generator=gen) for _ in range(3))
    ]
    reference = gpt2()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    ref_losses = []
    for ids, _ in batches:
        loss = shifted_lm_loss(reference(input_ids=ids).logits, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())

    @parameterize("schedule", ["1f1b", "interleaved", "zbh1", "zbv"])
    def case(schedule: str) -> None:
        sm = manager(mesh, schedule)
        first, last = sm.owner(0)[0], sm.owner(sm.num_virtual_stages - 1)[0]
        chunks = build_pipeline_model(gpt2_stages(gpt2()), sm.num_model_chunks, stage_manager=sm)
        mods = list(chunks) if isinstance(chunks, nn.ModuleList) else [chunks]
        if first != last:  # the tie crosses ranks
            wrapper = PipelineSharedModuleWrapper([first, last], stage_manager=sm)
            for c, mod in enumerate(mods):
                stage = sm.stage_index(c)
                if stage in (0, sm.num_virtual_stages - 1):
                    end = mod[0] if stage == 0 else mod[-1]
                    wrapper.register_parameter(end.wte.weight if stage == 0 else end.lm_head.weight)
        params = list({id(p): p for m in mods for p in m.parameters()}.values())
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-6)
        runner = create_schedule(schedule, sm, num_microbatches=4)
        losses = []
        for batch in batches:
            out = runner.forward_backward_step(chunks, iter([batch]), shifted_lm_loss)
            opt.step()
            opt.zero_grad()
            losses.append(last_stage_value(out["loss"], sm))
        torch.testing.assert_close(losses, ref_losses, rtol=TOL, atol=TOL)
        assert_layers_match(chunks, gpt2_stages(reference), initial_params(gpt2_stages(gpt2())))
        assert runner.last_stats.split_fallbacks == 0

    case()
