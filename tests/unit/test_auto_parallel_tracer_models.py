"""ColoTracer on more model families: Hugging Face BERT and ViT (``torch.export``) and a timm-style
ResNet with Bottleneck blocks, strided projections, BatchNorm and residual adds (both front ends).

Every node with a tensor output has shapes and dtypes; the outputs have the right shapes; the
FLOPs of one layer's matrix products / convolutions equal a hand count, and the total the sum over
layers. BERT's operators also group into the planner's operator DAG (``module_graph``) with one
repeated block per encoder layer; ViT groups with its patch convolution; a parameter used
outside the grouping rules is refused by name.
"""

from __future__ import annotations

import pytest
import torch

from kolossos.auto_parallel import ColoTracer
from kolossos.auto_parallel.traced_graph import TracedGraph

BATCH, SEQ, HIDDEN, HEADS, INTER, VOCAB = 2, 8, 16, 2, 32, 64
_BN = torch.nn.BatchNorm2d


def _check_meta(traced: TracedGraph) -> None:
    """Every node with a tensor output has its shape and dtype: all but ``output`` and the
    ``_assert_tensor_metadata`` checks ``torch.export`` puts before dtype casts (return None)."""
    no_output = ("output", "aten._assert_tensor_metadata.default")
    missing = [i.name for i in traced.nodes if i.target not in no_output and not i.shapes]
    assert not missing, missing
    assert all(len(i.shapes) == len(i.dtypes) for i in traced.nodes)


def _flops_of(traced: TracedGraph, prefix: str) -> list[int]:
    return [i.flops for i in traced.nodes if i.target.startswith(prefix)]


def _bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        intermediate_size=INTER,
        max_position_embeddings=16,
        type_vocab_size=2,
    )
    return transformers.BertForMaskedLM(config)


def _encoder_layer_flops(tokens: int, seq: int) -> list[int]:
    """Hand count of one encoder layer: q, k, v, out projections, MLP up and down, attention."""
    proj = 2 * tokens * HIDDEN * HIDDEN
    mlp = 2 * tokens * HIDDEN * INTER
    # q @ k^T and softmax @ v: 2 products of (seq x head_dim) by (head_dim x seq) per head
    attention = 2 * 2 * tokens * seq * HIDDEN
    return [proj] * 4 + [mlp] * 2 + [attention]


def test_hf_bert_masked_lm() -> None:
    model = _bert()
    ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    traced = ColoTracer().trace(model, {"input_ids": ids})
    assert traced.backend == "export"
    _check_meta(traced)
    assert traced["input_ids"].dtypes == (torch.int64,)
    tokens = BATCH * SEQ
    linears = _flops_of(traced, "aten.linear")
    attention = _flops_of(traced, "aten.scaled_dot_product_attention")
    assert len(linears) == 2 * 6 + 2  # 6 per layer + the head's transform and decoder
    layer = linears[:6] + attention[:1]
    assert layer == _encoder_layer_flops(tokens, SEQ)
    head = [2 * tokens * HIDDEN * HIDDEN, 2 * tokens * HIDDEN * VOCAB]
    assert linears[-2:] == head
    assert traced.total_flops == 2 * sum(_encoder_layer_flops(tokens, SEQ)) + sum(head)
    assert sum(i.target.startswith("aten.layer_norm") for i in traced.nodes) == 2 * 2 + 2
    logits = traced.nodes[-2]
    assert logits.shape == (BATCH, SEQ, VOCAB) and logits.dtypes == (torch.float32,)
    # the decoder's weight is tied to the word embeddings: counted once
    assert traced.param_bytes == sum(p.numel() * 4 for p in model.parameters())


def _graph_outputs(traced: TracedGraph) -> list[tuple[int, ...] | None]:
    (out,) = [n for n in traced.graph_module.graph.nodes if n.op == "output"]
    return [traced[a.name].shape for a in out.args[0]]


def test_hf_bert_sequence_classification_with_mask_and_labels() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                     num_attention_heads=HEADS, intermediate_size=INTER,
                                     max_position_embeddings=16, type_vocab_size=2,
                                     num_labels=3)  # fmt: skip
    model = transformers.BertForSequenceClassification(config)
    ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.empty(BATCH, SEQ, dtype=torch.long, device="meta"),
        "token_type_ids": ids,
        "labels": torch.empty(BATCH, dtype=torch.long, device="meta"),
    }
    traced = ColoTracer().trace(model, inputs)
    _check_meta(traced)
    assert _graph_outputs(traced) == [(), (BATCH, 3)]  # loss, logits
    tokens = BATCH * SEQ
    pooler, classifier = 2 * BATCH * HIDDEN * HIDDEN, 2 * BATCH * HIDDEN * 3  # [CLS] only
    assert _flops_of(traced, "aten.linear")[-2:] == [pooler, classifier]
    assert traced.total_flops == 2 * sum(_encoder_layer_flops(tokens, SEQ)) + pooler + classifier


