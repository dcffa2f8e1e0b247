"""Colossal-AI's ``colossalai.builder`` (also ``colossalai.legacy.builder``): build objects from
config entries (:func:`build_from_config`, :func:`build_from_registry`, :func:`build_layer`,
:func:`build_model`) and pipelined models (:func:`build_pipeline_model` from an
``nn.Sequential``, :func:`build_pipeline_model_from_cfg` from a :class:`ModelFromConfig`);
``kolossos.legacy.builder.pipeline`` adds ``partition_uniform`` / ``partition_balanced``.
See docs/legacy.md, "Building a pipelined model"."""

from kolossos.legacy.builder import pipeline
from kolossos.legacy.builder.model_from_config import ModelFromConfig, build_layer
from kolossos.legacy.builder.pipeline import (
    build_model,
    build_pipeline_model,
    build_pipeline_model_from_cfg,
)
from kolossos.legacy.registry import build_from_config, build_from_registry

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
