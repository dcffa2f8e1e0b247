"""Pins the signatures of Colossal-AI's ``colossalai.shardformer.layer`` names (v0.3.4, plus the
v0.3.5+ norm converters and ``SeqParallelUtils``) and of ``ShardConfig`` / ``ShardFormer``.

The notation is that of ``test_api_signatures.py``: parameters in order as ``name`` (required),
``name=<repr of default>``, ``*name`` (keyword-only), ``*args`` / ``**kwargs``. ``PINS`` holds
kolossos' signatures; ``UPSTREAM`` holds Colossal-AI's, read from its source, and
:func:`test_upstream_calls_keep_their_meaning` checks that every upstream parameter sits at the
same position with the same default, so positional and keyword calls written for Colossal-AI
mean the same here. Deliberate differences are listed in ``DIFFERENT_DEFAULTS`` with the reason;
update a pin only on purpose.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
from pin_notation import P, describe

from kolossos.shardformer import ShardConfig, ShardFormer
from kolossos.shardformer import layer as sl
from kolossos.shardformer.layer import qkv_fused_linear, utils

LINEAR_COL = (
    "in_features out_features bias=True dtype=None device=None process_group=None "
    "gather_output=False seq_parallel=False seq_parallel_dim=1 overlap=None skip_bias_add=False "
    "weight=None bias_=None weight_initializer={init} bias_initializer={init}"
)
LINEAR_ROW = (
    "in_features out_features bias=True dtype=None device=None process_group=None "
    "seq_parallel=False seq_parallel_dim=1 parallel_input=True skip_bias_add=False weight=None "
    "bias_=None weight_initializer={init} bias_initializer={init} stream_chunk_num=1"
)
GPT2_COL = (
    "in_features out_features bias=True dtype=None device=None process_group=None "
    "async_communication=False gather_output=False seq_parallel=False overlap=False "
    "skip_bias_add=False n_fused=3 weight=None bias_=None weight_initializer={init} "
    "bias_initializer={init}"
)
GPT2_ROW = (
    "in_features out_features bias=True dtype=None device=None process_group=None "
    "seq_parallel=False parallel_input=True skip_bias_add=False weight=None bias_=None "
    "weight_initializer={init} bias_initializer={init} stream_chunk_num=1"
)
FUSED_COL = (
    "in_features out_features bias=True dtype=None device=None process_group=None "
    "async_communication=False gather_output=False skip_bias_add=False n_fused=3 weight=None "
    "bias_=None weight_initializer={init} bias_initializer={init}"
)
EMBEDDING = (
    "num_embeddings embedding_dim padding_idx=None dtype=None device=None process_group=None "
    "gather_output=True weight=None weight_initializer={init} *args **kwargs"
)
VOCAB = (
    "num_embeddings embedding_dim padding_idx=None dtype=None device=None process_group=None "
    "weight=None weight_initializer={init} *args **kwargs"
)
NATIVE = "module process_group *args **kwargs"
NORM = "module sp_partial_derived=False *args **kwargs"


def U(spec: str) -> list[str]:
    """An upstream signature; ``{init}`` stands for Colossal-AI's initializer defaults
    (``init.kaiming_uniform_(a=math.sqrt(5))``, ``init.xavier_uniform_(a=1, scale=1)``,
    ``init.normal_()``): function objects with no repr to compare."""
    return spec.format(init="<init>").split()


# name -> (kolossos object, kolossos pin, Colossal-AI's signature)
PINS: dict[str, tuple[Callable[..., Any], list[str], list[str]]] = {
    # kolossos' own options follow upstream's, keyword-only.
    "Linear1D_Col.__init__": (
        sl.Linear1D_Col.__init__,
        P(LINEAR_COL.format(init="None"))
        + P("*seq_parallel_mode=None *seq_dim=None *input_comm=True *fused_sections=None")
        + P("*conv1d_layout=False"),
        U(LINEAR_COL),
    ),
    "Linear1D_Col.from_native_module": (
        sl.Linear1D_Col.from_native_module,
        P("module process_group=None *args **kwargs"),
        U(NATIVE),
    ),
    "Linear1D_Row.__init__": (
        sl.Linear1D_Row.__init__,
        P(LINEAR_ROW.format(init="None"))
        + P("*seq_parallel_mode=None *seq_dim=None *conv1d_layout=False"),
        U(LINEAR_ROW),
    ),
    "Linear1D_Row.from_native_module": (
        sl.Linear1D_Row.from_native_module,
        P("module process_group=None *args **kwargs"),
        U(NATIVE),
    ),
    "Embedding1D.__init__": (
        sl.Embedding1D.__init__,
        P(EMBEDDING.format(init="None")),
        U(EMBEDDING),
    ),
    "Embedding1D.from_native_module": (
        sl.Embedding1D.from_native_module,
        P("module process_group=None *args **kwargs"),
        U("module process_group=None *args **kwargs"),
    ),
    # make_vocab_size_divisible_by, seq_parallel_mode, seq_dim: kolossos additions, keyword-only
    # between upstream's *args and **kwargs.
    "VocabParallelEmbedding1D.__init__": (
        sl.VocabParallelEmbedding1D.__init__,
        P(
            "num_embeddings embedding_dim padding_idx=None dtype=None device=None "
            "process_group=None weight=None weight_initializer=None *args "
            "*make_vocab_size_divisible_by=64 *seq_parallel_mode=None *seq_dim=1 **kwargs"
        ),
        U(VOCAB),
    ),
    "VocabParallelEmbedding1D.from_native_module": (
        sl.VocabParallelEmbedding1D.from_native_module,
        P("module process_group=None *args **kwargs"),
        U(NATIVE),
    ),
    "DropoutForParallelInput.__init__": (
        sl.DropoutForParallelInput.__init__,
        P("p=0.5 inplace=False process_group=None"),
        U("p=0.5 inplace=False process_group=None"),
    ),
    # **options: kolossos' Dropout1D base takes parallel_input there; appended.
    "DropoutForParallelInput.from_native_module": (
        sl.DropoutForParallelInput.from_native_module,
        P("module process_group=None **options"),
        U("module process_group=None"),
    ),
    "DropoutForReplicatedInput.__init__": (
        sl.DropoutForReplicatedInput.__init__,
        P("p=0.5 inplace=False process_group=None"),
        U("p=0.5 inplace=False process_group=None"),
    ),
    "DropoutForReplicatedInput.from_native_module": (
        sl.DropoutForReplicatedInput.from_native_module,
        P("module process_group=None **options"),
        U("module process_group=None"),
    ),
    # **options: further FusedLinear1D_Col / Linear1D_Col keywords, appended.
    "GPT2FusedLinearConv1D_Col.__init__": (
        sl.GPT2FusedLinearConv1D_Col.__init__,
        P(GPT2_COL.format(init="None")) + P("**options"),
        U(GPT2_COL),
    ),
    "GPT2FusedLinearConv1D_Col.from_native_module": (
        sl.GPT2FusedLinearConv1D_Col.from_native_module,
        P("module process_group=None *args **kwargs"),
        U(NATIVE),
    ),
    "GPT2FusedLinearConv1D_Row.__init__": (
        sl.GPT2FusedLinearConv1D_Row.__init__,
        P(GPT2_ROW.format(init="None")) + P("**options"),
        U(GPT2_ROW),
    ),
    "GPT2FusedLinearConv1D_Row.from_native_module": (
        sl.GPT2FusedLinearConv1D_Row.from_native_module,
        P("module process_group=None *args **kwargs"),
        U(NATIVE),
    ),
    "FusedLinear1D_Col.__init__": (
        sl.FusedLinear1D_Col.__init__,
        P(FUSED_COL.format(init="None")) + P("*fused_sections=None **options"),
        U(FUSED_COL),
    ),
    # n_fused=3: upstream requires it (and then does not pass it on to the constructor).
    "FusedLinear1D_Col.from_native_module": (
        sl.FusedLinear1D_Col.from_native_module,
        P("module process_group=None n_fused=3 *args *fused_sections=None **kwargs"),
        U("module process_group n_fused *args **kwargs"),
    ),
    # sp_partial_derived: v0.3.5+ (v0.3.4: module *args **kwargs, which a positional call maps
    # the same way except for the second argument).
    "FusedLayerNorm.from_native_module": (sl.FusedLayerNorm.from_native_module, P(NORM), U(NORM)),
    "FusedRMSNorm.from_native_module": (sl.FusedRMSNorm.from_native_module, P(NORM), U(NORM)),
    "LayerNorm.from_native_module": (sl.LayerNorm.from_native_module, P(NORM), U(NORM)),
    "RMSNorm.from_native_module": (sl.RMSNorm.from_native_module, P(NORM), U(NORM)),
    "cross_entropy_1d": (
        sl.cross_entropy_1d,
        P("vocab_logits labels ignore_index=-100 process_group=None"),
        U("vocab_logits labels ignore_index=-100 process_group=None"),
    ),
    "split_fused_qkv_in_gpt2_style": (
        qkv_fused_linear.split_fused_qkv_in_gpt2_style,
        P("qkv n_fused process_group is_transposed=False"),
        U("qkv n_fused process_group is_transposed=False"),
    ),
    "gather_fused_qkv_in_gpt2_style": (
        qkv_fused_linear.gather_fused_qkv_in_gpt2_style,
        P("qkv n_fused process_group is_transposed=False"),
        U("qkv n_fused process_group is_transposed=False"),
    ),
    "Randomizer.__init__": (utils.Randomizer.__init__, P("seed"), U("seed")),
    "Randomizer.fork_rng": (
        utils.Randomizer.fork_rng,
        P("enable_cpu=False"),
        U("enable_cpu=False"),
    ),
    "Randomizer.index": (utils.Randomizer.index, [], []),
    "Randomizer.increment_index": (utils.Randomizer.increment_index, [], []),
    "Randomizer.reset_index": (utils.Randomizer.reset_index, [], []),
    "Randomizer.is_randomizer_index_synchronized": (
        utils.Randomizer.is_randomizer_index_synchronized,
        P("process_group=None"),
        U("process_group=None"),
    ),
    "Randomizer.synchronize_index": (
        utils.Randomizer.synchronize_index,
        P("process_group=None"),
        U("process_group=None"),
    ),
    "create_randomizer_with_offset": (
        utils.create_randomizer_with_offset,
        P("seed process_group=None offset_by_rank=True offset_by_index=True"),
        U("seed process_group=None offset_by_rank=True offset_by_index=True"),
    ),
    "SeqParallelUtils.marked_as_sp_partial_derived_param": (
        utils.SeqParallelUtils.marked_as_sp_partial_derived_param,
        P("param"),
        U("param"),
    ),
    "SeqParallelUtils.is_sp_partial_derived_param": (
        utils.SeqParallelUtils.is_sp_partial_derived_param,
        P("param"),
        U("param"),
    ),
    "SeqParallelUtils.allreduce_partial_data_grad": (
        utils.SeqParallelUtils.allreduce_partial_data_grad,
        P("tp_group model=None grads=None"),
        U("tp_group model=None grads=None"),
    ),
    "ShardFormer.__init__": (ShardFormer.__init__, P("shard_config"), U("shard_config")),
    "ShardFormer.optimize": (ShardFormer.optimize, P("model policy=None"), U("model policy=None")),
}

#: (pin, parameter): why kolossos' default differs from Colossal-AI's
DIFFERENT_DEFAULTS: dict[tuple[str, str], str] = {
    **{
        (pin, param): "None: the dense layer's own initialisation (nn.Linear / nn.Embedding) of "
        "the full tensor, then sliced, so a layer built after the same seed equals the dense "
        "one; a callable is applied to the local shard as in Colossal-AI"
        for pin in PINS
        if pin.endswith("__init__")
        for param in ("weight_initializer", "bias_initializer")
    },
    **{
        (pin, "process_group"): "None (the world group) instead of required, as the "
        "constructors already have it"
        for pin in PINS
        if pin.endswith("from_native_module")
    },
    ("FusedLinear1D_Col.from_native_module", "n_fused"): "3 (q, k, v) instead of required",
}


@pytest.mark.parametrize("name", sorted(PINS))
def test_signature_is_pinned(name: str) -> None:
    fn, expected, _ = PINS[name]
    assert describe(fn) == expected


def _split(token: str) -> tuple[str, str | None]:
    name, _, default = token.partition("=")
    return name.lstrip("*"), (default or None)


@pytest.mark.parametrize("name", sorted(PINS))
def test_upstream_calls_keep_their_meaning(name: str) -> None:
    """Every upstream parameter is at the same position (positional ones), of the same kind and
    with the same default, unless ``DIFFERENT_DEFAULTS`` says why not; kolossos' own parameters
    come after upstream's positional ones."""
    fn, _, upstream = PINS[name]
    ours = describe(fn)
    ours_by_name = {_split(t)[0]: t for t in ours}
    for position, token in enumerate(upstream):
        param, default = _split(token)
        assert param in ours_by_name, f"{name}: upstream parameter {param} is missing"
        mine = ours_by_name[param]
        if not token.startswith("*"):  # positional-or-keyword: the same slot
            assert ours[position] == mine, f"{name}: {param} moved from position {position}"
        assert mine.startswith("**") == token.startswith("**"), f"{name}: {param} kind"
        assert (mine.startswith("*") and not mine.startswith("**")) == (
            token.startswith("*") and not token.startswith("**")
        ), f"{name}: {param} kind"
        if _split(mine)[1] != default:
            assert (name, param) in DIFFERENT_DEFAULTS, f"{name}: {param} {mine} vs {token}"


