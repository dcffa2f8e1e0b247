"""ZeRO: sharding optimizer states, gradients (and parameters) over data-parallel ranks.

``kolossos.zero.low_level`` holds stages 1 and 2 (:class:`LowLevelZeroOptimizer`, used by
``LowLevelZeroPlugin``).
"""

from kolossos.zero.low_level import LowLevelZeroModel, LowLevelZeroOptimizer

__all__ = ["LowLevelZeroModel", "LowLevelZeroOptimizer"]
