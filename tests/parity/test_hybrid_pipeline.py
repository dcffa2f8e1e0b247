"""HybridParallelPlugin with pipeline parallelism (pp_size > 1) vs single-process training.

A tiny GPT-2 LM (4 blocks, tied ``wte``/``lm_head``, vocabulary 100 so TP pads it) is trained
through ``booster.execute_pipeline`` with every schedule and with TP, data parallelism (ZeRO-1
too), mixed precision and clipping; the reference trains an unsharded copy in one process on the
global batch with the plugin's precision recipe. Losses are compared at every step, the
gathered full parameters of every stage at the end. All cases share one 4-rank job.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.booster import Booster
from kolossos.booster.plugin import HybridParallelPlugin
from kolossos.nn.layer.parallel_1d import gather_tp_full, get_tp_spec
from kolossos.pipeline.schedule import schedule_names, schedule_spec
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import assert_moved, shard

STEPS = 8
GLOBAL_BATCH = 8
SEQ = 8
LR = 3e-2
SCALE = 2.0**10
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (loss, parameters) rtol = atol. fp32: pipelining changes no arithmetic except the order in which
# micro-batch gradients are summed (and TP's split sums), so values agree to float32 rounding,
# amplified a little by Adam over three steps. bf16/fp16: each micro-batch's working-precision
# gradient is rounded before it is accumulated (the reference rounds the full-batch gradient
# once), plus TP's per-rank rounding: one or two ulps of the working dtype per step, which Adam
# turns into up to a few learning rates for near-zero gradients.
# fp32 parameters: 5e-5, since on some CPUs (torch's kernels differ by instruction set) the tied
# wte/lm_head of pp 2 x tp 2 with two accumulated parts ends 2.5e-5 from the reference in 3 of
# 3200 elements.
TOL = {"fp32": (2e-5, 5e-5), "bf16": (3e-2, 1.5e-2), "fp16": (5e-3, 5e-3)}
# STEPS AdamW steps (see ``adamw``) at LR on one repeated batch move the parameters by 10x the
# tolerances and more (assert_moved); 3 steps at lr 2e-3 moved them by 7e-3 at most, less than
# the low-precision tolerances, so those checks passed without any step. In low precision (eps
# 1e-2) the slowest parameters move less than the tolerance, so there only the largest move must
# reach 10x: the fp32 runs of the same layouts hold every parameter to 10x their tolerance.
EACH = {"fp32": None, "bf16": 0.0, "fp16": 0.0}


@pytest.fixture(scope="module")
def build() -> Callable[..., nn.Module]:
    transformers = pytest.importorskip("transformers")
    gpt2 = {
        "vocab_size": 100, "n_positions": SEQ, "n_embd": 32, "n_layer": 4, "n_head": 4,
        "bos_token_id": 0, "eos_token_id": 0, "attn_pdrop": 0.0, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
    }  # fmt: skip
    families: dict[str, Callable[[], nn.Module]] = {
        "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt2)),
        "gpt2-untied": lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(**gpt2, tie_word_embeddings=False)
        ),
        "llama": lambda: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=True,
            )
        ),
    }  # fmt: skip
    return lambda family="gpt2": families[family]()


def adamw(model: nn.Module, precision: str = "fp32") -> torch.optim.Optimizer:
    # eps 1e-3 (fp32) / 1e-2 (low precision): attention key biases get rounding-noise gradients
    # that a small eps blows up to lr-sized steps (see the TP parity test)
    eps = 1e-3 if precision == "fp32" else 1e-2
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=eps)


def batches() -> list[dict[str, torch.Tensor]]:
    """One global batch, STEPS times: every step pushes a parameter the same way, so Adam
    moves it by up to LR per step."""
    ids = torch.randint(2, 100, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": ids, "labels": ids}] * STEPS


def lm_loss(outputs: Any, inputs: Any) -> torch.Tensor:
    return outputs.loss


class Reference:
    """One process, the plugin's recipe: working weights in ``dtype``, fp32 AdamW masters."""

    def __init__(self, model: nn.Module, precision: str, max_norm: float) -> None:
        self.dtype = DTYPES[precision]
        self.model = copy.deepcopy(model).to(self.dtype)
        self.master = copy.deepcopy(model).float()
        self.opt = adamw(self.master, precision)
        self.max_norm = max_norm

    def step(self, batch: dict[str, torch.Tensor], parts: int = 1) -> float:
        losses = []
        for i in range(parts):  # gradient accumulation: the parts' gradients add up
            loss = self.model(**{k: shard(v, i, parts) for k, v in batch.items()}).loss.float()
            loss.backward()
            losses.append(loss.item())
        for m, p in zip(self.master.parameters(), self.model.parameters(), strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        if self.max_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.master.parameters(), self.max_norm)
        self.opt.step()
        self.opt.zero_grad()
        self.model.zero_grad()
        with torch.no_grad():
            for m, p in zip(self.master.parameters(), self.model.parameters(), strict=True):
                p.copy_(m)
        return sum(losses) / parts


