"""Plugins: the parallelisation recipes a :class:`kolossos.booster.Booster` applies.

``PLUGINS`` maps the short names used by config files (``plugin = "torch_ddp"``) to classes;
a new plugin registers itself here and is then usable everywhere by name.
"""

from __future__ import annotations

from kolossos.booster.plugin.dp_plugin_base import DPPluginBase
from kolossos.booster.plugin.gemini_plugin import GeminiPlugin
from kolossos.booster.plugin.hybrid_parallel_plugin import HybridParallelPlugin
from kolossos.booster.plugin.low_level_zero_plugin import LowLevelZeroPlugin
from kolossos.booster.plugin.moe_hybrid_parallel_plugin import MoeHybridParallelPlugin
from kolossos.booster.plugin.plugin_base import Plugin
from kolossos.booster.plugin.torch_ddp_plugin import TorchDDPPlugin
from kolossos.booster.plugin.torch_fsdp_plugin import TorchFSDPPlugin

PLUGINS: dict[str, type[Plugin]] = {
    "torch_ddp": TorchDDPPlugin,
    "torch_fsdp": TorchFSDPPlugin,
    "low_level_zero": LowLevelZeroPlugin,
    "gemini": GeminiPlugin,
    "hybrid_parallel": HybridParallelPlugin,
}


def get_plugin_class(name: str) -> type[Plugin]:
    """The plugin class registered as ``name``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in PLUGINS:
        raise ValueError(f"unknown plugin {name!r}; available: {', '.join(sorted(PLUGINS))}.")
    return PLUGINS[name]


__all__ = [
    "PLUGINS",
    "DPPluginBase",
    "GeminiPlugin",
    "HybridParallelPlugin",
    "LowLevelZeroPlugin",
    "MoeHybridParallelPlugin",
    "Plugin",
    "TorchDDPPlugin",
    "TorchFSDPPlugin",
    "get_plugin_class",
]
