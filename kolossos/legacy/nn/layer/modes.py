"""The layers of each multi-dimensional tensor mode, as ``kolossos.nn.Linear`` & co. pick them
from the launch config's ``parallel.tensor.mode``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from kolossos.legacy.nn.layer import parallel_2d as p2d
from kolossos.legacy.nn.layer import parallel_2p5d as p2p5d
from kolossos.legacy.nn.layer import parallel_3d as p3d

__all__ = ["ModeLayers", "mode_layers"]


@dataclass(frozen=True)
class ModeLayers:
    """One tensor mode's layer classes (the legacy facades taking their groups from ``gpc``)."""

    linear: Callable[..., nn.Module]
    dropout: Callable[..., nn.Module]
    layer_norm: Callable[..., nn.Module]
    embedding: Callable[..., nn.Module]
    vocab_embedding: Callable[..., nn.Module]
    classifier: Callable[..., nn.Module]
    vocab_classifier: Callable[..., nn.Module]
    patch_embedding: Callable[..., nn.Module]
    cross_entropy: Callable[..., nn.Module]
    vocab_cross_entropy: Callable[..., nn.Module]
    accuracy: Callable[[], nn.Module]
    split_batch: Callable[[torch.Tensor], torch.Tensor]


_MODES = {
    "2d": ModeLayers(
        p2d.Linear2D,
        p2d.Dropout2D,
        p2d.LayerNorm2D,
        p2d.Embedding2D,
        p2d.VocabParallelEmbedding2D,
        p2d.Classifier2D,
        p2d.VocabParallelClassifier2D,
        p2d.PatchEmbedding2D,
        p2d.CrossEntropyLoss2D,
        p2d.VocabParallelCrossEntropyLoss2D,
        p2d.Accuracy2D,
        p2d.split_batch_2d,
    ),
    "2.5d": ModeLayers(
        p2p5d.Linear2p5D,
        p2p5d.Dropout2p5D,
        p2p5d.LayerNorm2p5D,
        p2p5d.Embedding2p5D,
        p2p5d.VocabParallelEmbedding2p5D,
        p2p5d.Classifier2p5D,
        p2p5d.VocabParallelClassifier2p5D,
        p2p5d.PatchEmbedding2p5D,
        p2p5d.CrossEntropyLoss2p5D,
        p2p5d.VocabParallelCrossEntropyLoss2p5D,
        p2p5d.Accuracy2p5D,
        p2p5d.split_batch_2p5d,
    ),
    "3d": ModeLayers(
        p3d.Linear3D,
        p3d.Dropout3D,
        p3d.LayerNorm3D,
        p3d.Embedding3D,
        p3d.VocabParallelEmbedding3D,
        p3d.Classifier3D,
        p3d.VocabParallelClassifier3D,
        p3d.PatchEmbedding3D,
        p3d.CrossEntropyLoss3D,
        p3d.VocabParallelCrossEntropyLoss3D,
        p3d.Accuracy3D,
        p3d.split_batch_3d,
    ),
}


def mode_layers(mode: str | None) -> ModeLayers | None:
    """The layers of ``mode`` (``'2d'``, ``'2.5d'``, ``'3d'``), ``None`` for another mode."""
    return None if mode is None else _MODES.get(mode)
