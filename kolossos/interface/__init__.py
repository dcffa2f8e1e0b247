"""The contract plugins return (:class:`ModelWrapper`, :class:`OptimizerWrapper`) and the typed
protocols engines, checkpoint IO and the Booster talk through."""

from kolossos.interface.model import ModelWrapper, unwrap_model
from kolossos.interface.optimizer import OptimizerWrapper
from kolossos.interface.owners import ParamOwners
from kolossos.interface.protocols import LossScaler, ParamStateOwner

__all__ = [
    "LossScaler",
    "ModelWrapper",
    "OptimizerWrapper",
    "ParamOwners",
    "ParamStateOwner",
    "unwrap_model",
]
