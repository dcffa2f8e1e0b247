"""Colossal-AI's legacy registries (``colossalai.registry``): name → class tables a config can
refer to. ``DIST_GROUP_INITIALIZER`` holds the process-group initializers;
:func:`build_from_registry` builds ``dict(type='Name', **kwargs)`` entries from one."""

from __future__ import annotations

import torch.nn as nn
import torch.optim as optim

from kolossos.legacy.registry.build import build_from_config, build_from_registry
from kolossos.legacy.registry.registry import Registry

__all__ = [
    "DATASETS",
    "DATA_SAMPLERS",
    "DIST_GROUP_INITIALIZER",
    "GRADIENT_HANDLER",
    "HOOKS",
    "LAYERS",
    "LOSSES",
    "LR_SCHEDULERS",
    "MODELS",
    "OPHOOKS",
    "OPTIMIZERS",
    "SCHEDULE",
    "TRANSFORMS",
    "Registry",
    "build_from_config",
    "build_from_registry",
]

LAYERS = Registry("layers", third_party_library=[nn])
MODELS = Registry("models")
# torch.distributed.optim is left out: importing it scripts its functional optimizers with the
# deprecated torch.jit.script (a warning per optimizer, and import time); register what you need
OPTIMIZERS = Registry("optimizers", third_party_library=[optim])
DATASETS = Registry("datasets")
DIST_GROUP_INITIALIZER = Registry("dist_group_initializer")
GRADIENT_HANDLER = Registry("gradient_handler")
LOSSES = Registry("losses", third_party_library=[nn])
HOOKS = Registry("hooks")
TRANSFORMS = Registry("transforms")
DATA_SAMPLERS = Registry("data_samplers")
LR_SCHEDULERS = Registry("lr_schedulers")
SCHEDULE = Registry("schedules")
OPHOOKS = Registry("ophooks")
