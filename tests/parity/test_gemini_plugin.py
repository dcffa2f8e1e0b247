"""GeminiPlugin through the Booster against one process, on 2 ranks: ``boost``,
``booster.backward``, clipping (``max_norm`` and ``clip_grad_by_norm``) and gradient accumulation
with ``booster.no_sync``.

Small on purpose: the sweep over chunk layouts, placements and precisions is in the tests of
``GeminiDDP`` / ``GeminiOptimizer``; this file checks that the plugin composes them correctly.
The model is a tiny GPT-2 with tied embeddings, split into several chunks (4-8 Ki-element chunk
search), so parameters are sharded, gathered and reduce-scattered chunk by chunk. The reference
trains the global batch in one process with the plugin's precision recipe.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kolossos.booster import Booster
from kolossos.booster.plugin.gemini_plugin import GeminiPlugin
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import assert_moved, assert_params_close, global_mean, shard, snapshot

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 8, 8, 16, 64
LR = 3e-2
CHUNKS = {"hidden_dim": 32, "min_chunk_size_m": 4096 / 2**20, "search_range_m": 4096 / 2**20}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# AdamW with eps=1e-2 (see ``adamw``) trains STEPS steps on one repeated batch, so that the
# parameters move by several times LR (assert_moved). (loss, parameter) rtol = atol. fp32: only
# the order of the gradient sums differs (per-rank means averaged vs one mean). bf16: each rank
# rounds its own activations and gradients (measured worst on parameters: 1.4e-3). With eps=1e-6
# the bf16 parameter tolerance was 4e-2, a few learning rates: Adam turned a rounding difference
# in a near-zero gradient into a whole lr-sized step, and the parameters moved no further than
# that in 3 steps, so the check passed without any step.
TOL = {"fp32": (1e-5, 1e-5), "bf16": (2e-2, 3e-3)}
# bf16: the slowest parameter (a LayerNorm bias, whose gradient stays below eps) moves by 3.6x
# the tolerance, so there every parameter must move by 2x the tolerance and the largest move (19
# x 3e-3) by 10x.
EACH = {"fp32": None, "bf16": 2.0}
Clip = Callable[[Any], float]


@pytest.fixture(scope="module")
def gpt2() -> Callable[[], nn.Module]:
    """transformers' GPT-2, imported once in the parent so that forked ranks inherit it."""
    modeling = pytest.importorskip("transformers.models.gpt2.modeling_gpt2")
    config = modeling.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return lambda: modeling.GPT2LMHeadModel(config)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    # eps=1e-2: Adam's update for a gradient below eps stays proportional to it, instead of a
    # whole lr-sized step whose sign rounding noise decides (the key biases' true gradient is
    # zero: softmax ignores a constant shift)
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=1e-2)


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits.float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def batches(count: int, seed: int = 7) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen) for _ in range(count)]


class Reference:
    """One process, the plugin's recipe: working weights in ``dtype``, fp32 masters in AdamW."""

    def __init__(self, model: nn.Module, precision: str) -> None:
        self.initial = snapshot(model)
        self.master_model = copy.deepcopy(model).float()  # before the cast: exact masters
        self.model = model.to(DTYPES[precision])
        self.opt = adamw(self.master_model)
        self.pairs = list(zip(self.master_model.parameters(), self.model.parameters(), strict=True))

    def backward(self, loss: torch.Tensor) -> list[torch.Tensor]:
        """Backward, then the fp32 gradients on the masters (those with one are returned, for
        clipping)."""
        loss.backward()
        for master, p in self.pairs:
            master.grad = None if p.grad is None else p.grad.float()
        return [m for m, _ in self.pairs if m.grad is not None]

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()
        self.model.zero_grad()
        with torch.no_grad():
            for master, p in self.pairs:
                p.copy_(master)


def full_params(boosted: Any, reference: nn.Module) -> dict[str, torch.Tensor]:
    """The boosted model's gathered parameters under the reference's (first) names."""
    names = dict(reference.named_parameters())
    full = {n: t.clone() for n, t in boosted.named_full_tensors()}  # collective
    assert names.keys() <= full.keys(), sorted(names.keys() - full.keys())
    return {n: full[n] for n in names}


def train_both(
    make: Callable[[], nn.Module],
    precision: str,
    gemini_clip: Clip | None = None,
    ref_clip: Callable[[list[torch.Tensor]], float] | None = None,
    **plugin_kwargs: Any,
) -> tuple[list[float], list[float], list[tuple[float, float]], Any, Reference]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = make()
    ref = Reference(copy.deepcopy(model), precision)
    plugin = GeminiPlugin(precision=precision, initial_scale=1, **CHUNKS, **plugin_kwargs)
    booster = Booster(plugin=plugin)
    boosted, opt, _, _, _ = booster.boost(model, adamw(model))
    losses, ref_losses, norms = [], [], []
    # one batch, repeated: every step pushes a parameter the same way, so Adam moves it by ~LR
    for ids in batches(1) * STEPS:
        loss = lm_loss(boosted, shard(ids, rank, 2))
        booster.backward(loss, opt)
        norm = gemini_clip(opt) if gemini_clip is not None else 0.0
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
        ref_loss = lm_loss(ref.model, ids)
        grads = ref.backward(ref_loss)
        norms.append((norm, ref_clip(grads) if ref_clip is not None else 0.0))
        ref.step()
        ref_losses.append(ref_loss.item())
    return losses, ref_losses, norms, boosted, ref


