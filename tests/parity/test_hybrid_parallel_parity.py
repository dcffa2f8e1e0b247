"""HybridParallelPlugin (tensor parallelism + DDP/ZeRO) vs single-process training on CPU/gloo.

Real transformers models from tiny configs (dropout off). The reference trains the unsharded
model in one process on the global batch with the plugin's precision recipe (working weights in
the plugin's dtype, fp32 AdamW masters); the plugin trains the TP-sharded model, each data-parallel
rank on its share of the batch. Losses are compared at every step, the gathered full parameters
at the end. One process group per world size serves a sweep (``parameterize``).
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

from kolossos.booster import Booster
from kolossos.booster.plugin import HybridParallelPlugin
from kolossos.interface import unwrap_model
from kolossos.nn.layer.parallel_1d import gather_tp_full, get_tp_spec
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import assert_moved, global_mean, shard, snapshot

STEPS = 8
GLOBAL_BATCH = 4
SEQ = 16
SCALE = 2.0**10
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (loss, parameters) rtol = atol. fp32: TP only changes the order of sums (one all-reduce per
# row-parallel layer, split softmax sums in the vocabulary-parallel loss), so values agree to
# float32 rounding, amplified a little by Adam's normalisation. bf16/fp16: each rank rounds its
# own partial matmul results before the all-reduce (the reference rounds the full sum once), a
# difference of one bf16 ulp (2^-8 relative) per layer; the working weights compared are rounded
# to bf16 themselves (one ulp of a LayerNorm weight near 1 is 7.8e-3, within rtol). Measured
# worst beyond rtol, 2 and 4 ranks: bf16 5.6e-3, fp16 5e-4 (LLaMA's embedding).
TOL = {"fp32": (2e-5, 2e-5), "bf16": (3e-2, 1.5e-2), "fp16": (5e-3, 5e-3)}
# BERT and ViT (classifiers) move their parameters less (largest move 0.16-0.19 in bf16): their
# bf16 parameter tolerance is 1e-2, where they differ by 3e-3 (BERT) and one bf16 ulp of a
# LayerNorm weight near 1 (ViT) at most; OPT's reaches 1.1e-2, GPT-2's and LLaMA's 7e-3.
PARAM_TOL = {("bert", "bf16"): 1e-2, ("vit", "bf16"): 1e-2}
# STEPS AdamW steps (see ``adamw``) at LR on one repeated batch move the parameters by up to 0.2,
# 10x the low-precision tolerances and more (assert_moved); 3 steps at lr 2e-3 moved them by
# 7e-3 at most, less than those tolerances, so the checks passed without any step. In low
# precision (eps 1e-2) the slowest parameters (LLaMA's q_proj: 4e-3) move less than the
# tolerance, so there only the largest move must reach 10x: the fp32 cases of the same layouts
# hold every parameter to 10x their tolerance.
EACH = {"fp32": None, "bf16": 0.0, "fp16": 0.0}
# Attention key biases have an exactly zero gradient (softmax ignores a constant added to every
# key) and start at zero, so they never move (GPT-2's fused c_attn.bias moves by its q, v parts).
ZERO_GRADIENT = ("k_proj.bias", "attention.self.key.bias")
LR = 3e-2


def adamw(model: nn.Module, precision: str = "fp32") -> torch.optim.Optimizer:
    # A large eps keeps Adam's update for a gradient below it proportional to the gradient,
    # instead of a whole lr-sized step whose sign rounding noise decides (the attention key
    # biases' true gradient is zero: softmax ignores a constant shift). Low precision: 1e-2;
    # with 1e-3, LLaMA in bf16 at this LR drifts away from the reference (parameters 9e-2 apart
    # after 8 steps). fp32: 1e-3, so that small gradients (BERT's last query bias) still move
    # their parameters by 10x the tolerance.
    eps = 1e-3 if precision == "fp32" else 1e-2
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=eps)


@pytest.fixture(scope="module")
def build() -> Callable[[str], nn.Module]:
    """Tiny transformers models by family, imported once in the parent (forked ranks inherit)."""
    transformers = pytest.importorskip("transformers")
    no_drop = {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}
    configs: dict[str, Any] = {
        # vocabulary 100: padded to 128 rows at tp 2 (the padding path of the vocab layers)
        "gpt2": lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=100, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                bos_token_id=0, eos_token_id=0, **no_drop,
            )
        ),
        "llama": lambda: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                bos_token_id=0, eos_token_id=0, pad_token_id=0,
            )
        ),
        "opt": lambda: transformers.OPTForCausalLM(
            transformers.OPTConfig(
                vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=SEQ, word_embed_proj_dim=32,
                dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
                pad_token_id=1,
                # GELU, not OPT's ReLU: in bf16, ReLU flips on near-zero pre-activations put
                # fc1 1.8e-2 apart after the steps that move the parameters by 0.2 (the TP plan
                # does not depend on the activation)
                activation_function="gelu",
            )
        ),
        "bert": lambda: transformers.BertForSequenceClassification(
            transformers.BertConfig(
                vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=SEQ, num_labels=3,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            )
        ),
        "vit": lambda: transformers.ViTForImageClassification(
            transformers.ViTConfig(
                image_size=12, patch_size=4, num_channels=3, hidden_size=32,
                intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            )
        ),
    }  # fmt: skip
    return lambda family: configs[family]()


def make_batches(family: str, steps: int = STEPS, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    """Global batches (identical on every rank) as keyword arguments of the model."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if family == "vit":  # 3 x 3 patches + [CLS]: 10 positions, even for sequence parallelism
            out.append({
                "pixel_values": torch.randn(GLOBAL_BATCH, 3, 12, 12, generator=gen),
                "labels": torch.randint(0, 3, (GLOBAL_BATCH,), generator=gen),
            })  # fmt: skip
        elif family == "bert":
            out.append({
                "input_ids": torch.randint(2, 128, (GLOBAL_BATCH, SEQ), generator=gen),
                "labels": torch.randint(0, 3, (GLOBAL_BATCH,), generator=gen),
            })  # fmt: skip
        else:
            ids = torch.randint(2, 100, (GLOBAL_BATCH, SEQ), generator=gen)
            out.append({"input_ids": ids, "labels": ids})
    return out


