"""The trainer hooks of Colossal-AI's legacy API (``colossalai.trainer.hooks``): subclass
:class:`BaseHook` for your own, or use the provided ones — the metric hooks (:class:`LossHook`,
:class:`AccuracyHook`, :class:`ThroughputHook`, :class:`LRSchedulerHook`), the logging hooks
(:class:`LogMetricByEpochHook`, :class:`LogMetricByStepHook`, :class:`LogTimingByEpochHook`,
:class:`LogMemoryByEpochHook`, :class:`TensorboardHook`) and :class:`SaveCheckpointHook`.

Example:
    >>> from kolossos.trainer import Trainer, hooks
    >>> hook_list = [
    ...     hooks.LossHook(),
    ...     hooks.LRSchedulerHook(lr_scheduler=lr_scheduler, by_epoch=True),
    ...     hooks.AccuracyHook(accuracy_func=Accuracy()),
    ...     hooks.LogMetricByEpochHook(logger),
    ... ]
"""

from kolossos.legacy.trainer.hooks.base_hook import BaseHook
from kolossos.legacy.trainer.hooks.checkpoint_hook import SaveCheckpointHook
from kolossos.legacy.trainer.hooks.log_hook import (
    LogByEpochHook,
    LogMetricByEpochHook,
    LogMetricByStepHook,
    LogTimingByEpochHook,
)
from kolossos.legacy.trainer.hooks.lr_scheduler_hook import LRSchedulerHook
from kolossos.legacy.trainer.hooks.memory_hook import LogMemoryByEpochHook
from kolossos.legacy.trainer.hooks.metric_hook import (
    AccuracyHook,
    LossHook,
    MetricHook,
    ThroughputHook,
)
from kolossos.legacy.trainer.hooks.metrics import (
    AccuracyMetric,
    LearningRateMetric,
    LossMetric,
    Metric,
    ThroughputMetric,
)
from kolossos.legacy.trainer.hooks.tensorboard_hook import TensorboardHook

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
