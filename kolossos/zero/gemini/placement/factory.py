"""``create_placement_policy``: a Gemini placement policy by name."""

from __future__ import annotations

from typing import Any

import torch

from kolossos.zero.gemini.memory_tracer import MemStats
from kolossos.zero.gemini.placement.auto import AutoPlacementPolicy
from kolossos.zero.gemini.placement.base import PlacementPolicy
from kolossos.zero.gemini.placement.config import PlacementConfig
from kolossos.zero.gemini.placement.static import StaticPlacementPolicy

__all__ = ["create_placement_policy"]


def create_placement_policy(
    placement_policy: str = "static",
    *,
    device: torch.device | None = None,
    memstats: MemStats | None = None,
    **kwargs: Any,
) -> PlacementPolicy:
    """Build a placement policy from its documented name (or an alias) and options.

    Args:
        placement_policy: ``"static"``, ``"auto"``, or the older ``"cuda"``, ``"cpu"``,
            ``"const"`` (see :mod:`kolossos.zero.gemini.placement.config`).
        device: the compute device (default: the accelerator's current one).
        memstats: ``auto`` only: a :class:`~kolossos.zero.gemini.memory_tracer.MemStats` from an
            earlier run, used instead of measuring a warm-up iteration.
        **kwargs: ``shard_param_frac``, ``offload_optim_frac``, ``offload_param_frac`` (static),
            ``warmup_non_model_data_ratio``, ``steady_cuda_cap_ratio``, ``device_memory_budget``
            (auto).

    Raises:
        ValueError: an unknown name, an out-of-range value, or an option the policy ignores.
        TypeError: an unknown keyword.

    Example:
        >>> policy = create_placement_policy("auto", device_memory_budget=2**30)
        >>> policy.setup(chunk_manager)  # GeminiDDP does this
    """
    config = PlacementConfig.from_user(placement_policy, **kwargs)
    if config.policy == "auto":
        return AutoPlacementPolicy(config, device=device, memstats=memstats)
    if memstats is not None:
        raise ValueError(
            f"memstats is read by placement_policy='auto' only (got {placement_policy!r}); "
            "drop it or use placement_policy='auto'."
        )
    return StaticPlacementPolicy(config, device=device)
