"""Gemini's placement policies: where each chunk (and its optimizer states) lives.

``static`` applies fixed fractions (``shard_param_frac``, ``offload_optim_frac``,
``offload_param_frac``); ``auto`` is the memory manager, which measures a warm-up iteration and then
moves chunks between device and host ahead of need, evicting the chunk needed latest. The older
names ``cuda``, ``cpu`` and ``const`` are accepted (see :mod:`.config`).

Example:
    >>> policy = create_placement_policy("auto", device_memory_budget=2**30)
    >>> policy.setup(chunk_manager)
"""

from kolossos.zero.gemini.placement.auto import AutoPlacementPolicy
from kolossos.zero.gemini.placement.base import PlacementPolicy, PlacementStats
from kolossos.zero.gemini.placement.budget import DeviceBudget
from kolossos.zero.gemini.placement.config import POLICY_ALIASES, POLICY_NAMES, PlacementConfig
from kolossos.zero.gemini.placement.eviction import (
    NEVER,
    AccessTrace,
    ChunkView,
    DeviceBudgetExceededError,
    LayoutPlan,
    plan_layout,
)
from kolossos.zero.gemini.placement.factory import create_placement_policy
from kolossos.zero.gemini.placement.static import StaticPlacementPolicy, fraction_prefix

__all__ = [
    "NEVER",
    "POLICY_ALIASES",
    "POLICY_NAMES",
    "AccessTrace",
    "AutoPlacementPolicy",
    "ChunkView",
    "DeviceBudget",
    "DeviceBudgetExceededError",
    "LayoutPlan",
    "PlacementConfig",
    "PlacementPolicy",
    "PlacementStats",
    "StaticPlacementPolicy",
    "create_placement_policy",
    "fraction_prefix",
    "plan_layout",
]
