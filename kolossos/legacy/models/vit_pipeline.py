"""The pipelined ViT of the ViT tutorial (``PipelineVisionTransformer`` and
``build_pipeline_vit``): each pipeline rank builds only its blocks, split uniformly by
:func:`kolossos.pipeline.partition_uniform`; the first stage adds the embedding, the last the
final norm and the head.

Example (``parallel = dict(pipeline=2)``, 2 ranks)::

    model = build_pipeline_vit(num_layers=4, num_chunks=1, img_size=32, patch_size=4, dim=64,
                               depth=4, num_heads=4, num_classes=10)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import kolossos.legacy.nn as col_nn
from kolossos.legacy.context import ParallelMode
from kolossos.legacy.core import global_context as gpc
from kolossos.legacy.models.vit import ViTBlock, ViTEmbedding, ViTHead
from kolossos.logging import get_dist_logger
from kolossos.pipeline import partition_uniform
from kolossos.utils import get_current_device

__all__ = ["PipelineVisionTransformer", "build_pipeline_vit"]


def _global_rank() -> int:
    return gpc.get_global_rank() if gpc.is_initialized(ParallelMode.GLOBAL) else 0


class PipelineVisionTransformer(nn.Module):
    """Blocks ``start_idx .. end_idx - 1`` of a ViT in ``self.layers`` (an ``nn.Sequential``),
    with the embedding when ``first_stage`` and the norm and head when ``last_stage``; the
    arguments are :class:`~kolossos.legacy.models.vit.VisionTransformer`'s plus those four."""

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        depth: int = 12,
        num_heads: int = 12,
        dim: int = 768,
        mlp_ratio: int = 4,
        attention_dropout: float = 0.0,
        dropout: float = 0.1,
        drop_path: float = 0.0,
        layernorm_epsilon: float = 1e-6,
        activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu,
        representation_size: int | None = None,
        dtype: torch.dtype | None = None,
        bias: bool = True,
        checkpoint: bool = False,
        init_method: str = "torch",
        first_stage: bool = True,
        last_stage: bool = True,
        start_idx: int | None = None,
        end_idx: int | None = None,
    ) -> None:
        super().__init__()
        start = 0 if start_idx is None else start_idx
        end = depth if end_idx is None else end_idx
        if not 0 <= start <= end <= depth:
            raise ValueError(f"blocks [{start_idx}, {end_idx}) do not lie in [0, depth={depth}).")
        layers: list[nn.Module] = []
        if first_stage:
            layers.append(
                ViTEmbedding(img_size, patch_size, in_chans, dim, dropout, dtype, True, init_method)
            )
        dpr = [x.item() for x in torch.linspace(0, drop_path, depth)]
        layers += [
            ViTBlock(
                dim, num_heads, mlp_ratio, activation, attention_dropout, dropout, dpr[i],
                layernorm_epsilon, dtype, bias, checkpoint, init_method,
            )
            for i in range(start, end)
        ]  # fmt: skip
        if last_stage:
            layers.append(col_nn.LayerNorm(dim, eps=layernorm_epsilon, dtype=dtype))
            layers.append(ViTHead(dim, num_classes, representation_size, dtype, bias, init_method))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _filter_kwargs(func: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(func).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def _build_pipeline_vit(
    module_cls: Callable[..., nn.Module],
    num_layers: int,
    num_chunks: int,
    device: torch.device | str | None = None,
    **kwargs: Any,
) -> nn.Module:
    """This pipeline rank's chunk(s) of ``module_cls``: one module, or an ``nn.ModuleList`` of
    ``num_chunks`` (interleaved). One stage holding everything without pipeline parallelism."""
    logger = get_dist_logger()
    if gpc.is_initialized(ParallelMode.PIPELINE):
        size, rank = (
            gpc.get_world_size(ParallelMode.PIPELINE),
            gpc.get_local_rank(ParallelMode.PIPELINE),
        )
    else:
        size, rank = 1, 0
    models = []
    for start, end in partition_uniform(num_layers, size, num_chunks)[rank]:
        kwargs.update(first_stage=start == 0, last_stage=end == num_layers)
        kwargs.update(start_idx=start, end_idx=end)
        logger.info(
            f"Rank{_global_rank()} build layer {start}-{end}, {end - start}/{num_layers} layers"
        )
        chunk = module_cls(**_filter_kwargs(module_cls, kwargs))
        models.append(chunk.to(device if device is not None else get_current_device()))
    return models[0] if len(models) == 1 else nn.ModuleList(models)


def build_pipeline_vit(
    num_layers: int, num_chunks: int, device: torch.device | str | None = None, **kwargs: Any
) -> nn.Module:
    """This pipeline rank's :class:`PipelineVisionTransformer` chunk(s) (``num_layers`` blocks
    split uniformly; ``device`` default: the current device). ``kwargs`` are the model's."""
    return _build_pipeline_vit(PipelineVisionTransformer, num_layers, num_chunks, device, **kwargs)
