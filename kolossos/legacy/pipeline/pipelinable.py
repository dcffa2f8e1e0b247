"""Colossal-AI's ``colossalai.legacy.pipeline.pipelinable``: see
:mod:`kolossos.pipeline.pipelinable`."""

from kolossos.pipeline.pipelinable import SPLIT_NODE, PipelinableContext, PipelinableModel

__all__ = ["SPLIT_NODE", "PipelinableContext", "PipelinableModel"]
