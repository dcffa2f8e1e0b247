"""The DDP engine: PyTorch's ``DistributedDataParallel`` with its validated options.

:class:`~kolossos.booster.plugin.TorchDDPPlugin` maps its keywords onto :class:`TorchDDPConfig`;
the hybrid engine reuses :class:`TorchDDPModel` over its data-parallel axis. Checkpoints of
replicated models go through :class:`~kolossos.checkpoint_io.GeneralCheckpointIO`.
"""

from kolossos.ddp.config import TorchDDPConfig
from kolossos.ddp.model import TorchDDPModel

__all__ = ["TorchDDPConfig", "TorchDDPModel"]
