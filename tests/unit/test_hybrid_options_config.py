"""HybridParallelPlugin / ShardConfig options: accepted, validated, clear errors (no process
group needed)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kolossos.hybrid.config import HybridParallelConfig
from kolossos.hybrid.sharding import check_shard_options
from kolossos.shardformer import (
    GradientCheckpointConfig,
    PipelineGradientCheckpointConfig,
    ShardConfig,
)
from kolossos.shardformer.layer.aligned_head import AlignedLMHead, align_lm_head
from kolossos.shardformer.layer.fused import dropout_add, eager_dropout_add, fused_kernel_name
from kolossos.shardformer.modeling.jit_fused import (
    TANH_GELU_CLASSES,
    apply_jit_fused,
    fuse_activations,
)
from kolossos.shardformer.optimizations import checkpoint_blocks, fuse_norms
from kolossos.zero.low_level.overlap import plan_gather_buckets
from kolossos.zero.low_level.partition import FlatLayout


@pytest.mark.parametrize(
    "option",
    [
        {"enable_flash_attention": True},
        {"enable_fused_normalization": True},
        {"enable_jit_fused": True},
        {"enable_all_optimization": True},
        {"gradient_checkpoint_config": GradientCheckpointConfig(gradient_checkpointing_ratio=0.5)},
        {"overlap_allgather": True, "zero_stage": 1},
        {"overlap_allgather": True, "zero_stage": 2},
    ],
)
def test_options_are_accepted(option: dict) -> None:
    config = HybridParallelConfig(tp_size=2, **option)
    check_shard_options(config)  # builds the ShardConfig: nothing refused


def test_all_optimization_switches_on_the_three() -> None:
    config = ShardConfig(enable_all_optimization=True, enable_tensor_parallelism=False)
    assert config.enable_flash_attention and config.enable_fused_normalization
    assert config.enable_jit_fused and config.optimizations_requested


def test_overlap_allgather_needs_zero() -> None:
    with pytest.raises(ValueError, match="overlap_allgather=True with zero_stage=0"):
        HybridParallelConfig(tp_size=1, overlap_allgather=True)


def test_bad_checkpoint_configs() -> None:
    with pytest.raises(TypeError, match="gradient_checkpoint_config"):
        HybridParallelConfig(tp_size=1, gradient_checkpoint_config=0.5)
    with pytest.raises(ValueError, match="gradient_checkpointing_ratio"):
        GradientCheckpointConfig(gradient_checkpointing_ratio=1.5)
    with pytest.raises(ValueError, match="num_ckpt_layers_per_stage"):
        PipelineGradientCheckpointConfig(num_ckpt_layers_per_stage=[1, -1])
    counts = PipelineGradientCheckpointConfig(num_ckpt_layers_per_stage=[1, 2, 0])
    with pytest.raises(ValueError, match=r"num_ckpt_layers_per_stage=.*pp_size=2"):
        HybridParallelConfig(tp_size=1, pp_size=2, num_microbatches=2,
                             gradient_checkpoint_config=counts)  # fmt: skip
    with pytest.raises(TypeError, match="gradient_checkpoint_config"):
        ShardConfig(gradient_checkpoint_config={"ratio": 1})


def test_checkpoint_layer_counts() -> None:
    assert GradientCheckpointConfig(gradient_checkpointing_ratio=0.5).get_num_ckpt_layers(5) == 2
    pipe = PipelineGradientCheckpointConfig(num_ckpt_layers_per_stage=[2, 0, 1, 1])
    assert pipe.get_num_ckpt_layers(1, 2, 3, model_chunk_id=1, num_model_chunks=2) == 1
    assert pipe.get_num_ckpt_layers(0, 2, 3, model_chunk_id=0, num_model_chunks=2) == 2
    with pytest.raises(ValueError, match="holds only 1"):
        pipe.get_num_ckpt_layers(0, 4, 1)
    ratio = PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=0.5)
    assert ratio.get_num_ckpt_layers(0, 2, 4) == 2


def test_sequence_overlap_needs_sequence_parallelism() -> None:
    with pytest.raises(ValueError, match=r"enable_sequence_overlap=True.*enable_sequence_paral"):
        ShardConfig(enable_sequence_overlap=True)
    with pytest.raises(NotImplementedError, match="'ring', enable_sequence_overlap=True"):
        ShardConfig(
            enable_sequence_parallelism=True,
            sequence_parallelism_mode="ring",
            enable_sequence_overlap=True,
        )
    on = ShardConfig(enable_sequence_parallelism=True, enable_sequence_overlap=True)
    assert on.enable_sequence_overlap and on.sequence_parallelism_mode == "split_gather"
    ring = ShardConfig(enable_sequence_parallelism=True, sequence_parallelism_mode="ring")
    assert ring.sequence_parallelism_mode == "ring"


def test_dropout_add_is_the_unfused_computation() -> None:
    x, r = torch.randn(4, 8), torch.randn(4, 8)
    assert fused_kernel_name(x.device) == "eager"
    torch.testing.assert_close(dropout_add(x, r, 0.3, False), r + x, rtol=0, atol=0)
    torch.manual_seed(1)
    fused = dropout_add(x, r, 0.3, True)
    torch.manual_seed(1)
    plain = torch.nn.functional.dropout(x, 0.3, True) + r
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)
    torch.testing.assert_close(eager_dropout_add(x, r, 0.0, True), x + r, rtol=0, atol=0)


def test_jit_fused_refuses_unknown_blocks() -> None:
    with pytest.raises(NotImplementedError, match=r"enable_jit_fused=True.*Linear"):
        apply_jit_fused(nn.ModuleList([nn.Linear(2, 2)]))


@pytest.mark.parametrize("act", ["gelu_new", "gelu_fast"])
def test_jit_fused_gelu_same_numbers(act: str) -> None:
    """GPT-2's Python tanh-GELU becomes torch's fused one: same forward and gradients (fp32)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_embd=16, n_layer=1, n_head=2, activation_function=act, resid_pdrop=0.0, attn_pdrop=0.0
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    block = transformers.models.gpt2.modeling_gpt2.GPT2Block(config)
    fused_block = copy.deepcopy(block)
    assert apply_jit_fused(nn.ModuleList([fused_block])) == 1
    assert type(block.mlp.act).__name__ in TANH_GELU_CLASSES
    assert isinstance(fused_block.mlp.act, nn.GELU) and fused_block.mlp.act.approximate == "tanh"
    x = torch.randn(2, 5, 16) * 3
    outs, grads = [], []
    for module in (block, fused_block):
        xi = x.clone().requires_grad_()
        out = module(xi)
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()
        outs.append(out)
        grads.append(xi.grad)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
    assert fuse_activations(fused_block) == 0  # nothing left to replace


