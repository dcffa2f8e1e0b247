"""The operator graph, conv strategies and Megatron plan of a tiny Hugging Face ViT (no process
group).

``ViTForImageClassification``: 8 x 8 images of 3 channels, 4 x 4 patches (4 patches + [CLS] = 5
tokens), 2 layers, hidden 32, 4 heads, MLP 64, 5 classes, batch 16 with labels. The patch
convolution (with its ``flatten``/``transpose``) is a ``conv`` operator; the CLS token and
position embeddings (bare ``nn.Parameter`` s of ``ViTEmbeddings``) a ``token_params`` operator
reading it; the classifier reads the final LayerNorm's ``[CLS]`` row; the loss is cross entropy
on the ``[batch, classes]`` logits and the labels. A conv's strategies cost what a linear's of
the same sizes cost.
"""

from __future__ import annotations

import pytest
import torch

from kolossos.auto_parallel import CostModel
from kolossos.auto_parallel.module_graph import OperatorGroup, trace_operators
from kolossos.auto_parallel.transformer_checkpoint import repeated_blocks
from kolossos.auto_parallel.transformer_plan import family_plan, search_transformer_plan
from kolossos.auto_parallel.transformer_strategies import transformer_graph

BATCH, IMAGE, PATCH, HIDDEN, INTER, CLASSES = 16, 8, 4, 32, 64, 5
PATCHES = (IMAGE // PATCH) ** 2
TOKENS = BATCH * (PATCHES + 1)
COST = CostModel(world_size=2, flops_per_s=1e9, alpha=1e-6, beta=1e-8)


@pytest.fixture(scope="module")
def groups() -> list[OperatorGroup]:
    tf = pytest.importorskip("transformers")
    config = tf.ViTConfig(image_size=IMAGE, patch_size=PATCH, num_channels=3, hidden_size=HIDDEN,
                          num_hidden_layers=2, num_attention_heads=4, intermediate_size=INTER,
                          num_labels=CLASSES, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)  # fmt: skip
    model = tf.ViTForImageClassification(config)
    meta = {
        "pixel_values": torch.empty(BATCH, 3, IMAGE, IMAGE, device="meta"),
        "labels": torch.empty(BATCH, dtype=torch.long, device="meta"),
    }
    found = trace_operators(model, meta)
    assert sum(g.param_bytes for g in found) == 4 * sum(p.numel() for p in model.parameters())
    return found


def test_operator_graph(groups) -> None:
    by_name = {g.name: g for g in groups}
    conv = by_name["vit.embeddings.patch_embeddings.projection"]
    assert (conv.kind, conv.module_type, conv.inputs) == ("conv", "Conv2d", ["pixel_values"])
    assert conv.nodes == ["conv2d", "flatten", "transpose"]  # the views join the convolution
    assert conv.flops == 2 * (BATCH * HIDDEN * PATCHES) * 3 * PATCH * PATCH
    assert conv.param_bytes == 4 * (HIDDEN * 3 * PATCH * PATCH + HIDDEN)
    assert conv.param_tensors == 2 and conv.bias_bytes == 4 * HIDDEN
    tokens = by_name["vit.embeddings"]
    assert (tokens.kind, tokens.inputs) == ("token_params", [conv.name])
    assert tokens.param_bytes == 4 * (HIDDEN + (PATCHES + 1) * HIDDEN)  # CLS + positions
    assert tokens.out_bytes == 4 * TOKENS * HIDDEN
    assert by_name["vit.layers.0.layernorm_before"].inputs == ["vit.embeddings"]
    assert by_name["vit.layers.0.add"].inputs == ["vit.layers.0.attention.o_proj",
                                                  "vit.embeddings"]  # fmt: skip
    classifier = by_name["classifier"]
    assert classifier.inputs == ["vit.layernorm"]
    assert classifier.in_bytes["vit.layernorm"] == 4 * BATCH * HIDDEN  # the [CLS] row only
    assert classifier.flops == 2 * BATCH * HIDDEN * CLASSES
    assert by_name["loss"].inputs == ["classifier", "labels"]
    assert by_name["loss"].in_bytes == {"classifier": 4 * BATCH * CLASSES, "labels": 8 * BATCH}
    assert repeated_blocks(groups)[0] == ["vit.layers.0", "vit.layers.1"]


def test_conv_strategies_priced_like_linear(groups) -> None:
    conv = next(g for g in groups if g.kind == "conv")
    graph = transformer_graph([g for g in groups if g.kind == "input"] + [conv], COST)
    as_linear = OperatorGroup(**{**conv.__dict__, "kind": "linear"})
    linear = transformer_graph([g for g in groups if g.kind == "input"] + [as_linear], COST)
    strategies = {s.name: s for s in graph.nodes[-1].strategies}
    assert sorted(strategies) == ["col", "dp", "rep"]
    for s in linear.nodes[-1].strategies:
        if s.name in strategies:
            assert strategies[s.name] == s
    dp, col, rep = strategies["dp"], strategies["col"], strategies["rep"]
    assert (dp.in_layout, dp.out_layout) == ("B", "B") and dp.param_mem == rep.param_mem
    assert dp.comm_bytes == conv.param_bytes  # the weight gradient's all-reduce
    assert (col.in_layout, col.out_layout) == ("R", "F") and col.param_mem == rep.param_mem / 2
    assert col.comm_bytes == conv.in_bytes["pixel_values"]  # the input gradient's all-reduce
    assert (rep.in_layout, rep.out_layout, rep.comm_s) == ("R", "R", 0.0)


def test_megatron_plan(groups) -> None:
    plan = family_plan("megatron", groups, COST)
    chosen = dict(zip(plan.nodes, plan.names, strict=True))
    block = "vit.layers.1"
    for name in ("attention.q_proj", "attention.k_proj", "attention.v_proj", "mlp.fc1"):
        assert chosen[f"{block}.{name}"] == "col", name
    for name in ("attention.o_proj", "mlp.fc2"):
        assert chosen[f"{block}.{name}"] == "row", name
    for name in ("attention.attention", "mlp.activation_fn"):
        assert chosen[f"{block}.{name}"] == "F", name
    for name in ("layernorm_before", "layernorm_after", "add", "add#1"):
        assert chosen[f"{block}.{name}"] == "R", name
    # what ShardFormer's ViT policy replicates: patch embedding, CLS/positions, head, loss
    replicated = ("vit.embeddings.patch_embeddings.projection", "vit.embeddings", "classifier",
                  "loss")  # fmt: skip
    assert [chosen[n] for n in replicated] == ["rep", "R", "rep", "R"]
    assert plan.reshard_s == (0.0,) * len(plan.nodes)  # no layout change between operators
    dp = family_plan("dp", groups, COST)
    replicated_plan = family_plan("replicated", groups, COST)
    assert plan.memory < dp.memory < replicated_plan.memory
    assert search_transformer_plan(groups, COST)[0] == "dp"
    assert search_transformer_plan(groups, COST, (plan.memory + dp.memory) / 2)[0] == "megatron"
