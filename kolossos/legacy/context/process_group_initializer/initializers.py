"""The built-in initializers, registered in ``DIST_GROUP_INITIALIZER`` under Colossal-AI's
class names (``INITIALIZER_MAPPING`` maps config keys and tensor modes onto them).

Each one creates its groups from the rank lists of
:mod:`kolossos.legacy.context.process_group_initializer.layouts`.
"""

from __future__ import annotations

import math
from typing import Any

from kolossos.legacy.context.parallel_mode import ParallelMode
from kolossos.legacy.context.process_group_initializer import layouts
from kolossos.legacy.context.process_group_initializer.process_group_initializer import (
    GroupSetting,
    ProcessGroupInitializer,
)
from kolossos.legacy.global_variables import tensor_parallel_env as env
from kolossos.legacy.registry import DIST_GROUP_INITIALIZER

__all__ = [
    "Initializer_1D",
    "Initializer_2D",
    "Initializer_2p5D",
    "Initializer_3D",
    "Initializer_Data",
    "Initializer_Model",
    "Initializer_Pipeline",
    "Initializer_Sequence",
    "Initializer_Tensor",
]

Settings = list[GroupSetting | None]


@DIST_GROUP_INITIALIZER.register_module
class Initializer_Data(ProcessGroupInitializer):
    """Data-parallel groups: the ranks that hold the same part of the model."""

    def init_dist_group(self) -> GroupSetting | None:
        groups = layouts.data_groups(self.world_size, self.data_parallel_size)
        return self.build_groups(groups, ParallelMode.DATA)


@DIST_GROUP_INITIALIZER.register_module
class Initializer_Model(ProcessGroupInitializer):
    """Model-parallel groups: pipeline x tensor ranks of one model replica."""

    def init_dist_group(self) -> GroupSetting | None:
        size = self.pipeline_parallel_size * self.tensor_parallel_size
        return self.build_groups(layouts.model_groups(self.world_size, size), ParallelMode.MODEL)


@DIST_GROUP_INITIALIZER.register_module
class Initializer_Pipeline(ProcessGroupInitializer):
    """Pipeline groups: one rank per stage."""

    def init_dist_group(self) -> GroupSetting | None:
        groups = layouts.pipeline_groups(
            self.world_size, self.data_parallel_size, self.pipeline_parallel_size
        )
        return self.build_groups(groups, ParallelMode.PIPELINE)


@DIST_GROUP_INITIALIZER.register_module
class Initializer_Tensor(ProcessGroupInitializer):
    """Tensor-parallel groups: blocks of ``tensor_size`` consecutive ranks."""

    def init_dist_group(self) -> GroupSetting | None:
        groups = layouts.tensor_groups(self.world_size, self.tensor_parallel_size)
        return self.build_groups(groups, ParallelMode.TENSOR)


@DIST_GROUP_INITIALIZER.register_module
class Initializer_1D(ProcessGroupInitializer):
    """1D tensor parallelism (Megatron-style): the tensor blocks again, as ``PARALLEL_1D``."""

    def init_dist_group(self) -> GroupSetting | None:
        env.parallel_input_1d = False
        groups = layouts.tensor_groups(self.world_size, self.tensor_parallel_size)
        return self.build_groups(groups, ParallelMode.PARALLEL_1D)


@DIST_GROUP_INITIALIZER.register_module
class Initializer_2D(ProcessGroupInitializer):
    """2D (SUMMA) tensor parallelism: row and column groups of a ``q x q`` grid."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.summa_dim = math.isqrt(self.tensor_parallel_size)
        if self.summa_dim**2 != self.tensor_parallel_size:
            raise ValueError(
                f"2D tensor parallelism needs a square size, got {self.tensor_parallel_size}."
            )

    def init_dist_group(self) -> Settings:
        env.summa_dim = self.summa_dim
        rows, cols = layouts.groups_2d(self.world_size, self.tensor_parallel_size)
        return [
            self.build_groups(rows, ParallelMode.PARALLEL_2D_ROW),
            self.build_groups(cols, ParallelMode.PARALLEL_2D_COL),
        ]


@DIST_GROUP_INITIALIZER.register_module
class Initializer_2p5D(ProcessGroupInitializer):
    """2.5D (tesseract) tensor parallelism: ``q x q x depth``; ``depth`` comes from the config."""

    def __init__(self, *args: Any, depth: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tesseract_dep = depth
        self.tesseract_dim = math.isqrt(self.tensor_parallel_size // depth)
        if self.tesseract_dim**2 * depth != self.tensor_parallel_size:
            raise ValueError(
                f"2.5D tensor parallelism needs size = q*q*depth, got size "
                f"{self.tensor_parallel_size} and depth {depth}."
            )

    def init_dist_group(self) -> Settings:
        env.tesseract_dim, env.tesseract_dep = self.tesseract_dim, self.tesseract_dep
        cols, rows, deps, xz = layouts.groups_2p5d(
            self.world_size, self.tensor_parallel_size, self.tesseract_dep
        )
        return [
            self.build_groups(cols, ParallelMode.PARALLEL_2P5D_COL),
            self.build_groups(rows, ParallelMode.PARALLEL_2P5D_ROW),
            self.build_groups(deps, ParallelMode.PARALLEL_2P5D_DEP),
            self.build_groups(xz, ParallelMode.PARALLEL_2P5D_XZ),
        ]


@DIST_GROUP_INITIALIZER.register_module
class Initializer_3D(ProcessGroupInitializer):
    """3D tensor parallelism: input, weight, output and the two product groups of a cube."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.depth = round(self.tensor_parallel_size ** (1 / 3))
        if self.depth**3 != self.tensor_parallel_size:
            raise ValueError(
                f"3D tensor parallelism needs a cube size, got {self.tensor_parallel_size}."
            )

    def init_dist_group(self) -> Settings:
        env.depth_3d = self.depth
        modes = (
            ParallelMode.PARALLEL_3D_INPUT,
            ParallelMode.PARALLEL_3D_WEIGHT,
            ParallelMode.PARALLEL_3D_OUTPUT,
            ParallelMode.PARALLEL_3D_INPUT_X_WEIGHT,
            ParallelMode.PARALLEL_3D_OUTPUT_X_WEIGHT,
        )
        env.input_group_3d, env.weight_group_3d, env.output_group_3d = modes[:3]
        env.input_x_weight_group_3d, env.output_x_weight_group_3d = modes[3:]
        all_groups = layouts.groups_3d(self.world_size, self.tensor_parallel_size)
        return [self.build_groups(g, m) for g, m in zip(all_groups, modes, strict=True)]


@DIST_GROUP_INITIALIZER.register_module
class Initializer_Sequence(ProcessGroupInitializer):
    """Sequence parallelism: the tensor blocks as ``SEQUENCE``, and ``SEQUENCE_DP`` (every
    rank of a pipeline block) for the gradient all-reduce."""

    def init_dist_group(self) -> Settings:
        blocks = layouts.tensor_groups(self.world_size, self.tensor_parallel_size)
        dp = layouts.sequence_dp_groups(self.world_size, self.pipeline_parallel_size)
        return [
            self.build_groups(blocks, ParallelMode.SEQUENCE),
            self.build_groups(dp, ParallelMode.SEQUENCE_DP),
        ]
