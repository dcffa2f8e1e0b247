"""``ParallelMode``: the names of the process groups the legacy global context keeps."""

from __future__ import annotations

from enum import Enum

__all__ = ["ParallelMode"]


class ParallelMode(Enum):
    """Every process group :data:`kolossos.legacy.core.global_context` can hold.

    The values are Colossal-AI's, so ``ParallelMode("pipe") is ParallelMode.PIPELINE``. A user
    initializer may register groups under its own key (any hashable, e.g. a member of its own
    ``Enum``), since a Python enum cannot grow new members (see ``docs/legacy.md``).

    Example:
        >>> ParallelMode.PIPELINE.value
        'pipe'
    """

    GLOBAL = "global"
    DATA = "data"
    MODEL = "model"  # pipeline x tensor: what AMP and grad clipping reduce over
    PIPELINE = "pipe"
    TENSOR = "tensor"
    SEQUENCE = "sequence"
    SEQUENCE_DP = "sequence_dp"
    PARALLEL_1D = "1d"
    PARALLEL_2D_ROW = "2d_row"
    PARALLEL_2D_COL = "2d_col"
    PARALLEL_3D_INPUT = "3d_input"
    PARALLEL_3D_WEIGHT = "3d_weight"
    PARALLEL_3D_OUTPUT = "3d_output"
    PARALLEL_3D_INPUT_X_WEIGHT = "3d_input_x_weight"
    PARALLEL_3D_OUTPUT_X_WEIGHT = "3d_output_x_weight"
    PARALLEL_2P5D_ROW = "2p5d_row"
    PARALLEL_2P5D_COL = "2p5d_col"
    PARALLEL_2P5D_DEP = "2p5d_dep"
    PARALLEL_2P5D_XZ = "2p5d_xz"
    MOE_MODEL = "moe_model"  # parallel.moe: consecutive ranks sharing out the experts
    MOE_DATA = "moe_data"  # the ranks holding the same experts (expert gradients)