@distributed(2)
def test_plugin_matches_single_process(gpt2: Callable[[], nn.Module]) -> None:
    """Placements (static on device, everything offloaded, auto under a 1 MiB budget) and
    precisions give the single-process losses and parameters."""
    placements: dict[str, dict[str, Any]] = {
        "static": {},
        "cpu": {"placement_policy": "cpu", "pin_memory": True},
        "auto": {
            "placement_policy": "auto",
            "device_memory_budget": 2**20,
        },
    }

    @parameterize("precision", ["fp32", "bf16"])
    @parameterize("placement", list(placements))
    def case(precision: str, placement: str) -> None:
        if precision == "bf16" and placement != "static":
            return  # bf16 x placements is the core tests' sweep
        losses, ref_losses, _, boosted, ref = train_both(gpt2, precision, **placements[placement])
        loss_tol, param_tol = TOL[precision]
        torch.testing.assert_close(losses, ref_losses, rtol=loss_tol, atol=loss_tol)
        full = full_params(boosted, ref.master_model)
        assert_params_close(
            full.items(), ref.master_model.named_parameters(), rtol=param_tol, atol=param_tol
        )
        assert_moved(ref.initial, full, param_tol, each=EACH[precision])

    case()


@distributed(2)
def test_clipping_matches_single_process(gpt2: Callable[[], nn.Module]) -> None:
    """``max_norm`` (every step) and ``optimizer.clip_grad_by_norm`` (2- and inf-norm) against
    ``torch.nn.utils.clip_grad_norm_`` on the reference's full gradients."""

    # Active at every step, not so tight that the parameters stop moving: the gradients'
    # 2-norms here are above 1, their inf-norms above 0.05.
    limit = {2.0: 0.5, float("inf"): 0.05}

    def norm_clip(norm_type: float) -> tuple[Clip, Callable[[list[torch.Tensor]], float]]:
        return (
            lambda opt: float(opt.clip_grad_by_norm(limit[norm_type], norm_type)),
            lambda grads: float(nn.utils.clip_grad_norm_(grads, limit[norm_type], norm_type)),
        )

    clips: dict[str, tuple[Clip | None, Callable[[list[torch.Tensor]], float], dict[str, Any]]]
    clips = {
        "max_norm": (None, norm_clip(2.0)[1], {"max_norm": limit[2.0]}),
        "norm": (*norm_clip(2.0), {}),
        "inf": (*norm_clip(float("inf")), {}),
    }

    @parameterize("mode", list(clips))
    def case(mode: str) -> None:
        gemini_clip, ref_clip, kwargs = clips[mode]
        losses, ref_losses, norms, boosted, ref = train_both(
            gpt2, "fp32", gemini_clip, ref_clip, **kwargs
        )
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
        full = full_params(boosted, ref.master_model)
        assert_params_close(full.items(), ref.master_model.named_parameters(), rtol=1e-5, atol=1e-5)
        assert_moved(ref.initial, full, 1e-5)
        gemini_norms, ref_norms = zip(*norms, strict=True)
        assert min(ref_norms) > limit[float("inf") if mode == "inf" else 2.0]  # the clip acted
        if mode != "max_norm":
            torch.testing.assert_close(gemini_norms, ref_norms, rtol=1e-5, atol=1e-6)

    case()


@distributed(2)
def test_accumulation_with_no_sync_equals_large_batch(gpt2: Callable[[], nn.Module]) -> None:
    """Micro-batches under ``booster.no_sync`` (and plain repeated backward passes) followed by
    one synchronising backward equal one step on the concatenated batch."""
    rank, accum = dist.get_rank(), 2

    @parameterize("use_no_sync", [True, False])
    def case(use_no_sync: bool) -> None:
        torch.manual_seed(0)
        model = gpt2()
        ref = Reference(copy.deepcopy(model), "fp32")
        booster = Booster(plugin=GeminiPlugin(precision="fp32", **CHUNKS))
        boosted, opt, _, _, _ = booster.boost(model, adamw(model))
        micro = batches(2 * accum, seed=3)
        for i, ids in enumerate(micro):
            last = (i + 1) % accum == 0
            loss = lm_loss(boosted, shard(ids, rank, 2)) / accum
            if use_no_sync and not last:
                with booster.no_sync(boosted, opt):
                    booster.backward(loss, opt)
            else:
                booster.backward(loss, opt)
            if last:
                opt.step()
                opt.zero_grad()
                ref.backward(lm_loss(ref.model, torch.cat(micro[i + 1 - accum : i + 1])))
                ref.step()
        full = full_params(boosted, ref.master_model)
        assert_params_close(full.items(), ref.master_model.named_parameters(), rtol=1e-5, atol=1e-5)
        assert_moved(ref.initial, full, 1e-5)

    case()
