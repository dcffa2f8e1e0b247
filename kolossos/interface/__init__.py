"""The contract plugins return: :class:`ModelWrapper` and :class:`OptimizerWrapper`."""

from kolossos.interface.model import ModelWrapper, unwrap_model
from kolossos.interface.optimizer import OptimizerWrapper

__all__ = ["ModelWrapper", "OptimizerWrapper", "unwrap_model"]
