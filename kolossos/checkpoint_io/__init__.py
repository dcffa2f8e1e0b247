"""Checkpoint IO: Hugging Face-compatible model files, name-keyed optimizer files, safe writes.

The Booster calls a plugin's :class:`CheckpointIO` (or :class:`GeneralCheckpointIO`); the formats
are documented in ``docs/checkpoint.md``.

Example:
    >>> from kolossos.checkpoint_io import GeneralCheckpointIO
    >>> io = GeneralCheckpointIO()
    >>> io.save_model(model, "ckpt/model", shard=True, size_per_shard=100, use_safetensors=True)
    >>> io.load_model(model, "ckpt/model")
"""

from kolossos.checkpoint_io.atomic import atomic_directory, atomic_file
from kolossos.checkpoint_io.checkpoint_io_base import CheckpointIO
from kolossos.checkpoint_io.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    LoadReport,
)
from kolossos.checkpoint_io.general_checkpoint_io import GeneralCheckpointIO
from kolossos.checkpoint_io.index import (
    OPTIM_GROUP_NAME,
    OPTIM_INDEX_NAME,
    OPTIM_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    CheckpointIndex,
)
from kolossos.checkpoint_io.optim_format import OPTIM_FORMAT, OPTIM_FORMAT_VERSION
from kolossos.checkpoint_io.param_names import optimizer_param_names, register_param_names

__all__ = [
    "OPTIM_FORMAT",
    "OPTIM_FORMAT_VERSION",
    "OPTIM_GROUP_NAME",
    "OPTIM_INDEX_NAME",
    "OPTIM_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "CheckpointError",
    "CheckpointIO",
    "CheckpointIndex",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "GeneralCheckpointIO",
    "LoadReport",
    "atomic_directory",
    "atomic_file",
    "optimizer_param_names",
    "register_param_names",
]