def test_hf_vit_image_classification() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        intermediate_size=INTER,
        num_labels=5,
    )
    model = transformers.ViTForImageClassification(config)
    pixels = torch.empty(BATCH, 3, 8, 8, device="meta")
    traced = ColoTracer().trace(model, {"pixel_values": pixels})
    assert traced.backend == "export"
    _check_meta(traced)
    conv = [i for i in traced.nodes if i.target.startswith("aten.conv2d")]
    assert len(conv) == 1 and conv[0].shape == (BATCH, HIDDEN, 2, 2)
    # each output element of the patch projection: 3 channels x 4 x 4 multiply-adds
    assert conv[0].flops == 2 * (BATCH * HIDDEN * 2 * 2) * 3 * 4 * 4
    seq = 2 * 2 + 1  # 4 patches and the [CLS] token
    tokens = BATCH * seq
    linears = _flops_of(traced, "aten.linear")
    attention = _flops_of(traced, "aten.scaled_dot_product_attention")
    assert linears[:6] + attention[:1] == _encoder_layer_flops(tokens, seq)
    classifier = 2 * BATCH * HIDDEN * 5  # on the [CLS] token only
    assert linears[-1] == classifier
    assert traced.total_flops == (
        conv[0].flops + 2 * sum(_encoder_layer_flops(tokens, seq)) + classifier
    )
    logits = traced.nodes[-2]
    assert logits.shape == (BATCH, 5) and logits.dtypes == (torch.float32,)


class _Bottleneck(torch.nn.Module):
    """timm/torchvision ``Bottleneck``: 1x1 reduce, 3x3 (strided), 1x1 expand, projected skip."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = torch.nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(width)
        self.conv2 = torch.nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(width)
        self.conv3 = torch.nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = torch.nn.BatchNorm2d(out_ch)
        self.act = torch.nn.ReLU(inplace=True)
        self.downsample: torch.nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = torch.nn.Sequential(
                torch.nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                torch.nn.BatchNorm2d(out_ch),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.act(self.bn1(self.conv1(x)))
        out = self.act(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.act(out + shortcut)


class _ResNet(torch.nn.Module):
    """A two-stage ResNet-50-style net: conv-bn-relu-maxpool stem, Bottleneck stages, pooled fc."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 7, stride=2, padding=3, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.act1 = torch.nn.ReLU(inplace=True)
        self.maxpool = torch.nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = torch.nn.Sequential(_Bottleneck(8, 4, 1), _Bottleneck(16, 4, 1))
        self.layer2 = torch.nn.Sequential(_Bottleneck(16, 8, 2), _Bottleneck(32, 8, 1))
        self.global_pool = torch.nn.AdaptiveAvgPool2d(1)
        self.fc = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.act1(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.global_pool(x), 1))


def _strided_block_flops() -> list[int]:
    """Hand count of ``layer2.0`` on a 16 x 8 x 8 input: skip projection, conv1, conv2, conv3."""
    return [
        2 * (BATCH * 32 * 4 * 4) * 16,  # projection 1x1 stride 2, 16 -> 32 at 4 x 4
        2 * (BATCH * 8 * 8 * 8) * 16,  # 1x1, 16 -> 8 channels at 8 x 8
        2 * (BATCH * 8 * 4 * 4) * 8 * 9,  # 3x3 stride 2, 8 -> 8 at 4 x 4
        2 * (BATCH * 32 * 4 * 4) * 8,  # 1x1, 8 -> 32 at 4 x 4
    ]