def run(
    build: Callable[..., nn.Module],
    precision: str = "fp32",
    max_norm: float = 0.0,
    family: str = "gpt2",
    parts: int = 1,
    **kw: Any,
) -> list[float]:
    """Train through the plugin and the reference; check losses and parameters; return the
    plugin's losses (the same on every rank). ``parts`` > 1: each step accumulates that many
    ``execute_pipeline`` calls on slices of the batch before ``optimizer.step()``."""
    torch.manual_seed(0)
    model = build(family)
    initial = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    ref = Reference(model, precision, max_norm)
    plugin = HybridParallelPlugin(
        precision=precision, initial_scale=SCALE, max_norm=max_norm, **({"tp_size": 1} | kw)
    )
    booster = Booster(plugin=plugin)
    boosted, opt, *_ = booster.boost(model, adamw(model, precision))
    dp, dp_rank = plugin.mesh.dp_size, plugin.mesh.dp_rank
    losses, ref_losses = [], []
    for batch in batches():
        sm = plugin.stage_manager
        last = any(sm.is_last_stage(c) for c in range(sm.num_model_chunks))
        total = 0.0
        for i in range(parts):
            mine = {k: shard(shard(v, i, parts), dp_rank, dp) for k, v in batch.items()}
            out = booster.execute_pipeline(iter([mine]), boosted, lm_loss, opt,
                                           return_outputs=True)  # fmt: skip
            assert (out["loss"] is not None) == last, (sm, kw)
            if last:
                assert out["outputs"]["logits"].shape[0] == GLOBAL_BATCH // dp // parts
                total += out["loss"].item() / parts
        opt.step()
        opt.zero_grad()
        value = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(value)  # the last stage's dp x tp ranks hold a loss each
        losses.append(value.item() / (dp * plugin.tp_size))
        ref_losses.append(ref.step(batch, parts))
    loss_tol, param_tol = TOL[precision]
    torch.testing.assert_close(losses, ref_losses, rtol=loss_tol, atol=loss_tol)
    full = check_params(boosted, ref.model, param_tol)
    assert_moved(initial, full, param_tol, each=EACH[precision])
    return losses


def check_params(boosted: Any, ref: nn.Module, tol: float) -> dict[str, torch.Tensor]:
    """Every parameter this rank holds, gathered over TP, equals the reference's (by name);
    returns them."""
    theirs = dict(ref.named_parameters(remove_duplicate=False))
    mine = {}
    for chunk in boosted.chunks:
        for name, p in chunk.named_parameters():
            spec = get_tp_spec(p)
            full = gather_tp_full(p.detach(), spec) if spec is not None else p.detach()
            torch.testing.assert_close(
                full.float(), theirs[name].detach().float(), rtol=tol, atol=tol, msg=name
            )
            mine[name] = full
    assert mine
    return mine


