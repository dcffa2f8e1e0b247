"""Colossal-AI's metrics (``colossalai.nn.metric``, ``colossalai.legacy.nn.metric``):
``Accuracy`` counts correct predictions, following the launch config's tensor parallelism.

Example:
    >>> import torch
    >>> from kolossos.legacy.nn.metric import Accuracy
    >>> Accuracy()(torch.eye(3), torch.tensor([0, 1, 0])).item()
    2
"""

from kolossos.legacy.nn.metric.accuracy import (
    Accuracy,
    Accuracy2D,
    Accuracy2p5D,
    Accuracy3D,
    calc_acc,
)
from kolossos.legacy.nn.metric.mixup import MixupAccuracy

__all__ = ["Accuracy", "Accuracy2D", "Accuracy2p5D", "Accuracy3D", "MixupAccuracy", "calc_acc"]
