"""NVMe (disk) offload of optimizer states: a reserved swap file, a layout plan and a pipelined
streamer with background reader and writer threads. See ``docs/optimizers.md``."""

from __future__ import annotations

from kolossos.nn.optimizer.nvme.offloader import DEFAULT_UNIT_BYTES, StateOffloader
from kolossos.nn.optimizer.nvme.swap_file import NVMeOffloadError, SwapFile

__all__ = ["DEFAULT_UNIT_BYTES", "NVMeOffloadError", "StateOffloader", "SwapFile"]
