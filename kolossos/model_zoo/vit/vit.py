"""``model_zoo.vit.vit``: :mod:`kolossos.legacy.models.vit` and the pipeline builder of
:mod:`kolossos.legacy.models.vit_pipeline` under the tutorials' module name."""

from kolossos.legacy.models.vit import (
    VisionTransformer,
    ViTBlock,
    ViTEmbedding,
    ViTHead,
    ViTMLP,
    ViTSelfAttention,
    _create_vit_model,
)
from kolossos.legacy.models.vit_pipeline import PipelineVisionTransformer, build_pipeline_vit

__all__ = [
    "PipelineVisionTransformer",
    "ViTBlock",
    "ViTEmbedding",
    "ViTHead",
    "ViTMLP",
    "ViTSelfAttention",
    "VisionTransformer",
    "_create_vit_model",
    "build_pipeline_vit",
]