@pytest.mark.parametrize("backend", ["fx", "export"])
def test_timm_style_resnet_bottleneck(backend: str) -> None:
    torch.manual_seed(0)
    model = _ResNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    traced = ColoTracer(backend=backend).trace(  # type: ignore[arg-type]
        model, {"x": torch.empty(BATCH, 3, 32, 32, device="meta")}
    )
    assert traced.backend == backend
    _check_meta(traced)
    # BatchNorm ran in training mode on fake tensors: running stats are untouched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    convs = [i for i in traced.nodes if i.flops and len(i.shape or ()) == 4]
    assert len(convs) == 1 + 2 * 3 + 2 * 3 + 2  # stem, 3 per block, 2 projections
    stem = convs[0]
    assert stem.shape == (BATCH, 8, 16, 16)
    assert stem.flops == 2 * (BATCH * 8 * 16 * 16) * 3 * 49
    # forward order: stem, layer1.0 (skip projection first, then conv1-3), layer1.1, layer2.0...
    strided = convs[1 + 4 + 3 : 1 + 4 + 3 + 4]
    assert [i.flops for i in strided] == _strided_block_flops()
    assert [i.shape for i in strided] == [(BATCH, 32, 4, 4), (BATCH, 8, 8, 8), (BATCH, 8, 4, 4),
                                          (BATCH, 32, 4, 4)]  # fmt: skip
    norms = [
        i
        for i in traced.nodes
        if i.target.startswith("aten.batch_norm")
        or (i.op == "call_module" and isinstance(model.get_submodule(i.target), _BN))
    ]
    assert len(norms) == 1 + 3 * 4 + 2  # stem, 3 per block, 2 projections
    residual = [
        i for i in traced.nodes if i.target in ("<built-in function add>", "aten.add.Tensor")
    ]
    assert [i.shape for i in residual] == 2 * [(BATCH, 16, 8, 8)] + 2 * [(BATCH, 32, 4, 4)]
    assert traced.nodes[-2].shape == (BATCH, 10)
    assert traced.total_flops == sum(i.flops for i in convs) + 2 * BATCH * 32 * 10
    assert traced.param_bytes == sum(p.numel() * 4 for p in model.parameters())


def test_bert_groups_into_encoder_blocks() -> None:
    from kolossos.auto_parallel.module_graph import trace_operators
    from kolossos.auto_parallel.transformer_checkpoint import repeated_blocks

    ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    groups = trace_operators(_bert(), {"input_ids": ids, "labels": ids})
    by_name = {g.name: g for g in groups}
    layer = "bert.encoder.layer.1"
    attention = by_name[f"{layer}.attention.self.attention"]
    assert attention.kind == "attention"
    assert attention.inputs == [f"{layer}.attention.self.{n}" for n in ("query", "key", "value")]
    assert by_name[f"{layer}.attention.output.add"].inputs == [
        f"{layer}.attention.output.dense",
        "bert.encoder.layer.0.output.LayerNorm",
    ]
    assert by_name[f"{layer}.intermediate.intermediate_act_fn"].kind == "elementwise"
    assert by_name["cls.predictions.decoder"].kind == "linear"
    assert by_name["loss"].inputs == ["cls.predictions.decoder", "labels"]
    names, blocks = repeated_blocks(groups)
    assert names == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    assert all(len(b) == 12 for b in blocks)  # q k v, attention, out, add, norm, up, act, down...
    tokens = BATCH * SEQ
    assert sum(g.flops for g in groups if g.path.startswith(layer)) == sum(
        _encoder_layer_flops(tokens, SEQ)
    )


def test_vit_groups_with_the_patch_convolution() -> None:
    """ViT groups (details in ``test_auto_parallel_vit``): the patch convolution is a ``conv``
    operator, the CLS token and position embeddings a ``token_params`` operator."""
    transformers = pytest.importorskip("transformers")
    from kolossos.auto_parallel.module_graph import trace_operators

    config = transformers.ViTConfig(image_size=8, patch_size=4, hidden_size=HIDDEN,
                                    num_hidden_layers=1, num_attention_heads=HEADS,
                                    intermediate_size=INTER)  # fmt: skip
    model = transformers.ViTForImageClassification(config)
    pixels = torch.empty(BATCH, 3, 8, 8, device="meta")
    groups = trace_operators(model, {"pixel_values": pixels})
    kinds = {g.name: g.kind for g in groups}
    assert kinds["vit.embeddings.patch_embeddings.projection"] == "conv"
    assert kinds["vit.embeddings"] == "token_params"


class _LayerScale(torch.nn.Module):
    """A bare parameter multiplied into the activations: not a ``token_params`` operator."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(HIDDEN, HIDDEN)
        self.gamma = torch.nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.gamma


def test_grouping_names_an_unsupported_parameter_use() -> None:
    from kolossos.auto_parallel.module_graph import trace_operators
    from kolossos.auto_parallel.strategies import UnsupportedOperatorError

    x = torch.empty(BATCH, HIDDEN, device="meta")
    with pytest.raises(
        UnsupportedOperatorError,
        match=r"node 'mul' \(operator aten\.mul\.Tensor\) in module '' \(_LayerScale\)",
    ):
        trace_operators(_LayerScale(), {"x": x})
