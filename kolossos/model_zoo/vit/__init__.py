"""``model_zoo.vit``: the zoo's ViT (:mod:`kolossos.model_zoo.vit.vit`), resolved lazily."""

from __future__ import annotations

from kolossos._lazy import lazy_attributes

_VIT = "kolossos.legacy.models.vit"
_LAZY = {
    **{
        name: (_VIT, name)
        for name in (
            "ViTBlock",
            "ViTEmbedding",
            "ViTHead",
            "VisionTransformer",
            "_create_vit_model",
        )
    },
    "build_pipeline_vit": ("kolossos.legacy.models.vit_pipeline", "build_pipeline_vit"),
}

__all__ = ["ViTBlock", "ViTEmbedding", "ViTHead", "VisionTransformer", "build_pipeline_vit"]

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
