"""LowLevelZeroPlugin (ZeRO-1/2) vs single-process training on CPU/gloo.

The reference keeps the plugin's precision recipe in one process: working weights in the
plugin's dtype, fp32 master weights stepped by AdamW, fp16 loss scaling with the same scale. It
trains on the whole global batch; each ZeRO rank on its shard. Sweeps run inside one process group
per (world size, stage) with ``parameterize``. Buckets are tiny (100 elements), so parameters are
split over buckets and partitions.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kolossos.booster import Booster
from kolossos.booster.plugin import LowLevelZeroPlugin
from kolossos.interface import unwrap_model
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import (
    TinyMLP,
    assert_moved,
    assert_params_close,
    assert_same_on_all_ranks,
    global_mean,
    make_classification_batches,
    shard,
    snapshot,
)
from kolossos.utils.profiling import CommCounter

STEPS = 8
GLOBAL_BATCH = 16
LR = 3e-2
SCALE = 2.0**10  # fp16 loss scale: no overflow with these models
BUCKET_M = 100 / 2**20  # 100-element buckets
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# AdamW with eps=1e-3 (see ``adamw``) trains STEPS steps on one repeated batch, so that every
# parameter moves by several times LR (assert_moved). (loss, parameters) rtol = atol. fp32 differs
# only in the order of the gradient sums. In fp16/bf16 each rank rounds its own shard's gradients
# and the reduction runs in that dtype (measured worst on TinyMLP's parameters, 2 and 4 ranks:
# fp16 4.9e-4, bf16 5.9e-3). With Adam's default eps=1e-8 the tolerances were a few learning
# rates (bf16 4e-2, fp16 2e-2): Adam turned a rounding difference in a near-zero gradient into a
# whole lr-sized step, and the parameters moved no further than that in 4 steps, so the check
# passed without any step.
TOL = {"fp32": (1e-5, 1e-5), "bf16": (2e-2, 1.5e-2), "fp16": (2e-3, 2e-3)}
Clip = Callable[[Any], float]


def criterion(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float(), y)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    # eps=1e-3: Adam's update for a gradient below eps stays proportional to it, instead of a
    # whole lr-sized step whose sign rounding noise decides
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=1e-3)


class Reference:
    """One process, the plugin's precision recipe: low-precision model, fp32 masters."""

    def __init__(
        self, model: nn.Module, precision: str, make_opt: Callable[[nn.Module], Any] = adamw
    ) -> None:
        self.dtype = DTYPES[precision]
        self.initial = snapshot(model)
        self.model = model.to(self.dtype)
        self.scale = SCALE if precision == "fp16" else 1.0
        master_model = copy.deepcopy(model).float()
        self.opt = make_opt(master_model)
        self.masters = list(master_model.parameters())

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return criterion(self.model(x.to(self.dtype)), y)

    def backward(self, loss: torch.Tensor) -> list[torch.Tensor]:
        """Backward, then the unscaled fp32 gradients on the masters (returned)."""
        (loss * self.scale).backward()
        for master, p in zip(self.masters, self.model.parameters(), strict=True):
            if p.grad is not None:
                master.grad = p.grad.float() / self.scale
        return [m for m in self.masters if m.grad is not None]

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()
        self.model.zero_grad()
        with torch.no_grad():
            for master, p in zip(self.masters, self.model.parameters(), strict=True):
                p.copy_(master)


def boost(
    model: nn.Module, make_opt: Callable[[nn.Module], Any] = adamw, **plugin_kwargs: Any
) -> tuple[Booster, Any, Any]:
    kwargs: dict[str, Any] = {"initial_scale": SCALE, "reduce_bucket_size_in_m": BUCKET_M}
    booster = Booster(plugin=LowLevelZeroPlugin(**(kwargs | plugin_kwargs)))
    boosted, opt, _, _, _ = booster.boost(model, make_opt(model))
    return booster, boosted, opt