def shard_batch(batch: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    return {k: shard(v, rank, size) for k, v in batch.items()}


class Reference:
    """One process, the plugin's precision recipe: working weights in ``dtype``, fp32 masters."""

    def __init__(self, model: nn.Module, precision: str) -> None:
        self.dtype = DTYPES[precision]
        self.scale = SCALE if precision == "fp16" else 1.0
        self.initial = snapshot(model)
        self.model = copy.deepcopy(model).to(self.dtype)
        self.master_model = copy.deepcopy(model).float()
        self.opt = adamw(self.master_model, precision)
        self.masters = list(self.master_model.parameters())

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        cast = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in batch.items()}
        return self.model(**cast).loss.float()

    def backward(self, loss: torch.Tensor) -> list[torch.Tensor]:
        (loss * self.scale).backward()
        for master, p in zip(self.masters, self.model.parameters(), strict=True):
            master.grad = None if p.grad is None else p.grad.float() / self.scale
        return [m for m in self.masters if m.grad is not None]

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()
        self.model.zero_grad()
        with torch.no_grad():
            for master, p in zip(self.masters, self.model.parameters(), strict=True):
                p.copy_(master)


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to its full HF shape (a collective over the TP group)."""
    out = {}
    for name, p in module.named_parameters():
        spec = get_tp_spec(p)
        out[name] = gather_tp_full(p.detach(), spec) if spec is not None else p.detach()
    return out


def assert_matches(module: nn.Module, ref: nn.Module, tol: float) -> None:
    mine, theirs = full_params(module), dict(ref.named_parameters())
    assert mine.keys() == theirs.keys()
    for name, value in mine.items():
        torch.testing.assert_close(
            value.float(), theirs[name].detach().float(), rtol=tol, atol=tol, msg=name
        )


def train_both(
    model: nn.Module,
    family: str,
    tp: int,
    precision: str,
    clip: Callable[[Any], tuple[float, float]] | None = None,
    **plugin_kwargs: Any,
) -> tuple[list[float], list[float], nn.Module, Reference, list[tuple[float, float]]]:
    """Train ``model`` through the plugin and a copy in the reference; returns both loss curves,
    the trained module, the reference and the (plugin, reference) values ``clip`` returned."""
    world = dist.get_world_size()
    dp, dp_rank = world // tp, dist.get_rank() // tp  # (dp, pp, tp) mesh: TP ranks consecutive
    ref = Reference(model, precision)
    kwargs: dict[str, Any] = {"initial_scale": SCALE, "precision": precision}
    booster = Booster(plugin=HybridParallelPlugin(tp_size=tp, **(kwargs | plugin_kwargs)))
    boosted, opt, _, _, _ = booster.boost(model, adamw(model, precision))
    losses, ref_losses, norms = [], [], []
    # one batch, repeated: every step pushes a parameter the same way, so Adam moves it by ~LR
    for batch in make_batches(family, steps=1) * STEPS:
        loss = boosted(**shard_batch(batch, dp_rank, dp)).loss
        booster.backward(loss, opt)
        ref_loss = ref.loss(batch)
        ref_grads = ref.backward(ref_loss)
        if clip is not None:
            norms.append((clip(opt), clip(ref_grads)))
        opt.step()
        opt.zero_grad()
        ref.step()
        losses.append(global_mean(loss))
        ref_losses.append(ref_loss.item())
    return losses, ref_losses, unwrap_model(boosted), ref, norms


def check(
    build: Callable[[str], nn.Module], family: str, tp: int, precision: str, **kwargs: Any
) -> None:
    torch.manual_seed(0)
    losses, ref_losses, trained, ref, _ = train_both(build(family), family, tp, precision, **kwargs)
    loss_tol, param_tol = TOL[precision]
    param_tol = PARAM_TOL.get((family, precision), param_tol)
    torch.testing.assert_close(losses, ref_losses, rtol=loss_tol, atol=loss_tol)
    assert_matches(trained, ref.model, param_tol)
    full = full_params(trained)
    still = [n for n in full if n.endswith(ZERO_GRADIENT)]
    assert_moved(ref.initial, full, param_tol, each=EACH[precision], exclude=still)
    assert next(trained.parameters()).dtype == DTYPES[precision]
    sharded = [p for p in trained.parameters() if get_tp_spec(p) is not None]
    assert sharded and all(p.numel() < math.prod(get_tp_spec(p).full_shape) for p in sharded)


@distributed(2)
def test_tp2_matches_single_process(build: Callable[[str], nn.Module]) -> None:
    @parameterize("family", ["gpt2", "llama"])
    @parameterize("sp", [False, True])
    @parameterize("zero_stage", [0, 1])
    @parameterize("precision", ["fp32", "bf16"])
    def case(family: str, sp: bool, zero_stage: int, precision: str) -> None:
        check(build, family, 2, precision, enable_sequence_parallelism=sp, zero_stage=zero_stage)

    case()


@distributed(4)
def test_tp2_dp2_matches_single_process(build: Callable[[str], nn.Module]) -> None:
    @parameterize("family", ["gpt2", "llama"])
    @parameterize("sp", [False, True])
    @parameterize("zero_stage", [0, 1, 2])
    def case(family: str, sp: bool, zero_stage: int) -> None:
        check(build, family, 2, "fp32", enable_sequence_parallelism=sp, zero_stage=zero_stage)

    case()
    check(build, "llama", 2, "bf16", enable_sequence_parallelism=True, zero_stage=1)

    @parameterize("family", ["bert", "vit", "opt"])
    @parameterize("sp", [False, True])
    def other(family: str, sp: bool) -> None:
        check(build, family, 2, "fp32", enable_sequence_parallelism=sp, zero_stage=1)

    other()


@distributed(2)
def test_other_families_at_tp2(build: Callable[[str], nn.Module]) -> None:
    @parameterize("family", ["bert", "vit", "opt"])
    @parameterize("sp", [False, True])
    @parameterize("zero_stage", [0, 1])
    def case(family: str, sp: bool, zero_stage: int) -> None:
        check(build, family, 2, "fp32", enable_sequence_parallelism=sp, zero_stage=zero_stage)

    case()

    @parameterize("family", ["bert", "vit", "opt"])
    def low_precision(family: str) -> None:
        check(build, family, 2, "bf16", enable_sequence_parallelism=True, zero_stage=1)

    low_precision()


class Block(nn.Module):
    """A pre-norm residual MLP block (a model no built-in plan knows)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 32, classes: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(2))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


