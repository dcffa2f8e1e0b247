"""Pins the signatures and import paths of Colossal-AI's legacy pipeline builders (v0.1.x / v0.2.x
``colossalai.builder`` and ``colossalai.builder.pipeline``, ``colossalai.nn.model``,
``colossalai.pipeline.pipelinable``, and their ``colossalai.legacy`` paths) in the notation of
``test_api_signatures.py``.

Upstream's parameter names, order and defaults are what scripts written against it use; change a
pin only on purpose, with a comment saying how and why it differs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
from pin_notation import P, describe

from kolossos.legacy.builder import ModelFromConfig
from kolossos.legacy.builder import pipeline as builder
from kolossos.pipeline.pipelinable import PipelinableContext

PINS: dict[str, tuple[Callable[..., Any], list[str]]] = {
    # upstream's num_chunks has no default; 1 (no interleaving) is the common value
    "builder.pipeline.partition_uniform": (
        builder.partition_uniform,
        P("num_items pipeline_parallel_size num_chunks=1"),
    ),
    "builder.pipeline.partition_balanced": (
        builder.partition_balanced,
        P("weights pipeline_parallel_size num_chunks=1"),
    ),
    "builder.build_pipeline_model": (
        builder.build_pipeline_model,
        P("layers num_chunks=1 verbose=False"),
    ),
    "builder.build_pipeline_model_from_cfg": (
        builder.build_pipeline_model_from_cfg,
        P("config num_chunks=1 partition_method='parameter' verbose=False"),
    ),
    "nn.model.ModelFromConfig.build_from_cfg": (
        ModelFromConfig.build_from_cfg,
        P("start=None end=None"),
    ),
    "pipeline.pipelinable.PipelinableContext.__init__": (
        PipelinableContext.__init__,
        P("policy='balanced'"),
    ),
    "pipeline.pipelinable.PipelinableContext.to_layer_list": (
        PipelinableContext.to_layer_list,
        P("exec_seq=None"),
    ),
    "pipeline.pipelinable.PipelinableContext.partition": (
        PipelinableContext.partition,
        P("num_chunks pipeline_size rank"),
    ),
}


@pytest.mark.parametrize("name", sorted(PINS))
def test_signature_is_pinned(name: str) -> None:
    fn, expected = PINS[name]
    assert describe(fn) == expected


IMPORTS = {
    "kolossos.builder": "build_pipeline_model build_pipeline_model_from_cfg",
    "kolossos.builder.pipeline": (
        "partition_uniform partition_balanced build_pipeline_model build_pipeline_model_from_cfg"
    ),
    "kolossos.legacy.builder": "build_pipeline_model build_pipeline_model_from_cfg",
    "kolossos.legacy.builder.pipeline": "partition_uniform partition_balanced",
    "kolossos.nn.model": "ModelFromConfig",
    "kolossos.nn.layer.wrapper": "PipelineSharedModuleWrapper",
    "kolossos.pipeline": "PipelinableContext PipelinableModel",
    "kolossos.pipeline.pipelinable": "PipelinableContext PipelinableModel",
    "kolossos.legacy.pipeline": "PipelinableContext PipelinableModel",
    "kolossos.legacy.pipeline.pipelinable": "PipelinableContext PipelinableModel",
    "kolossos.registry": "LAYERS MODELS",
    "kolossos.legacy.registry": "LAYERS MODELS",
}


@pytest.mark.parametrize("module", sorted(IMPORTS))
def test_upstream_import_paths(module: str) -> None:
    imported = importlib.import_module(module)
    for name in IMPORTS[module].split():
        assert hasattr(imported, name), f"{module}.{name}"
