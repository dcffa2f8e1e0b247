"""Pipeline parallelism: stage manager and partitioning, point-to-point layer, schedules
(GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1 and ZB-V) run by one executor, shared
parameters across stages, and a schedule simulator (``python -m kolossos.pipeline.simulate``).

See docs/pipeline.md.
"""

from kolossos.pipeline.build import build_pipeline_model
from kolossos.pipeline.p2p import PipelineP2P
from kolossos.pipeline.p2p_communication import PipelineP2PCommunication
from kolossos.pipeline.partition import (
    partition_balanced,
    partition_layers,
    partition_uniform,
)
from kolossos.pipeline.pipelinable import PipelinableContext, PipelinableModel
from kolossos.pipeline.schedule import (
    GPipeSchedule,
    InterleavedSchedule,
    OneForwardOneBackwardSchedule,
    PipelineSchedule,
    ZeroBubbleH1Schedule,
    ZeroBubbleVSchedule,
    create_schedule,
)
from kolossos.pipeline.shared import PipelineSharedModuleWrapper, sync_shared_gradients
from kolossos.pipeline.stage_manager import PipelineStageManager

__all__ = [
    "GPipeSchedule",
    "InterleavedSchedule",
    "OneForwardOneBackwardSchedule",
    "PipelinableContext",
    "PipelinableModel",
    "PipelineP2P",
    "PipelineP2PCommunication",
    "PipelineSchedule",
    "PipelineSharedModuleWrapper",
    "PipelineStageManager",
    "ZeroBubbleH1Schedule",
    "ZeroBubbleVSchedule",
    "build_pipeline_model",
    "create_schedule",
    "partition_balanced",
    "partition_layers",
    "partition_uniform",
    "sync_shared_gradients",
]