def test_fused_rms_norm_same_numbers() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model = nn.Sequential(LlamaRMSNorm(8, eps=1e-6))
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 8)
    expected = model(x)
    weight = model[0].weight
    assert fuse_norms(model) == 1 and model[0].weight is weight
    torch.testing.assert_close(model(x), expected, rtol=1e-6, atol=1e-6)
    assert transformers is not None


def test_generic_block_checkpointing_same_gradients() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    x = torch.randn(2, 4, requires_grad=True)
    block(x).sum().backward()
    expected = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    checkpoint_blocks([block])
    block(x).sum().backward()
    for got, want in zip((p.grad for p in block.parameters()), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_gather_buckets_hold_whole_parameters() -> None:
    layout = FlatLayout.of_shapes([(4,), (10,), (3,), (2,)], world_size=2)
    assert plan_gather_buckets(layout, 5) == [(0, 14), (14, 19)]
    assert plan_gather_buckets(layout, 1) == [(0, 4), (4, 14), (14, 17), (17, 19)]
    assert plan_gather_buckets(layout, 100) == [(0, 19)]


def test_aligned_lm_head_same_numbers_and_parameters() -> None:
    """The head's product over a padded vocabulary: same logits and gradients, the parameter
    (tied to the embedding) keeps its shape; aligned sizes and other modules are left alone."""
    torch.manual_seed(0)
    embedding = nn.Embedding(50, 8)
    head = nn.Linear(8, 50, bias=True)
    head.weight = embedding.weight
    plain = copy.deepcopy(head)
    assert align_lm_head(head, 16) and type(head) is AlignedLMHead
    assert head.weight is embedding.weight and head.weight.shape == (50, 8)
    head.devices = ("cpu",)  # pad on the CPU too, to check the padded product here
    assert not align_lm_head(nn.Linear(8, 64), 16) and not align_lm_head(nn.Identity(), 16)
    x = torch.randn(3, 5, 8)
    outs, grads = [], []
    for module in (plain, head):
        module.zero_grad()
        out = module(x)
        assert out.shape == (3, 5, 50) and out.is_contiguous()  # callers .view() logits
        out.square().sum().backward()
        outs.append(out)
        grads.append((module.weight.grad.clone(), module.bias.grad.clone()))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert set(head.state_dict()) == {"weight", "bias"}


def test_tp1_aligns_the_head_without_other_options() -> None:
    """tp 1 with nothing for ShardFormer to do: the plan's LM head still runs aligned (tie and
    parameters kept); ``make_vocab_size_divisible_by=1`` or a model without a plan: unchanged."""
    transformers = pytest.importorskip("transformers")
    from kolossos.hybrid.sharding import needs_sharding, shard_model

    def gpt2() -> nn.Module:
        config = transformers.GPT2Config(vocab_size=500, n_embd=16, n_layer=1, n_head=2)
        return transformers.GPT2LMHeadModel(config)

    config = HybridParallelConfig(tp_size=1)
    assert not needs_sharding(config)
    model = gpt2()
    params = dict(model.named_parameters())
    assert shard_model(model, config, None) is model  # type: ignore[arg-type]
    assert type(model.lm_head) is AlignedLMHead and model.lm_head.multiple == 64
    assert model.lm_head.weight is model.transformer.wte.weight
    assert dict(model.named_parameters()) == params
    plain = gpt2()
    shard_model(plain, HybridParallelConfig(tp_size=1, make_vocab_size_divisible_by=1), None)  # type: ignore[arg-type]
    assert type(plain.lm_head) is nn.Linear
    other = nn.Sequential(nn.Linear(4, 500))
    shard_model(other, config, None)  # type: ignore[arg-type]
    assert type(other[0]) is nn.Linear