def train_both(
    world: int,
    precision: str,
    zero_clip: Clip | None = None,
    ref_clip: Clip | None = None,
    **plugin_kwargs: Any,
) -> tuple[list[float], list[float], nn.Module, Reference, list[tuple[float, float]]]:
    """Train TinyMLP with the plugin and with the reference; return both loss curves, both
    models and the (ZeRO, reference) values returned by the clip functions."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyMLP()
    ref = Reference(copy.deepcopy(model), precision)
    booster, boosted, opt = boost(model, precision=precision, **plugin_kwargs)
    losses, ref_losses, norms = [], [], []
    # one batch repeated: every step pushes a parameter the same way, so Adam moves it by ~LR
    for x, y in make_classification_batches(1, GLOBAL_BATCH) * STEPS:
        loss = criterion(boosted(shard(x, rank, world)), shard(y, rank, world))
        booster.backward(loss, opt)
        norm = zero_clip(opt) if zero_clip is not None else 0.0
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
        ref_loss = ref.loss(x, y)
        grads = ref.backward(ref_loss)
        norms.append((norm, ref_clip(grads) if ref_clip is not None else 0.0))
        ref.step()
        ref_losses.append(ref_loss.item())
    return losses, ref_losses, unwrap_model(boosted), ref, norms


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_matches_single_process(world_size: int, stage: int) -> None:
    @parameterize("precision", ["fp32", "bf16", "fp16"])
    @parameterize("overlap", [True, False])
    @parameterize("offload", [False, True])
    def case(precision: str, overlap: bool, offload: bool) -> None:
        losses, ref_losses, trained, ref, _ = train_both(
            world_size, precision, stage=stage, overlap_communication=overlap, cpu_offload=offload
        )
        loss_tol, param_tol = TOL[precision]
        torch.testing.assert_close(losses, ref_losses, rtol=loss_tol, atol=loss_tol)
        assert_params_close(trained, ref.model, rtol=param_tol, atol=param_tol)
        assert_moved(ref.initial, trained, param_tol)
        assert_same_on_all_ranks(trained)
        assert next(trained.parameters()).dtype == DTYPES[precision]

    case()


@pytest.mark.parametrize("stage", [1, 2])
@distributed(2)
def test_clipping_matches_single_process(stage: int) -> None:
    """The plugin's ``max_norm``, ``clip_grad_by_norm`` (2-norm and inf-norm) and
    ``clip_grad_by_value`` against torch's clipping of the reference's full gradients."""

    # Active at every step but not so tight that the parameters stop moving: gradient 2-norms
    # here are 0.4-0.55, inf-norms 0.08-0.15, and a third of the elements exceed 0.01.
    limit = {2.0: 0.2, math.inf: 0.05}

    def norm_clip(norm_type: float) -> tuple[Clip, Clip]:
        return (
            lambda opt: float(opt.clip_grad_by_norm(limit[norm_type], norm_type)),
            lambda grads: float(nn.utils.clip_grad_norm_(grads, limit[norm_type], norm_type)),
        )

    def value_clip(opt: Any) -> float:
        opt.clip_grad_by_value(0.01)
        return 0.0

    clips: dict[str, tuple[Clip | None, Clip, dict[str, Any]]] = {
        "plugin": (None, norm_clip(2.0)[1], {"max_norm": limit[2.0]}),
        "norm": (*norm_clip(2.0), {}),
        "inf": (*norm_clip(math.inf), {}),
        "value": (value_clip, lambda g: nn.utils.clip_grad_value_(g, 0.01) or 0.0, {}),
    }

    @parameterize("precision", ["fp32", "bf16"])
    @parameterize("mode", list(clips))
    def case(precision: str, mode: str) -> None:
        zero_clip, ref_clip, kwargs = clips[mode]
        losses, ref_losses, trained, ref, norms = train_both(
            2, precision, zero_clip, ref_clip, stage=stage, **kwargs
        )
        loss_tol, param_tol = TOL[precision]
        torch.testing.assert_close(losses, ref_losses, rtol=loss_tol, atol=loss_tol)
        assert_params_close(trained, ref.model, rtol=param_tol, atol=param_tol)
        assert_moved(ref.initial, trained, param_tol)
        zero_norms, ref_norms = zip(*norms, strict=True)
        if mode != "value":  # the clip was active at every step
            assert min(ref_norms) > limit[math.inf if mode == "inf" else 2.0], ref_norms
        if mode in ("norm", "inf"):
            torch.testing.assert_close(zero_norms, ref_norms, rtol=loss_tol, atol=1e-6)

    case()


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_accumulation_equals_large_batch(world_size: int) -> None:
    """Four backward passes per step, each synchronised (``S``) or under ``no_sync`` (``N``;
    stage 1: no communication, stage 2: still reduces), equal one step on the concatenated
    batch. Stage 1 keeps only gradient partitions while nothing was accumulated locally since
    ``zero_grad`` and its flat gradient buffer after that, so ``SNSN`` crosses both (the
    flat pass adds into partitions a partitioned pass made; the step reduces the last ``N``)."""
    rank, accum = dist.get_rank(), 4

    @parameterize("stage", [1, 2])
    @parameterize("pattern", ["NNNS", "SSSS", "SNSN"])
    @parameterize("precision", ["fp32", "bf16"])
    def case(stage: int, pattern: str, precision: str) -> None:
        torch.manual_seed(0)
        model = TinyMLP()
        ref = Reference(copy.deepcopy(model), precision)
        booster, boosted, opt = boost(model, precision=precision, stage=stage)
        micro = make_classification_batches(accum, 8, seed=3) * STEPS  # STEPS windows
        for i, (x, y) in enumerate(micro):
            xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
            sync = pattern[i % accum] == "S"
            with CommCounter() as comm:
                if sync:
                    booster.backward(criterion(boosted(xs), ys) / accum, opt)
                else:
                    with booster.no_sync(boosted, opt):
                        booster.backward(criterion(boosted(xs), ys) / accum, opt)
            silent = not sync and stage == 1
            assert (comm.calls() == 0) == silent, f"stage {stage}: {comm.calls()} collectives"
            if stage == 1:  # the full gradient buffer exists once something accumulated locally
                local = "N" in pattern[: i % accum + 1]
                assert opt.flat_grads.alive(0) == local, f"{pattern} pass {i % accum}"
            if (i + 1) % accum == 0:
                opt.step()
                opt.zero_grad()
                xs_all = torch.cat([m[0] for m in micro[i + 1 - accum : i + 1]])
                ys_all = torch.cat([m[1] for m in micro[i + 1 - accum : i + 1]])
                ref.backward(ref.loss(xs_all, ys_all))
                ref.step()
        _, param_tol = TOL[precision]
        assert_params_close(unwrap_model(boosted), ref.model, rtol=param_tol, atol=param_tol)
        assert_moved(ref.initial, unwrap_model(boosted), param_tol)

    case()


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
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "lr": 3e-3, "weight_decay": 0}],
        lr=1e-2,
    )


@pytest.mark.parametrize("stage", [1, 2])
@distributed(2)
def test_param_groups_frozen_and_unused_parameters(stage: int) -> None:
    """Groups keep their hyper-parameters (an LR scheduler still drives them); a frozen parameter
    is left alone; a parameter without gradients is not moved (weight decay 0 in its group)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TwoGroupNet()
    reference = copy.deepcopy(model)
    initial = snapshot(model)
    booster = Booster(plugin=LowLevelZeroPlugin(stage=stage, precision="fp32"))
    opt = two_groups(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    boosted, zero, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    ref_opt = two_groups(reference)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for x, y in make_classification_batches(STEPS, GLOBAL_BATCH):
        booster.backward(criterion(boosted(shard(x, rank, 2)), shard(y, rank, 2)), zero)
        zero.step()
        zero.zero_grad()
        sched.step()
        criterion(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
    assert [g["lr"] for g in zero.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    assert_params_close(unwrap_model(boosted), reference, rtol=1e-5, atol=1e-6)
    frozen_or_unused = ("frozen.weight", "frozen.bias", "unused")
    assert_moved(initial, unwrap_model(boosted), 1e-6, exclude=frozen_or_unused)
    assert torch.equal(unwrap_model(boosted).unused, reference.unused)


@pytest.fixture(scope="module")
def gpt2() -> Any:
    """transformers' GPT-2, imported once in the parent so that forked ranks inherit it."""
    modeling = pytest.importorskip("transformers.models.gpt2.modeling_gpt2")
    config = modeling.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return lambda: modeling.GPT2LMHeadModel(config)


@distributed(2)
def test_gpt2_with_tied_embeddings(gpt2: Any) -> None:
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(7)
    # one batch, repeated; 8 sequences: with 4, bf16 rounding differences reach 1.6e-2
    tokens = [torch.randint(0, 64, (8, 16), generator=gen)] * STEPS

    def make_opt(model: nn.Module) -> torch.optim.Optimizer:
        # The key biases' gradients are zero up to rounding noise (softmax ignores a constant
        # shift); Adam with eps=1e-8 would blow that noise up to lr-sized steps on either side.
        return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=1e-3)

    def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids).logits.float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))

    @parameterize("stage", [1, 2])
    @parameterize("precision", ["fp32", "bf16"])
    def case(stage: int, precision: str) -> None:
        torch.manual_seed(0)
        model = gpt2()
        ref = Reference(copy.deepcopy(model), precision, make_opt)
        booster, boosted, opt = boost(model, make_opt, precision=precision, stage=stage)
        assert unwrap_model(boosted).lm_head.weight is unwrap_model(boosted).transformer.wte.weight
        losses, ref_losses = [], []
        for ids in tokens:
            loss = lm_loss(boosted, shard(ids, rank, 2))
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()
            losses.append(global_mean(loss))
            ref_loss = lm_loss(ref.model, ids)
            ref.backward(ref_loss)
            ref.step()
            ref_losses.append(ref_loss.item())
        loss_tol, param_tol = TOL[precision]
        torch.testing.assert_close(losses, ref_losses, rtol=loss_tol, atol=loss_tol)
        assert_params_close(unwrap_model(boosted), ref.model, rtol=param_tol, atol=param_tol)
        # bf16: rounding differences (measured 7.8e-3) come within 15x of the slowest
        # parameter's move (a LayerNorm bias, 8.8e-2): each parameter must move by 2x the
        # tolerance, the largest move by 10x
        each = 2.0 if precision == "bf16" else None
        assert_moved(ref.initial, unwrap_model(boosted), param_tol, each=each)

    case()