@distributed(2)
def test_custom_policy_for_a_hand_written_model() -> None:
    """``custom_policy``: a user plan (column ``up``, row ``down``) shards a model of one's own."""
    from kolossos.shardformer import BlockPlan, ModelPlan, ParallelLayer, StageLayout, TPRegion

    plan = ModelPlan(
        family="residual-mlp",
        layout=StageLayout(embeddings=("embed",), blocks="layers", final=("head",)),
        block=BlockPlan(
            layers=(
                ParallelLayer(path="up", style="column"),
                ParallelLayer(path="down", style="row"),
            ),
            regions=(TPRegion(path="up", arg="input"),),
            replicated_params=("norm",),
        ),
    )  # fmt: skip

    @parameterize("zero_stage", [0, 1])
    def case(zero_stage: int) -> None:
        torch.manual_seed(0)
        model = ResidualMLP()
        reference = copy.deepcopy(model)
        initial = snapshot(model)
        plugin = HybridParallelPlugin(
            tp_size=2, precision="fp32", zero_stage=zero_stage, custom_policy=plan, max_norm=0.5
        )
        booster = Booster(plugin=plugin)
        boosted, opt, _, _, _ = booster.boost(model, adamw(model))
        ref_opt = adamw(reference)
        gen = torch.Generator().manual_seed(0)
        for _ in range(STEPS):
            x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 8, (8,), generator=gen)
            loss = nn.functional.cross_entropy(boosted(x), y)
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()
            ref_loss = nn.functional.cross_entropy(reference(x), y)
            ref_loss.backward()
            nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(loss.item(), ref_loss.item(), rtol=1e-5, atol=1e-6)
        trained = unwrap_model(boosted)
        assert get_tp_spec(trained.layers[0].up.weight) is not None
        assert_matches(trained, reference, 2e-5)
        assert_moved(initial, full_params(trained), 2e-5)

    case()


