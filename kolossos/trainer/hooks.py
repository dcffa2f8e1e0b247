"""Colossal-AI's old import path ``colossalai.trainer.hooks`` (see
:mod:`kolossos.legacy.trainer.hooks`)."""

from kolossos.legacy.trainer.hooks import (
    AccuracyHook,
    AccuracyMetric,
    BaseHook,
    LearningRateMetric,
    LogByEpochHook,
    LogMemoryByEpochHook,
    LogMetricByEpochHook,
    LogMetricByStepHook,
    LogTimingByEpochHook,
    LossHook,
    LossMetric,
    LRSchedulerHook,
    Metric,
    MetricHook,
    SaveCheckpointHook,
    TensorboardHook,
    ThroughputHook,
    ThroughputMetric,
)

__all__ = [
    "AccuracyHook",
    "AccuracyMetric",
    "BaseHook",
    "LRSchedulerHook",
    "LearningRateMetric",
    "LogByEpochHook",
    "LogMemoryByEpochHook",
    "LogMetricByEpochHook",
    "LogMetricByStepHook",
    "LogTimingByEpochHook",
    "LossHook",
    "LossMetric",
    "Metric",
    "MetricHook",
    "SaveCheckpointHook",
    "TensorboardHook",
    "ThroughputHook",
    "ThroughputMetric",
]
