"""Colossal-AI's old import path ``colossalai.builder`` (see :mod:`kolossos.legacy.builder`):
``from kolossos.builder import build_pipeline_model, build_pipeline_model_from_cfg``;
``kolossos.builder.pipeline`` adds ``partition_uniform`` / ``partition_balanced``."""

from kolossos.builder import pipeline
from kolossos.legacy.builder import (
    ModelFromConfig,
    build_from_config,
    build_from_registry,
    build_layer,
    build_model,
    build_pipeline_model,
    build_pipeline_model_from_cfg,
)

__all__ = [
    "ModelFromConfig",
    "build_from_config",
    "build_from_registry",
    "build_layer",
    "build_model",
    "build_pipeline_model",
    "build_pipeline_model_from_cfg",
    "pipeline",
]