@distributed(2)
def test_clipping_counts_every_element_once(build: Callable[[str], nn.Module]) -> None:
    """``max_norm`` and ``clip_grad_by_norm`` (2-norm and inf-norm) against torch's clipping of
    the reference's full gradients; the clip is active (norm > max_norm) at every step."""

    # Active at every step, not so tight that the parameters stop moving (with 0.05 as the
    # 2-norm limit a LayerNorm bias moved by 1.3e-4 in 8 steps)
    limit = {2.0: 0.5, math.inf: 0.05}

    def norm_clip(norm_type: float, max_norm: float | None = None) -> Callable[[Any], Any]:
        max_norm = limit[norm_type] if max_norm is None else max_norm

        def clip(target: Any) -> float:
            if isinstance(target, list):
                return float(nn.utils.clip_grad_norm_(target, max_norm, norm_type))
            return float(target.clip_grad_by_norm(max_norm, norm_type))

        return clip

    @parameterize("zero_stage", [0, 1])
    @parameterize("sp", [False, True])
    @parameterize("norm_type", [2.0, math.inf])
    def case(zero_stage: int, sp: bool, norm_type: float) -> None:
        torch.manual_seed(0)
        kwargs = {"zero_stage": zero_stage, "enable_sequence_parallelism": sp}
        losses, ref_losses, trained, ref, norms = train_both(
            build("gpt2"), "gpt2", 2, "fp32", norm_clip(norm_type), **kwargs
        )
        mine, theirs = zip(*norms, strict=True)
        assert min(theirs) > limit[norm_type]
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(losses, ref_losses, rtol=2e-5, atol=2e-5)
        assert_matches(trained, ref.model, 2e-5)
        assert_moved(ref.initial, full_params(trained), 2e-5)

    case()

    def reference_only(target: Any) -> float:  # the plugin clips inside step (max_norm)
        return norm_clip(2.0, 0.05)(target) if isinstance(target, list) else 0.0

    @parameterize("zero_stage", [0, 1])
    def plugin_max_norm(zero_stage: int) -> None:
        torch.manual_seed(0)
        _, _, trained, ref, norms = train_both(
            build("llama"), "llama", 2, "fp32", reference_only, zero_stage=zero_stage,
            max_norm=0.05,
        )  # fmt: skip
        assert min(n for _, n in norms) > 0.05
        assert_matches(trained, ref.model, 2e-5)
        assert_moved(ref.initial, full_params(trained), 2e-5)

    plugin_max_norm()