# Colossal-AI's ShardConfig fields (v0.3.4; v0.3.5+ adds extra_kwargs) and their defaults.
UPSTREAM_SHARD_CONFIG = {
    "tensor_parallel_process_group": None,
    "pipeline_stage_manager": None,
    "enable_tensor_parallelism": True,
    "enable_fused_normalization": False,
    "enable_flash_attention": False,
    "enable_jit_fused": False,
    "enable_all_optimization": False,
    "inference_only": False,
    "inference_gptq": False,
    "enable_sequence_parallelism": False,
    "enable_sequence_overlap": False,
    "extra_kwargs": "<factory>",
}


def test_shard_config_has_every_upstream_field_with_its_default() -> None:
    """All keyword-only (upstream's dataclass is positional too, but its docs and plugins pass
    keywords); kolossos adds ``sequence_parallelism_mode`` (v0.4's name),
    ``parallel_output`` (a class attribute upstream) and ``make_vocab_size_divisible_by``."""
    pin = describe(ShardConfig.__init__)
    assert pin == P(
        "*tensor_parallel_process_group=None *pipeline_stage_manager=None "
        "*enable_tensor_parallelism=True *enable_sequence_parallelism=False "
        "*sequence_parallelism_mode='split_gather' *enable_sequence_overlap=False "
        "*enable_fused_normalization=False *enable_flash_attention=False "
        "*enable_jit_fused=False *enable_all_optimization=False *inference_only=False "
        "*inference_gptq=False *extra_kwargs=<factory> *parallel_output=True "
        "*make_vocab_size_divisible_by=64 *gradient_checkpoint_config=None"
    )
    ours = dict(_split(token) for token in pin)
    for field, default in UPSTREAM_SHARD_CONFIG.items():
        assert ours[field] == repr(default) if default != "<factory>" else ours[field] == default


