"""ShardFormer's configuration, family lookup and plan validation. Pure logic: no process group
(``validate_plan`` takes the tensor-parallel size as a number)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import transformers as tf
from torch import nn

from kolossos.shardformer import (
    BlockPlan,
    ModelPlan,
    ParallelLayer,
    Policy,
    ShardConfig,
    ShardFormer,
    StageLayout,
    TPRegion,
    get_autopolicy,
)
from kolossos.shardformer.policies import (
    BertPolicy,
    GPT2Policy,
    LlamaPolicy,
    OPTPolicy,
    ViTPolicy,
)
from kolossos.shardformer.sharder import tied_groups
from kolossos.shardformer.validate import validate_plan

QUIET = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
SMALL = {"num_hidden_layers": 2, "num_attention_heads": 4}


def gpt2_lm(heads: int = 4) -> nn.Module:
    return tf.GPT2LMHeadModel(
        tf.GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=heads, **QUIET)
    )


def llama(kv_heads: int = 2, cls: type = tf.LlamaForCausalLM) -> nn.Module:
    return cls(
        tf.LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_key_value_heads=kv_heads,
            max_position_embeddings=16,
            **SMALL,
            **QUIET,
        )
    )


MODELS = {
    "GPT2LMHeadModel": (gpt2_lm, GPT2Policy),
    "GPT2Model": (lambda: tf.GPT2Model(tf.GPT2Config(n_embd=32, n_layer=2, n_head=4)), GPT2Policy),
    "GPT2ForSequenceClassification": (
        lambda: tf.GPT2ForSequenceClassification(
            tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, pad_token_id=0)
        ),
        GPT2Policy,
    ),
    "LlamaForCausalLM": (lambda: llama(kv_heads=4), LlamaPolicy),
    "LlamaModel": (lambda: llama(kv_heads=4, cls=tf.LlamaModel), LlamaPolicy),
    "BertForMaskedLM": (
        lambda: tf.BertForMaskedLM(
            tf.BertConfig(vocab_size=128, hidden_size=32, intermediate_size=64, **SMALL)
        ),
        BertPolicy,
    ),
    "BertModel": (
        lambda: tf.BertModel(
            tf.BertConfig(vocab_size=128, hidden_size=32, intermediate_size=64, **SMALL)
        ),
        BertPolicy,
    ),
    "ViTForImageClassification": (
        lambda: tf.ViTForImageClassification(
            tf.ViTConfig(
                image_size=24,
                patch_size=8,
                hidden_size=32,
                intermediate_size=64,
                num_labels=3,
                **SMALL,
            )
        ),
        ViTPolicy,
    ),
    "OPTForCausalLM": (
        lambda: tf.OPTForCausalLM(
            tf.OPTConfig(
                vocab_size=128,
                hidden_size=32,
                ffn_dim=64,
                word_embed_proj_dim=32,
                max_position_embeddings=16,
                **SMALL,
                **QUIET,
            )
        ),
        OPTPolicy,
    ),
}


# ---------------------------------------------------------------------------------------- config


def test_shard_config_defaults_and_rejections() -> None:
    cfg = ShardConfig()
    assert cfg.enable_tensor_parallelism and not cfg.enable_sequence_parallelism
    assert cfg.sequence_parallelism_mode == "split_gather" and cfg.parallel_output
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.parallel_output = False  # type: ignore[misc]
    assert ShardConfig(enable_all_optimization=True).enable_jit_fused  # switches the three on
    with pytest.raises(NotImplementedError, match=r"HybridParallelPlugin\(sp_size"):
        ShardConfig(enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all")
    with pytest.raises(ValueError, match="'zigzag' is unknown"):
        ShardConfig(enable_sequence_parallelism=True, sequence_parallelism_mode="zigzag")
    with pytest.raises(ValueError, match="needs enable_tensor_parallelism"):
        ShardConfig(enable_sequence_parallelism=True, enable_tensor_parallelism=False)
    with pytest.raises(TypeError, match="parallel_output"):
        ShardConfig(parallel_output="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by=0"):
        ShardConfig(make_vocab_size_divisible_by=0)
    # The mode is only read when sequence parallelism is on.
    assert ShardConfig(sequence_parallelism_mode="ring").sequence_parallelism_mode == "ring"


# ------------------------------------------------------------------------------- family lookup


@pytest.mark.parametrize("name", list(MODELS))
def test_every_supported_model_gets_a_fitting_plan(name: str) -> None:
    build, policy_cls = MODELS[name]
    model = build()
    policy = get_autopolicy(model)
    assert type(policy) is policy_cls
    plan = policy.plan(model)
    for tp in (1, 2, 4):
        for sp in (False, True):
            validate_plan(model, plan, tp, sp)
    layout = plan.layout
    for path in (*layout.embeddings, layout.blocks, *layout.final):
        model.get_submodule(path)  # the stage layout names real modules
    assert name in plan.describe() or plan.family in plan.describe()


def test_tied_groups_follow_the_model() -> None:
    assert tied_groups(gpt2_lm(), GPT2Policy().plan(gpt2_lm())) == [
        ["transformer.wte.weight", "lm_head.weight"]
    ]
    untied = llama()  # LLaMA does not tie by default
    assert tied_groups(untied, LlamaPolicy().plan(untied)) == []
    bert = MODELS["BertForMaskedLM"][0]()
    groups = tied_groups(bert, BertPolicy().plan(bert))
    assert ["bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"] in groups


def test_user_subclass_of_a_supported_class_uses_its_plan() -> None:
    class MyGPT2(tf.GPT2LMHeadModel):
        pass

    model = MyGPT2(tf.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64))
    assert isinstance(get_autopolicy(model), GPT2Policy)


@pytest.mark.parametrize(
    "model",
    [
        nn.Sequential(nn.Linear(4, 4)),
        tf.GPT2DoubleHeadsModel(tf.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64)),
    ],
    ids=["plain-torch", "unsupported-transformers-class"],
)
def test_unsupported_model_error_lists_families_and_the_fix(model: nn.Module) -> None:
    with pytest.raises(ValueError) as info:
        get_autopolicy(model)
    message = str(info.value)
    assert type(model).__name__ in message
    for family in ("gpt2:", "llama:", "bert:", "vit:", "opt:", "LlamaForCausalLM"):
        assert family in message
    assert "custom_policy" in message and "Policy" in message and "docs/shardformer.md" in message


def test_cross_attention_is_refused() -> None:
    config = tf.GPT2Config(n_embd=32, n_layer=1, n_head=4, add_cross_attention=True)
    with pytest.raises(NotImplementedError, match="add_cross_attention"):
        GPT2Policy().plan(tf.GPT2Model(config))


# -------------------------------------------------------------------------------- divisibility


def test_heads_not_divisible_by_tp_is_reported_with_the_rule() -> None:
    model = gpt2_lm()
    with pytest.raises(ValueError) as info:
        validate_plan(model, GPT2Policy().plan(model), 3, False)
    message = str(info.value)
    assert "num_attention_heads=4 is not divisible by tp_size=3" in message
    assert "n_inner (MLP width)=128 is not divisible by tp_size=3" in message


def test_llama_kv_heads_must_divide_by_tp() -> None:
    model = llama(kv_heads=2)
    validate_plan(model, LlamaPolicy().plan(model), 2, False)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tp_size=4"):
        validate_plan(model, LlamaPolicy().plan(model), 4, False)


def test_opt_layerdrop_disables_sequence_parallelism() -> None:
    model = MODELS["OPTForCausalLM"][0]()
    model.config.layerdrop = 0.1
    plan = OPTPolicy().plan(model)
    validate_plan(model, plan, 2, False)
    with pytest.raises(ValueError, match=re.escape("layerdrop=0.1")):
        validate_plan(model, plan, 2, True)


# ---------------------------------------------------------------------------- plan validation


def test_plan_types_validate_their_fields() -> None:
    with pytest.raises(ValueError, match="style='diagonal' is unknown"):
        ParallelLayer(path="fc", style="diagonal")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fused_sections"):
        ParallelLayer(path="c_attn", style="fused_column")
    with pytest.raises(ValueError, match="fused_sections"):
        ParallelLayer(path="fc", style="column", fused_sections=(4, 4))
    with pytest.raises(ValueError, match="dotted sub-module name"):
        ParallelLayer(path="attn..c_attn", style="column")
    with pytest.raises(ValueError, match="identifier"):
        TPRegion(path="mlp", arg="hidden states")


def _gpt2_plan_with(**block_changes: object) -> tuple[nn.Module, ModelPlan]:
    model = gpt2_lm()
    plan = GPT2Policy().plan(model)
    return model, dataclasses.replace(plan, block=dataclasses.replace(plan.block, **block_changes))


def test_column_layer_outside_every_region_is_refused() -> None:
    model, plan = _gpt2_plan_with(regions=(TPRegion(path="attn"),))
    with pytest.raises(ValueError, match=re.escape("column layer 'mlp.c_fc' lies in no TPRegion")):
        validate_plan(model, plan, 2, False)


def test_missing_paths_wrong_modules_and_attribute_mismatches_are_listed() -> None:
    model, plan = _gpt2_plan_with(
        layers=(
            ParallelLayer(path="attn.c_attn", style="fused_column", fused_sections=(32, 32, 16)),
            ParallelLayer(path="attn.q_proj", style="column"),
            ParallelLayer(path="ln_1", style="row"),
        ),
    )
    plan = dataclasses.replace(
        plan,
        block=dataclasses.replace(
            plan.block,
            attributes=(dataclasses.replace(plan.block.attributes[0], full=8),),
        ),
    )
    with pytest.raises(ValueError) as info:
        validate_plan(model, plan, 2, False)
    message = str(info.value)
    assert "fused_sections=(32, 32, 16) must sum to out_features=96" in message
    assert "no sub-module 'attn.q_proj'" in message
    assert "ln_1 (row) is a LayerNorm, expected nn.Linear or Conv1D" in message
    assert "attn.num_heads=4, the plan expects 8" in message


def test_region_argument_must_exist() -> None:
    model, plan = _gpt2_plan_with(regions=(TPRegion(path="attn", arg="x"), TPRegion(path="mlp")))
    with pytest.raises(ValueError, match="region 'attn': forward has no 'x' argument"):
        validate_plan(model, plan, 2, False)


def test_sequence_parallelism_needs_every_block_parameter_declared() -> None:
    model, plan = _gpt2_plan_with(sequence_norms=("ln_1",))
    validate_plan(model, plan, 2, False)  # without SP replicated norms need no declaration
    message = "parameter 'ln_2.weight' is neither sharded nor declared"
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_plan(model, plan, 2, True)


def test_model_level_column_layers_are_refused() -> None:
    model = gpt2_lm()
    plan = GPT2Policy().plan(model)
    plan = dataclasses.replace(
        plan, layers=(*plan.layers, ParallelLayer(path="transformer.h.0.mlp.c_fc", style="column"))
    )
    with pytest.raises(ValueError, match="model-level layers may only be embeddings or lm_head"):
        validate_plan(model, plan, 2, False)


def test_tied_names_must_exist() -> None:
    model = gpt2_lm()
    plan = GPT2Policy().plan(model)
    layout = dataclasses.replace(plan.layout, tied=(("transformer.wte.weight", "head.weight"),))
    with pytest.raises(ValueError, match=re.escape("tied: no parameter 'head.weight'")):
        validate_plan(model, dataclasses.replace(plan, layout=layout), 2, False)


def test_a_custom_policy_is_a_plain_subclass() -> None:
    class MLPPolicy(Policy):
        def plan(self, model: nn.Module) -> ModelPlan:
            return ModelPlan(
                family="mlp-stack",
                layout=StageLayout(embeddings=(), blocks="blocks"),
                block=BlockPlan(
                    layers=(
                        ParallelLayer(path="0", style="column"),
                        ParallelLayer(path="2", style="row"),
                    ),
                    regions=(TPRegion(path="0", arg="input"),),
                ),
            )

    blocks = nn.ModuleList(
        [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(2)]
    )
    model = nn.Module()
    model.blocks = blocks
    validate_plan(model, MLPPolicy().plan(model), 2, False)
    with pytest.raises(ValueError, match="out_features=16 is not divisible by tp_size=3"):
        validate_plan(model, MLPPolicy().plan(model), 3, False)
    assert torch.is_tensor(blocks[0][0].weight)  # validation changed nothing


def test_without_tensor_parallelism_the_model_is_untouched() -> None:
    former = ShardFormer(ShardConfig(enable_tensor_parallelism=False))
    model = gpt2_lm()
    modules = [type(m) for m in model.modules()]
    same, shared = former.optimize(model)
    assert same is model and [type(m) for m in model.modules()] == modules
    assert shared == [
        {"transformer.wte.weight": model.lm_head.weight, "lm_head.weight": model.lm_head.weight}
    ]
    plain = nn.Sequential(nn.Linear(4, 4))
    assert former.optimize(plain) == (plain, [])  # no plan needed when nothing is sharded
    with pytest.raises(TypeError, match="must be None"):
        former.optimize(model, policy="gpt2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a ShardConfig"):
        ShardFormer({"enable_tensor_parallelism": False})  # type: ignore[arg-type]
