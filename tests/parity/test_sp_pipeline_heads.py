"""Attention-level sequence parallelism (``'all_to_all'`` / ``'ring_attn'``) with pipeline
stages for OPT, ViT and the pooled heads: pp 2 x sp 2 (4 ranks, CPU/gloo, fp32) vs single-
process training.

* OPT causal LM and base model: OPT's positions come from the whole padding mask on the first
  stage and travel with the shard (the base model's loss: the mean square of its hidden
  states, the shard's on each SP rank);
* sequence classification by the last non-pad token (GPT-2, LLaMA, OPT; the last stage finds it
  from the ``input_ids`` shards) and by the first token through the pooler (BERT); within each
  micro-batch the samples' last real tokens sit on different SP ranks in both layouts;
* the base models' ``pooler_output`` (BertModel, ViTModel; loss: the squared distance to a
  fixed vector): the sequence's first token's, picked on the last stage;
* ViT image classification (CLS token): 1 + 16 patches = 17 tokens, padded to a multiple of the
  SP size; every stage rebuilds the padding mask of its micro-batch from ``pixel_values``.

Also the interleaved schedule (2 chunks per rank, 4 layers) for OPT and ViT classification and
BertModel's pooler.

Tiny transformers models (2 layers, hidden 32, 4 heads, dropout off), 2 micro-batches with
different padding. The reference trains the whole model on the mean of the micro-batches'
losses, as the schedule does. Losses are compared at every step, the gathered parameters of
every stage at the end, every parameter must have moved by 10x the tolerance, and every
non-first stage must have received the ``(micro-batch, S / sp, H)`` shard.
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
from kolossos.shardformer.pipeline import layout_of, stage_of
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import assert_moved, shard, snapshot

pytestmark = pytest.mark.dist

STEPS = 4
BATCH = 4
MICRO = 2
SEQ = 16
HIDDEN = 32
LR = 3e-2
# fp32: SP and the pipeline change only the order of sums (softmax and loss over shards,
# gradient sums over the SP ranks and the micro-batches), as in test_sp_pipeline_compose.py.
TOL = 2e-5
# Attention key biases have an exactly zero gradient (softmax ignores a constant shift).
ZERO_GRADIENT = ("k_proj.bias", "attention.self.key.bias")
# right padding: last real tokens at 15, 6 | 10, 2: in each micro-batch the two samples' last
# tokens sit on different SP ranks, contiguous (0-7 | 8-15) and zig-zag (0-3, 12-15 | 4-11)
PADS = (0, 9, 5, 13)
CLASSES = 3
CASES = ["opt", "opt_base", "opt_cls", "gpt2_cls", "llama_cls", "bert_cls", "bert_pooler",
         "vit_cls", "vit_pooler"]  # fmt: skip


def _models(layers: int = 2) -> dict[str, Callable[[], nn.Module]]:
    tf = pytest.importorskip("transformers")
    text = dict(vocab_size=128, hidden_size=HIDDEN, num_hidden_layers=layers,
                num_attention_heads=4, max_position_embeddings=SEQ, pad_token_id=0)  # fmt: skip
    opt = dict(text, ffn_dim=64, word_embed_proj_dim=HIDDEN, dropout=0.0, attention_dropout=0.0,
               layerdrop=0.0, bos_token_id=2, eos_token_id=2)  # fmt: skip
    gpt2 = dict(vocab_size=128, n_positions=SEQ, n_embd=HIDDEN, n_layer=layers, n_head=4,
                pad_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                summary_first_dropout=0.0)  # fmt: skip
    llama = dict(text, intermediate_size=64, num_key_value_heads=2, bos_token_id=2,
                 eos_token_id=2)  # fmt: skip
    bert = dict(text, intermediate_size=64, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)  # fmt: skip
    vit = dict(image_size=8, patch_size=2, num_channels=3, hidden_size=HIDDEN,
               num_hidden_layers=layers, num_attention_heads=4, intermediate_size=64,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    cls = dict(num_labels=CLASSES)
    return {
        "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(**opt)),
        "opt_base": lambda: tf.OPTModel(tf.OPTConfig(**opt)),
        "opt_cls": lambda: tf.OPTForSequenceClassification(tf.OPTConfig(**opt, **cls)),
        "gpt2_cls": lambda: tf.GPT2ForSequenceClassification(tf.GPT2Config(**gpt2, **cls)),
        "llama_cls": lambda: tf.LlamaForSequenceClassification(tf.LlamaConfig(**llama, **cls)),
        "bert_cls": lambda: tf.BertForSequenceClassification(tf.BertConfig(**bert, **cls)),
        "bert_pooler": lambda: tf.BertModel(tf.BertConfig(**bert), add_pooling_layer=True),
        "vit_cls": lambda: tf.ViTForImageClassification(tf.ViTConfig(**vit, **cls)),
        "vit_pooler": lambda: tf.ViTModel(tf.ViTConfig(**vit), add_pooling_layer=True),
    }


def make_batch(case: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    if case.startswith("vit"):
        pixels = torch.randn(BATCH, 3, 8, 8, generator=gen)
        return {"pixel_values": pixels} if case == "vit_pooler" else {
            "pixel_values": pixels, "labels": labels
        }  # fmt: skip
    ids = torch.randint(3, 128, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    for i, pad in enumerate(PADS):
        if pad:
            mask[i, -pad:] = 0
    ids = ids.masked_fill(mask == 0, 0)  # the pad token: the classifiers find the last real one
    if case == "opt":
        labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if case.endswith("_pooler") or case == "opt_base":
        del batch["labels"]
    return batch


TARGET = torch.rand(HIDDEN, generator=torch.Generator().manual_seed(7)) - 0.5


def loss_of(case: str, out: Any) -> torch.Tensor:
    """The model's own loss; for a pooler, the squared distance of ``pooler_output`` to a fixed
    vector; for OPT's base model, the mean square of the hidden states (the shard's: the mean
    over the SP ranks is the whole sequence's)."""
    if case.endswith("_pooler"):
        return (out.pooler_output - TARGET).square().sum(-1).mean()
    if case == "opt_base":
        return out.last_hidden_state.square().mean()  # type: ignore[no-any-return]
    return out.loss  # type: ignore[no-any-return]


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=1e-3)


