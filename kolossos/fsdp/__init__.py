"""FSDP2 (``torch.distributed.fsdp.fully_shard``) building blocks of ``TorchFSDPPlugin``.

* :mod:`~kolossos.fsdp.config` / :mod:`~kolossos.fsdp.config_mapping`: Colossal-AI's (FSDP1's)
  arguments mapped onto an FSDP2 recipe, or rejected with a reason;
* :mod:`~kolossos.fsdp.mesh`: the 1-D / 2-D (hybrid) ``DeviceMesh``;
* :mod:`~kolossos.fsdp.wrap`: which submodules become FSDP units;
* :mod:`~kolossos.fsdp.shard`: applying ``fully_shard`` in order, and ``no_sync``;
* :mod:`~kolossos.fsdp.optimizer`: global-norm clipping over ``DTensor`` shards, fp16 scaling;
* :mod:`~kolossos.fsdp.checkpoint_io`, :mod:`~kolossos.fsdp.dcp`: gathered (Hugging Face) and
  ``torch.distributed.checkpoint`` checkpoints.

Importing this package does not import ``torch.distributed.fsdp`` (seconds); the functions that
need it import it when called.
"""

from kolossos.fsdp.config import TorchFSDPConfig
from kolossos.fsdp.config_mapping import build_config

__all__ = ["TorchFSDPConfig", "build_config"]
