"""Models built from the legacy generation's layers (``gpc``'s tensor-parallel modes).

:mod:`kolossos.legacy.models.vit_nd`: a Vision Transformer in any tensor mode (dense, 1D, 2D,
2.5D, 3D) with exact weight copies to and from its dense twin.

The model zoo of the tutorials (also importable as ``kolossos.model_zoo.vit.vit`` and
``kolossos.model_zoo.gpt.gpt``): :mod:`.vit` (``ViTEmbedding``, ``ViTBlock``, ``ViTHead``,
``VisionTransformer``, ``_create_vit_model``), :mod:`.vit_pipeline` (``build_pipeline_vit``),
:mod:`.gpt` (``GPTEmbedding``, ``GPTBlock``, ``GPTLMHead``, ``GPTLMLoss``, ``GPT``) and
:mod:`.gpt_pipeline` (``PipelineGPTHybrid``, ``GPT2_exlarge_pipeline_hybrid``,
``GPT3_pipeline_hybrid``), built from the config-driven layers so they follow the launch's
tensor mode; see docs/legacy.md.
"""

from kolossos.legacy.models.gpt import GPT, GPTBlock, GPTEmbedding, GPTLMHead, GPTLMLoss
from kolossos.legacy.models.gpt_pipeline import (
    GPT2_exlarge_pipeline_hybrid,
    GPT3_pipeline_hybrid,
    PipelineGPTHybrid,
    build_gpt_pipeline,
)
from kolossos.legacy.models.vit import (
    VisionTransformer,
    ViTBlock,
    ViTEmbedding,
    ViTHead,
    _create_vit_model,
)
from kolossos.legacy.models.vit_nd import (
    VisionTransformerND,
    ViTConfig,
    full_state_dict,
    load_full_state_dict,
    qkv_head_major,
    vit_criterion,
)
from kolossos.legacy.models.vit_pipeline import PipelineVisionTransformer, build_pipeline_vit

__all__ = [
    "GPT",
    "GPT2_exlarge_pipeline_hybrid",
    "GPT3_pipeline_hybrid",
    "GPTBlock",
    "GPTEmbedding",
    "GPTLMHead",
    "GPTLMLoss",
    "PipelineGPTHybrid",
    "PipelineVisionTransformer",
    "ViTBlock",
    "ViTConfig",
    "ViTEmbedding",
    "ViTHead",
    "VisionTransformer",
    "VisionTransformerND",
    "_create_vit_model",
    "build_gpt_pipeline",
    "build_pipeline_vit",
    "full_state_dict",
    "load_full_state_dict",
    "qkv_head_major",
    "vit_criterion",
]
