"""Colossal-AI's legacy constants: the tensor modes and the mode → initializer mapping.

``INITIALIZER_MAPPING`` is deliberately a plain, mutable dict: the documented way to add a
parallel mode is ``INITIALIZER_MAPPING["new_mode"] = "MyParallelInitializer"`` (the class
registered in :data:`kolossos.legacy.registry.DIST_GROUP_INITIALIZER`).
"""

from __future__ import annotations

__all__ = [
    "ALLOWED_MODES",
    "INITIALIZER_MAPPING",
    "INPUT_GROUP_3D",
    "INPUT_X_WEIGHT_3D",
    "IS_TENSOR_PARALLEL",
    "NUM_PARTITIONS",
    "OUTPUT_GROUP_3D",
    "OUTPUT_X_WEIGHT_3D",
    "TENSOR_PARALLEL_ATTRIBUTES",
    "TENSOR_PARALLEL_MODE",
    "WEIGHT_GROUP_3D",
]

#: the built-in tensor modes (``None``: no tensor parallelism); a mode added to
#: ``INITIALIZER_MAPPING`` is accepted too
ALLOWED_MODES: list[str | None] = [None, "1d", "2d", "2.5d", "3d", "sequence"]
TENSOR_PARALLEL_MODE = "tensor_parallel_mode"

#: config key or tensor mode -> name of the initializer class in ``DIST_GROUP_INITIALIZER``
INITIALIZER_MAPPING: dict[str, str] = {
    "data": "Initializer_Data",
    "tensor": "Initializer_Tensor",
    "pipeline": "Initializer_Pipeline",
    "embedding": "Initializer_Embedding",
    "1d": "Initializer_1D",
    "2d": "Initializer_2D",
    "2.5d": "Initializer_2p5D",
    "3d": "Initializer_3D",
    "sequence": "Initializer_Sequence",
    "model": "Initializer_Model",
    "moe": "Initializer_Moe",
}

INPUT_GROUP_3D = "input_group_3d"
WEIGHT_GROUP_3D = "weight_group_3d"
OUTPUT_GROUP_3D = "output_group_3d"
INPUT_X_WEIGHT_3D = "input_x_weight_group_3d"
OUTPUT_X_WEIGHT_3D = "output_x_weight_group_3d"

IS_TENSOR_PARALLEL = "is_tensor_parallel"
NUM_PARTITIONS = "num_partitions"
TENSOR_PARALLEL_ATTRIBUTES = [IS_TENSOR_PARALLEL, NUM_PARTITIONS]