DOC_IMPORTS = [
    "kolossos.shardformer.ShardConfig",
    "kolossos.shardformer.ShardFormer",
    *(f"kolossos.shardformer.layer.{name}" for name in sl.__all__),
    "kolossos.shardformer.layer.linear.Linear1D_Col",
    "kolossos.shardformer.layer.linear.Linear1D_Row",
    "kolossos.shardformer.layer.embedding.VocabParallelEmbedding1D",
    "kolossos.shardformer.layer.dropout.DropoutForReplicatedInput",
    "kolossos.shardformer.layer.loss.cross_entropy_1d",
    "kolossos.shardformer.layer.normalization.FusedLayerNorm",
    "kolossos.shardformer.layer.parallel_module.ParallelModule",
    "kolossos.shardformer.layer.qkv_fused_linear.split_fused_qkv_in_gpt2_style",
    "kolossos.shardformer.layer.qkv_fused_linear.gather_fused_qkv_in_gpt2_style",
    "kolossos.shardformer.layer.utils.Randomizer",
    "kolossos.shardformer.layer.utils.create_randomizer_with_offset",
    "kolossos.shardformer.layer.utils.SeqParallelUtils",
]


@pytest.mark.parametrize("dotted", DOC_IMPORTS)
def test_import_path_resolves(dotted: str) -> None:
    module, _, name = dotted.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))


def test_upstream_layer_names_are_all_there() -> None:
    upstream = {
        "Embedding1D",
        "VocabParallelEmbedding1D",
        "Linear1D_Col",
        "Linear1D_Row",
        "GPT2FusedLinearConv1D_Col",
        "GPT2FusedLinearConv1D_Row",
        "DropoutForParallelInput",
        "DropoutForReplicatedInput",
        "cross_entropy_1d",
        "BaseLayerNorm",
        "LayerNorm",
        "RMSNorm",
        "FusedLayerNorm",
        "FusedRMSNorm",
        "FusedLinear1D_Col",
        "ParallelModule",
    }
    assert upstream == set(sl.__all__)