def check(case: str, mode: str, layers: int = 2, **plugin_kwargs: Any) -> None:
    torch.manual_seed(0)
    model = _models(layers)[case]()
    ref = copy.deepcopy(model)
    blocks_path = layout_of(model).blocks
    initial = snapshot(model.named_parameters(remove_duplicate=False))
    ref_opt = adamw(ref)
    plugin = HybridParallelPlugin(
        pp_size=2, sp_size=2, tp_size=1, num_microbatches=MICRO, precision="fp32",
        enable_sequence_parallelism=True, sequence_parallelism_mode=mode, **plugin_kwargs,
    )  # fmt: skip
    booster = Booster(plugin=plugin)
    boosted, opt, *_ = booster.boost(model, adamw(model))
    assert plugin.mesh.sp_size == 2 and plugin.mesh.dp_size == 1
    received: list[tuple[int, ...]] = []
    family = case.split("_")[0]
    for chunk in boosted.chunks:
        stage = stage_of(chunk)
        assert stage is not None
        if not stage.first:  # runs after the engine's hooks: sees what the block gets
            chunk.get_submodule(blocks_path)[0].register_forward_pre_hook(
                lambda m, a, k: received.append(tuple((a[0] if a else k["hidden_states"]).shape)),
                with_kwargs=True,
            )  # fmt: skip
    batch = make_batch(case)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        out = booster.execute_pipeline(iter([batch]), boosted, lambda o, _: loss_of(case, o), opt)
        opt.step()
        opt.zero_grad()
        held = out["loss"] is not None
        value = torch.tensor(
            [out["loss"].item() if held else 0.0, float(held)], dtype=torch.float64
        )
        dist.all_reduce(value)  # the last stage's SP ranks (their mean for OPT's base model)
        losses.append((value[0] / value[1]).item())
        ref_loss = sum(loss_of(case, ref(**{k: shard(v, i, MICRO) for k, v in batch.items()}))
                       for i in range(MICRO)) / MICRO  # fmt: skip
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    torch.testing.assert_close(losses, ref_losses, rtol=TOL, atol=TOL, msg=f"{case} {mode}")
    # the shard crossed the stage boundary: 17 ViT tokens padded to 18 (20 for the zig-zag)
    seq = SEQ if family != "vit" else (18 if mode == "all_to_all" else 20)
    assert set(received) <= {(BATCH // MICRO, seq // 2, HIDDEN)}, received
    counts = [len(received)]
    everyone: list[Any] = [None] * dist.get_world_size()
    mine = {n: p.detach() for chunk in boosted.chunks for n, p in chunk.named_parameters()}
    dist.all_gather_object(everyone, (mine, counts))
    later = 2 * plugin_kwargs.get("num_model_chunks", 1) - 1  # later virtual stages
    assert sum(c[0] for _, c in everyone) == 2 * later * STEPS * MICRO  # two SP ranks each
    trained = {n: v for part, _ in everyone for n, v in part.items()}
    theirs = dict(ref.named_parameters(remove_duplicate=False))
    assert {id(theirs[n]) for n in trained} == {id(p) for p in theirs.values()}
    for name, value in trained.items():
        torch.testing.assert_close(
            value, theirs[name].detach(), rtol=TOL, atol=TOL,
            msg=lambda m, name=name: f"{case} {mode} {name}: {m}",
        )  # fmt: skip
    still = [n for n in trained if n.endswith(ZERO_GRADIENT)]
    assert_moved(initial, trained, TOL, exclude=still)


@distributed(4)
def test_pp2_sp2_opt_vit_and_pooled_heads_match_single_process() -> None:
    @parameterize("case", CASES)
    @parameterize("mode", ["all_to_all", "ring_attn"])
    def case(case: str, mode: str) -> None:
        check(case, mode)

    case()


@distributed(4)
def test_pp2_sp2_interleaved_heads_match_single_process() -> None:
    """Two chunks per rank (4 layers, 4 virtual stages): the micro-batch's inputs cross three
    stage boundaries; the pooled token is picked by the second chunk of pipeline position 1."""

    @parameterize("case", ["opt_cls", "vit_cls", "bert_pooler"])
    @parameterize("mode", ["all_to_all", "ring_attn"])
    def case(case: str, mode: str) -> None:
        check(case, mode, layers=4, pp_style="interleaved", num_model_chunks=2)

    case()
