"""Checkpoint IO: Hugging Face-compatible model files, name-keyed optimizer files, safe writes.

The Booster calls a plugin's :class:`CheckpointIO` (or :class:`GeneralCheckpointIO`); the formats
are documented in ``docs/checkpoint.md``.

Example:
    >>> from kolossos.checkpoint_io import GeneralCheckpointIO
    >>> io = GeneralCheckpointIO()
    >>> io.save_model(model, "ckpt/model", shard=True, size_per_shard=100, use_safetensors=True)
    >>> io.load_model(model, "ckpt/model")

``HybridParallelCheckpointIO`` (the IO of ``HybridParallelPlugin``) is re-exported lazily: it
lives in :mod:`kolossos.hybrid`, an engine above this package, which is imported on first access.
"""

from typing import TYPE_CHECKING

from kolossos._lazy import lazy_attributes
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

if TYPE_CHECKING:
    from kolossos.hybrid.checkpoint_io import HybridParallelCheckpointIO

_LAZY: dict[str, tuple[str, str | None]] = {
    "HybridParallelCheckpointIO": ("kolossos.hybrid.checkpoint_io", "HybridParallelCheckpointIO"),
}

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
    "HybridParallelCheckpointIO",
    "LoadReport",
    "atomic_directory",
    "atomic_file",
    "optimizer_param_names",
    "register_param_names",
]

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