@distributed(4)
def test_pipeline_matches_single_process(build: Callable[..., nn.Module]) -> None:
    schedules: dict[str, list[float]] = {}

    # pp 2 x dp 2: every registered schedule, identical losses
    @parameterize("style", list(schedule_names()))
    def schedule(style: str) -> None:
        chunks = schedule_spec(style).default_chunks
        schedules[style] = run(
            build, pp_size=2, pp_style=style, num_model_chunks=chunks, num_microbatches=2
        )

    schedule()
    # GPipe, 1F1B and interleaved do the same arithmetic in the same order: bit-identical
    # losses. In ZB-V's V layout the tied wte and lm_head share one Parameter on rank 0, so their
    # gradients are added by autograd rather than by the all-reduce between two ranks: the same
    # sum in another order, i.e. float32 rounding (measured 2.4e-7 after three steps); ZB-H1's
    # split backward sums the weight gradients in another order too.
    assert schedules["1f1b"] == schedules["interleaved"] == schedules["gpipe"], schedules
    for split in ("zbv", "zbh1"):
        torch.testing.assert_close(schedules[split], schedules["1f1b"], rtol=1e-6, atol=1e-6)

    # pp 2 x tp 2 (tied wte/lm_head on two stages, vocabulary padded), clipping active
    run(build, pp_size=2, tp_size=2, num_microbatches=4, max_norm=0.05)
    # pp 2 x dp 2 with ZeRO-1 (fp32, and bf16 masters under the interleaved schedule)
    run(build, pp_size=2, zero_stage=1, microbatch_size=2, max_norm=0.05)
    # two pipeline steps accumulated before optimizer.step() (tied sum once per part)
    run(build, pp_size=2, tp_size=2, num_microbatches=2, parts=2)
    run(build, pp_size=2, zero_stage=1, num_microbatches=2, parts=2)
    run(build, "bf16", pp_size=2, zero_stage=1, num_microbatches=2, pp_style="interleaved",
        num_model_chunks=2)  # fmt: skip
    # fp16 loss scaling through the pipeline, with TP (also ZB-V's split backward)
    run(build, "fp16", pp_size=2, tp_size=2, num_microbatches=4)
    run(build, "fp16", pp_size=2, tp_size=2, num_microbatches=4, pp_style="zbv",
        num_model_chunks=2)  # fmt: skip
    # pp 4, one block per stage
    run(build, pp_size=4, num_microbatches=4)
    # LLaMA (tied embeddings, rotary tables rebuilt on every stage) at pp 2 x tp 2
    run(build, family="llama", pp_size=2, tp_size=2, num_microbatches=2, max_norm=0.05)
    # ZeRO-2 reduces after every micro-batch's backward (allowed with a warning) ...
    with pytest.warns(UserWarning, match="ZeRO-2"):
        run(build, family="gpt2-untied", pp_size=2, zero_stage=2, num_microbatches=2,
            max_norm=0.05)  # fmt: skip
    # ... but cannot sum a weight tied across stages: refused before training
    torch.manual_seed(0)
    model = build()
    booster = Booster(plugin=HybridParallelPlugin(tp_size=1, pp_size=2, zero_stage=2,
                                                  num_microbatches=2))  # fmt: skip
    with pytest.raises(NotImplementedError, match="zero_stage=2 with pp_size=2"):
        booster.boost(model, adamw(model))


