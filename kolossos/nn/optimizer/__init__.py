"""Optimizers: ``CPUAdam``, ``HybridAdam``, ``FusedAdam``, ``FusedLAMB``, ``FusedSGD``, ``Lamb``,
``Lars``, and the ZeRO/tensor-parallel aware ``DistributedLamb`` and ``DistributedAdaFactor``.

Same names and signatures as ``colossalai.nn.optimizer``; no compiled extension is needed (the
Adams run PyTorch's own fused kernels). NVMe offload of optimizer states: ``CPUAdam`` and
``HybridAdam`` with ``nvme_offload_fraction``. See ``docs/optimizers.md``.

Example:
    >>> import torch
    >>> from kolossos.nn.optimizer import HybridAdam
    >>> model = torch.nn.Linear(4, 2)
    >>> optimizer = HybridAdam(model.parameters(), lr=1e-3)
"""

from __future__ import annotations

from kolossos.nn.optimizer.cpu_adam import CPUAdam
from kolossos.nn.optimizer.distributed_adafactor import DistributedAdaFactor
from kolossos.nn.optimizer.distributed_lamb import DistributedLamb
from kolossos.nn.optimizer.fused_adam import FusedAdam
from kolossos.nn.optimizer.fused_lamb import FusedLAMB
from kolossos.nn.optimizer.fused_sgd import FusedSGD
from kolossos.nn.optimizer.hybrid_adam import HybridAdam
from kolossos.nn.optimizer.lamb import Lamb
from kolossos.nn.optimizer.lars import Lars

__all__ = [
    "CPUAdam",
    "DistributedAdaFactor",
    "DistributedLamb",
    "FusedAdam",
    "FusedLAMB",
    "FusedSGD",
    "HybridAdam",
    "Lamb",
    "Lars",
]
