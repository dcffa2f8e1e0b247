"""Colossal-AI's process-group initializers: the base class and the built-in modes."""

from kolossos.legacy.context.process_group_initializer.initializer_moe import Initializer_Moe
from kolossos.legacy.context.process_group_initializer.initializers import (
    Initializer_1D,
    Initializer_2D,
    Initializer_2p5D,
    Initializer_3D,
    Initializer_Data,
    Initializer_Model,
    Initializer_Pipeline,
    Initializer_Sequence,
    Initializer_Tensor,
)
from kolossos.legacy.context.process_group_initializer.process_group_initializer import (
    GroupSetting,
    ProcessGroupInitializer,
)

__all__ = [
    "GroupSetting",
    "Initializer_1D",
    "Initializer_2D",
    "Initializer_2p5D",
    "Initializer_3D",
    "Initializer_Data",
    "Initializer_Model",
    "Initializer_Moe",
    "Initializer_Pipeline",
    "Initializer_Sequence",
    "Initializer_Tensor",
    "ProcessGroupInitializer",
]
