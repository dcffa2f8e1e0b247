"""``kolossos.nn``: optimizers, learning-rate schedulers and layers under Colossal-AI's names.

Names resolve lazily (nothing heavy is imported with the package)::

    from kolossos.nn import Lamb, HybridAdam          # as colossalai.nn
    from kolossos.nn.optimizer import CPUAdam         # as colossalai.nn.optimizer
    from kolossos.nn.lr_scheduler import LinearWarmupLR
    from kolossos.nn.metric import Accuracy           # as colossalai.nn.metric
    import kolossos.nn as col_nn
    col_nn.Linear(256, 1024)                          # follows parallel.tensor of the launch config

Example:
    >>> import kolossos.nn as knn
    >>> knn.Lamb.__name__
    'Lamb'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kolossos._lazy import lazy_attributes

if TYPE_CHECKING:
    from kolossos.legacy.nn.layer.colossalai_layer import (
        CrossEntropyLoss,
        Dropout,
        Embedding,
        LayerNorm,
        Linear,
    )
    from kolossos.nn import layer, lr_scheduler, metric, optimizer
    from kolossos.nn.layer.parallel_1d import (
        Dropout1D,
        Embedding1D,
        Linear1D_Col,
        Linear1D_Row,
        VocabParallelEmbedding1D,
    )
    from kolossos.nn.optimizer import (
        CPUAdam,
        DistributedAdaFactor,
        DistributedLamb,
        FusedAdam,
        FusedLAMB,
        FusedSGD,
        HybridAdam,
        Lamb,
        Lars,
    )

_OPTIMIZERS = (
    "CPUAdam",
    "DistributedAdaFactor",
    "DistributedLamb",
    "FusedAdam",
    "FusedLAMB",
    "FusedSGD",
    "HybridAdam",
    "Lamb",
    "Lars",
)
_LAYERS = ("CrossEntropyLoss", "Dropout", "Embedding", "LayerNorm", "Linear")
_LAYERS_1D = (
    "Dropout1D",
    "Embedding1D",
    "Linear1D_Col",
    "Linear1D_Row",
    "VocabParallelEmbedding1D",
)
#: the 2D / 2.5D / 3D layers and their batch helpers (kolossos.legacy.nn.layer, gpc's groups)
_LAYERS_ND = (
    tuple(
        f"{kind}{mode}"
        for mode in ("2D", "2p5D", "3D")
        for kind in (
            "Classifier",
            "Dropout",
            "Embedding",
            "LayerNorm",
            "Linear",
            "PatchEmbedding",
            "VocabParallelClassifier",
            "VocabParallelEmbedding",
        )
    )
    + tuple(
        f"{helper}_{mode}"
        for helper in ("reduce_by_batch", "split_batch")
        for mode in ("2d", "2p5d", "3d")
    )
    + ("split_tensor_2p5d", "split_tensor_3d")
)
_LAZY: dict[str, tuple[str, str | None]] = {
    **{
        name: (f"kolossos.nn.{name}", None)
        for name in ("layer", "lr_scheduler", "metric", "optimizer")
    },
    **{name: ("kolossos.nn.optimizer", name) for name in _OPTIMIZERS},
    **{name: ("kolossos.legacy.nn.layer.colossalai_layer", name) for name in _LAYERS},
    **{name: ("kolossos.nn.layer.parallel_1d", name) for name in _LAYERS_1D},
    **{name: ("kolossos.legacy.nn.layer", name) for name in _LAYERS_ND},
}

__all__ = [
    "CPUAdam",
    "CrossEntropyLoss",
    "DistributedAdaFactor",
    "DistributedLamb",
    "Dropout",
    "Dropout1D",
    "Embedding",
    "Embedding1D",
    "FusedAdam",
    "FusedLAMB",
    "FusedSGD",
    "HybridAdam",
    "Lamb",
    "Lars",
    "LayerNorm",
    "Linear",
    "Linear1D_Col",
    "Linear1D_Row",
    "VocabParallelEmbedding1D",
    "layer",
    "lr_scheduler",
    "metric",
    "optimizer",
    *_LAYERS_ND,
]


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