@pytest.mark.parametrize("stage", [1, 2])
@distributed(2)
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(stage: int) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    booster, boosted, opt = boost(TinyMLP(), precision="fp16", stage=stage, hysteresis=1)
    x, y = make_classification_batches(1, 8)[0]
    before = [p.detach().clone() for p in unwrap_model(boosted).parameters()]
    booster.backward(criterion(boosted(shard(x, rank, 2)), shard(y, rank, 2)), opt)
    if rank == 1:  # only rank 1's gradient partition holds the inf
        opt.store.partition(0)[0] = float("inf")
    assert opt.step() is None
    assert opt.last_step_skipped and opt.loss_scale == SCALE / 2
    for p, b in zip(unwrap_model(boosted).parameters(), before, strict=True):
        assert torch.equal(p, b)
    booster.backward(criterion(boosted(shard(x, rank, 2)), shard(y, rank, 2)), opt)
    opt.step()
    assert not opt.last_step_skipped
    assert_same_on_all_ranks(unwrap_model(boosted))
    assert not torch.equal(next(unwrap_model(boosted).parameters()), before[0])


@distributed(2)
def test_state_dict_is_full_and_positional() -> None:
    """``optimizer.state_dict()`` holds full per-parameter states that a plain torch optimizer
    over the model loads, and ``load_state_dict`` of it restores the partitions."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyMLP()
    reference = copy.deepcopy(model)
    booster, boosted, opt = boost(model, precision="fp32", stage=2)
    ref_opt = adamw(reference)
    for x, y in make_classification_batches(2, GLOBAL_BATCH):
        booster.backward(criterion(boosted(shard(x, rank, 2)), shard(y, rank, 2)), opt)
        opt.step()
        opt.zero_grad()
        criterion(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    state = opt.state_dict()
    expected = ref_opt.state_dict()
    assert state["param_groups"][0]["params"] == expected["param_groups"][0]["params"]
    for index, ref_state in expected["state"].items():
        for key, value in ref_state.items():
            torch.testing.assert_close(state["state"][index][key], value, rtol=1e-5, atol=1e-6)
    plain = adamw(copy.deepcopy(reference))
    plain.load_state_dict(state)
    before = [s.clone() for s in opt.optim.state[opt.master_params()[0]].values()]
    opt.load_state_dict(state)
    after = list(opt.optim.state[opt.master_params()[0]].values())
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)


@distributed(2)
def test_fp32_communication_of_bf16_gradients() -> None:
    """``communication_dtype=torch.float32`` with bf16 weights (stage 1 reduces a cast copy of
    its flat buffer, stage 2 fp32 buckets), and ``verbose`` logging."""

    @parameterize("stage", [1, 2])
    def case(stage: int) -> None:
        losses, ref_losses, trained, ref, _ = train_both(
            2, "bf16", stage=stage, communication_dtype=torch.float32, verbose=True
        )
        loss_tol, param_tol = TOL["bf16"]
        torch.testing.assert_close(losses, ref_losses, rtol=loss_tol, atol=loss_tol)
        assert_params_close(trained, ref.model, rtol=param_tol, atol=param_tol)
        assert_moved(ref.initial, trained, param_tol)

    case()


@distributed(2)
def test_plain_loss_backward_is_refused_with_the_fix() -> None:
    torch.manual_seed(0)
    _, boosted, opt = boost(TinyMLP(), precision="fp32", stage=2)
    loss = criterion(boosted(torch.randn(4, 16)), torch.zeros(4, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"booster\.backward\(loss, optimizer\)"):
        loss.backward()
    with pytest.raises(NotImplementedError, match=r"before booster\.boost"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(1))]})
