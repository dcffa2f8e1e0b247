"""``TorchDDPConfig``: the validated options of ``torch.nn.parallel.DistributedDataParallel``."""

from __future__ import annotations

import inspect
import math
from dataclasses import asdict, dataclass
from typing import Any

from torch.nn.parallel import DistributedDataParallel as DDP

from kolossos.utils.checks import check_flags

__all__ = ["TorchDDPConfig"]

_FLAGS = (
    "broadcast_buffers",
    "find_unused_parameters",
    "check_reduction",
    "gradient_as_bucket_view",
    "static_graph",
)


@dataclass(frozen=True, kw_only=True)
class TorchDDPConfig:
    """Keyword arguments passed to ``torch.nn.parallel.DistributedDataParallel``.

    Example:
        >>> TorchDDPConfig(bucket_cap_mb=10).bucket_cap_mb
        10
    """

    broadcast_buffers: bool = True
    """Broadcast buffers (e.g. BatchNorm statistics) from rank 0 at every forward."""
    bucket_cap_mb: float = 25
    """Gradient bucket size in MiB: smaller overlaps more, larger sends fewer messages."""
    find_unused_parameters: bool = False
    """Walk the autograd graph each step to find parameters that got no gradient."""
    check_reduction: bool = False
    """Accepted for compatibility; PyTorch ignores it (deprecated upstream)."""
    gradient_as_bucket_view: bool = False
    """Gradients alias the communication buckets (saves one gradient copy of memory)."""
    static_graph: bool = False
    """The set of used parameters and the graph never change (enables extra optimisations)."""

    def __post_init__(self) -> None:
        size = self.bucket_cap_mb
        if isinstance(size, bool) or not isinstance(size, (int, float)):
            raise TypeError(
                f"bucket_cap_mb={size!r} must be a number of MiB (e.g. 25), not a "
                f"{type(size).__name__}."
            )
        if not 0 < size < math.inf:
            raise ValueError(
                f"bucket_cap_mb={size!r} must be a positive, finite number of MiB (e.g. 25)."
            )
        check_flags(self, _FLAGS)

    def ddp_kwargs(self) -> dict[str, Any]:
        """DDP's keyword arguments for this torch: newer releases renamed ``broadcast_buffers``
        to ``forward_sync_buffers`` (buffers are then always synced once at construction)."""
        kwargs = asdict(self)
        if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
            kwargs["forward_sync_buffers"] = kwargs.pop("broadcast_buffers")
        return kwargs