@distributed(2)
def test_fp16_loss_scaling(build: Callable[[str], nn.Module]) -> None:
    @parameterize("zero_stage", [0, 1])
    def case(zero_stage: int) -> None:
        check(build, "gpt2", 2, "fp16", zero_stage=zero_stage, enable_sequence_parallelism=True)

    case()

    @parameterize("zero_stage", [0, 1])
    def overflow_on_one_tp_rank_skips_everywhere(zero_stage: int) -> None:
        torch.manual_seed(0)
        model = build("llama")
        plugin = HybridParallelPlugin(
            tp_size=2, precision="fp16", zero_stage=zero_stage, initial_scale=SCALE, hysteresis=1
        )
        booster = Booster(plugin=plugin)
        boosted, opt, _, _, _ = booster.boost(model, adamw(model))
        before = [p.detach().clone() for p in unwrap_model(boosted).parameters()]
        batch = make_batches("llama", steps=1)[0]
        booster.backward(boosted(**batch).loss, opt)
        if dist.get_rank() == 1:  # only one TP shard sees the inf
            if zero_stage:
                opt.store.partition(0)[0] = float("inf")
            else:
                next(p for p in opt.working_params() if p.grad is not None).grad[0] = float("inf")
        assert opt.step() is None
        assert opt.last_step_skipped and opt.loss_scale == SCALE / 2
        for p, b in zip(unwrap_model(boosted).parameters(), before, strict=True):
            assert torch.equal(p, b)
        opt.zero_grad()
        booster.backward(boosted(**batch).loss, opt)
        opt.step()
        assert not opt.last_step_skipped

    overflow_on_one_tp_rank_skips_everywhere()


@distributed(4)
def test_accumulation_with_no_sync_equals_the_large_batch(
    build: Callable[[str], nn.Module],
) -> None:
    """Two micro-batches (the first under ``booster.no_sync``) at tp 2 x dp 2 equal one step on
    their concatenation in one process."""
    rank = dist.get_rank()

    @parameterize("zero_stage", [0, 1])
    def case(zero_stage: int) -> None:
        torch.manual_seed(0)
        model = build("llama")
        ref = Reference(model, "fp32")
        plugin = HybridParallelPlugin(
            tp_size=2, precision="fp32", zero_stage=zero_stage, enable_sequence_parallelism=True
        )
        booster = Booster(plugin=plugin)
        boosted, opt, _, _, _ = booster.boost(model, adamw(model))
        micro = make_batches("llama", steps=2, seed=5)
        for i, batch in enumerate(micro):
            loss = boosted(**shard_batch(batch, rank // 2, 2)).loss / 2
            if i == 0:
                with booster.no_sync(boosted, opt):
                    booster.backward(loss, opt)
            else:
                booster.backward(loss, opt)
        opt.step()
        whole = {k: torch.cat([m[k] for m in micro]) for k in micro[0]}
        ref.backward(ref.loss(whole))
        ref.step()
        assert_matches(unwrap_model(boosted), ref.model, 2e-5)
        assert_moved(ref.initial, full_params(unwrap_model(boosted)), 2e-5)

    case()
    # prepare_dataloader shards over the dp axis only: TP peers read the same samples
    plugin = HybridParallelPlugin(tp_size=2, precision="fp32")
    loader = plugin.prepare_dataloader(list(range(8)), batch_size=2)
    mine = torch.cat(list(loader))
    peers = [torch.empty_like(mine) for _ in range(4)]
    dist.all_gather(peers, mine)
    assert torch.equal(peers[0], peers[1]) and torch.equal(peers[2], peers[3])
    assert sorted(torch.cat([peers[0], peers[2]]).tolist()) == list(range(8))