@distributed(2)
def test_pipeline_model_is_run_by_execute_pipeline_only(build: Callable[..., nn.Module]) -> None:
    torch.manual_seed(0)
    model = build()
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2, precision="fp32")
    booster = Booster(plugin=plugin)
    boosted, opt, *_ = booster.boost(model, adamw(model))
    ids = batches()[0]["input_ids"]
    with pytest.raises(RuntimeError, match="execute_pipeline"):
        boosted(input_ids=ids)
    with pytest.raises(TypeError, match=r"returned by booster\.boost"):
        booster.execute_pipeline(iter([ids]), model, lm_loss, opt)
    with pytest.raises(NotImplementedError, match="num_microbatches"):
        booster.no_sync(boosted, opt)
    # each rank holds half of the blocks; the first stage the embeddings, the last the head
    names = [n for chunk in boosted.chunks for n, _ in chunk.named_parameters()]
    blocks = {n.split(".")[2] for n in names if n.startswith("transformer.h.")}
    first = plugin.stage_manager.is_first_stage()
    assert blocks == ({"0", "1"} if first else {"2", "3"})
    assert ("transformer.wte.weight" in names) == first
    assert ("lm_head.weight" in names) != first

    # a float input (ViT's pixels) is cast to the working dtype like the unpipelined model's;
    # the first step's loss is the bf16 model's loss on the batch (bf16 rounding apart)
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    vit = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=8, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_labels=3, hidden_dropout_prob=0.0,
    ))  # fmt: skip
    batch = {"pixel_values": torch.randn(4, 3, 8, 8), "labels": torch.tensor([0, 1, 2, 0])}
    expected = (
        copy.deepcopy(vit)
        .to(torch.bfloat16)(pixel_values=batch["pixel_values"].bfloat16(), labels=batch["labels"])
        .loss.float()
    )
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2, precision="bf16")
    booster = Booster(plugin=plugin)
    boosted, opt, *_ = booster.boost(vit, adamw(vit))
    out = booster.execute_pipeline(iter([batch]), boosted, lm_loss, opt)
    if plugin.stage_manager.is_last_stage():
        torch.testing.assert_close(out["loss"].float(), expected, rtol=2e-2, atol=2e-2)
    opt.step()


def test_stage_chunks_reproduce_the_whole_model_for_every_family() -> None:
    """One process: the chunks of 3 stages, run one after the other, give the model's loss and
    logits, and together hold each parameter once (LLaMA, OPT, BERT, ViT; GPT-2 above)."""
    transformers = pytest.importorskip("transformers")
    from kolossos.shardformer.pipeline import (
        StageRange,
        build_stage_chunk,
        check_layout_covers,
        layout_of,
    )

    t = transformers
    common = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
              "num_attention_heads": 4}  # fmt: skip
    ids = torch.randint(2, 100, (2, SEQ))
    text = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    label = {"input_ids": ids, "labels": torch.tensor([0, 2])}
    models = [
        (t.LlamaForCausalLM(t.LlamaConfig(vocab_size=100, num_key_value_heads=2,
                                          max_position_embeddings=SEQ, pad_token_id=0,
                                          **common)), text),
        (t.OPTForCausalLM(t.OPTConfig(vocab_size=100, hidden_size=32, ffn_dim=64,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      max_position_embeddings=SEQ, word_embed_proj_dim=32,
                                      dropout=0.0, pad_token_id=1)), text),
        (t.BertForSequenceClassification(t.BertConfig(vocab_size=100, num_labels=3,
                                                      max_position_embeddings=SEQ,
                                                      hidden_dropout_prob=0.0, **common)), label),
        (t.ViTForImageClassification(t.ViTConfig(image_size=8, patch_size=4, num_labels=3,
                                                 hidden_dropout_prob=0.0, **common)),
         {"pixel_values": torch.randn(2, 3, 8, 8), "labels": torch.tensor([1, 0])}),
    ]  # fmt: skip
    for model, batch in models:
        model.eval()
        layout = layout_of(model)
        check_layout_covers(model, layout)
        chunks = [
            build_stage_chunk(
                model, layout, StageRange(start=i, end=i + 1, first=i == 0, last=i == 2)
            )
            for i in range(3)
        ]
        out = chunks[0](**batch)
        out = chunks[2](*chunks[1](*out))
        ref = model(**batch)
        torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
        torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=0)
        # every parameter in exactly one chunk; a tied one in the chunk of each of its names
        held = sorted(id(p) for c in chunks for p in c.parameters())
        whole = sorted(id(p) for _, p in model.named_parameters(remove_duplicate=False))
        assert held == whole, type(model).__name__
