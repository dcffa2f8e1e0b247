"""Colossal-AI's ``colossalai.legacy.pipeline`` (and ``colossalai.pipeline``'s legacy part):
:class:`PipelinableContext` and :class:`PipelinableModel`, which live in
:mod:`kolossos.pipeline.pipelinable`; also ``kolossos.legacy.pipeline.pipelinable``."""

from kolossos.legacy.pipeline import pipelinable
from kolossos.pipeline.pipelinable import PipelinableContext, PipelinableModel

__all__ = ["PipelinableContext", "PipelinableModel", "pipelinable"]
