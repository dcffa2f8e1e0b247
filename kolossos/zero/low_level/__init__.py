"""Low-level ZeRO (stages 1 and 2): :class:`LowLevelZeroOptimizer` and its pieces.

Modules, by concept: ``partition`` (flat-buffer layout and ownership), ``bucket`` (gradient
buckets), ``comm`` (reduce-to-owner and partition gathers), ``reducer`` (backward hooks),
``grad_store`` (reduced gradient partitions), ``offload`` (fp32 master partitions), ``state_io``
(full per-parameter states), ``model`` (the working-dtype model wrapper), ``checkpoint_io``.
See ``docs/zero.md``.
"""

from kolossos.zero.low_level.low_level_optim import LowLevelZeroOptimizer
from kolossos.zero.low_level.model import LowLevelZeroModel

__all__ = ["LowLevelZeroModel", "LowLevelZeroOptimizer"]
