"""Models built from the legacy generation's layers (``gpc``'s tensor-parallel modes).

:mod:`kolossos.legacy.models.vit_nd`: a Vision Transformer in any tensor mode (dense, 1D, 2D,
2.5D, 3D) with exact weight copies to and from its dense twin.
"""

from kolossos.legacy.models.vit_nd import (
    VisionTransformerND,
    ViTConfig,
    full_state_dict,
    load_full_state_dict,
    qkv_head_major,
    vit_criterion,
)

__all__ = [
    "ViTConfig",
    "VisionTransformerND",
    "full_state_dict",
    "load_full_state_dict",
    "qkv_head_major",
    "vit_criterion",
]
