"""Pins the signatures and import paths of Colossal-AI's legacy context (v0.2.8 / v0.3.1
``colossalai.context``, ``colossalai.core``, ``colossalai.registry``, ``colossalai.constants``)
in the notation of ``test_api_signatures.py``.

Upstream's parameter names, order and defaults are what scripts written against it use; change a
pin only on purpose, with a comment saying how and why it differs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
from pin_notation import P, describe

from kolossos.legacy.context import Config, ParallelContext, ProcessGroupInitializer
from kolossos.legacy.context import random as legacy_random
from kolossos.legacy.registry import Registry

PINS: dict[str, tuple[Callable[..., Any], list[str]]] = {
    "Config.__init__": (Config.__init__, P("config=None")),
    "Config.from_file": (Config.from_file, P("filename")),
    "ParallelContext.get_global_rank": (ParallelContext.get_global_rank, P("")),
    "ParallelContext.get_local_rank": (ParallelContext.get_local_rank, P("parallel_mode")),
    "ParallelContext.get_world_size": (ParallelContext.get_world_size, P("parallel_mode")),
    "ParallelContext.get_group": (ParallelContext.get_group, P("parallel_mode")),
    "ParallelContext.get_cpu_group": (ParallelContext.get_cpu_group, P("parallel_mode")),
    "ParallelContext.get_ranks_in_group": (
        ParallelContext.get_ranks_in_group,
        P("parallel_mode"),
    ),
    "ParallelContext.is_initialized": (ParallelContext.is_initialized, P("parallel_mode")),
    "ParallelContext.is_first_rank": (ParallelContext.is_first_rank, P("parallel_mode")),
    "ParallelContext.is_last_rank": (ParallelContext.is_last_rank, P("parallel_mode")),
    "ParallelContext.is_pipeline_first_stage": (
        ParallelContext.is_pipeline_first_stage,
        P("ignore_virtual=False"),
    ),
    "ParallelContext.load_config": (ParallelContext.load_config, P("config")),
    "ParallelContext.set_seed": (ParallelContext.set_seed, P("seed")),
    "ParallelContext.destroy": (ParallelContext.destroy, P("")),
    # upstream requires the three sizes; they default to 1 here so the documented recipe's
    # super().__init__(rank, world_size, config) works
    "ProcessGroupInitializer.__init__": (
        ProcessGroupInitializer.__init__,
        P(
            "rank world_size config data_parallel_size=1 pipeline_parallel_size=1 "
            "tensor_parallel_size=1"
        ),
    ),
    "Registry.__init__": (Registry.__init__, P("name third_party_library=None")),
    "Registry.register_module": (Registry.register_module, P("module_class")),
    "Registry.get_module": (Registry.get_module, P("module_name")),
    "random.seed": (legacy_random.seed, P("parallel_mode")),
    "random.add_seed": (legacy_random.add_seed, P("parallel_mode seed overwrite=False")),
    "random.get_states": (legacy_random.get_states, P("copy=False")),
    "random.moe_set_seed": (legacy_random.moe_set_seed, P("seed")),
    "random.with_seed": (legacy_random.with_seed, P("func parallel_mode")),
}


@pytest.mark.parametrize("name", sorted(PINS))
def test_signature_is_pinned(name: str) -> None:
    fn, expected = PINS[name]
    assert describe(fn) == expected


IMPORTS = {
    "kolossos.core": "global_context",
    "kolossos.legacy.core": "global_context",
    "kolossos.context": "Config ParallelMode ParallelContext ProcessGroupInitializer random",
    "kolossos.context.parallel_mode": "ParallelMode",
    "kolossos.context.config": "Config ConfigException",
    "kolossos.context.random": "seed add_seed get_states moe_set_seed set_mode reset_seeds",
    "kolossos.context.process_group_initializer": (
        "ProcessGroupInitializer Initializer_1D Initializer_2D Initializer_2p5D Initializer_3D "
        "Initializer_Data Initializer_Model Initializer_Pipeline Initializer_Sequence "
        "Initializer_Tensor Initializer_Moe"
    ),
    "kolossos.registry": "DIST_GROUP_INITIALIZER GRADIENT_HANDLER MODELS LAYERS Registry",
    "kolossos.legacy.registry": "DIST_GROUP_INITIALIZER GRADIENT_HANDLER MODELS LAYERS",
    "kolossos.constants": "INITIALIZER_MAPPING ALLOWED_MODES",
    "kolossos.global_variables": "tensor_parallel_env moe_env",
}


@pytest.mark.parametrize("module", sorted(IMPORTS))
def test_upstream_import_paths(module: str) -> None:
    imported = importlib.import_module(module)
    for name in IMPORTS[module].split():
        assert hasattr(imported, name), f"{module}.{name}"


def test_one_object_behind_every_path() -> None:
    from kolossos import constants, core, legacy, registry
    from kolossos.context import ParallelMode
    from kolossos.legacy import constants as legacy_constants
    from kolossos.legacy.context.parallel_mode import ParallelMode as LegacyMode

    assert core.global_context is legacy.core.global_context
    assert constants.INITIALIZER_MAPPING is legacy_constants.INITIALIZER_MAPPING
    assert registry.DIST_GROUP_INITIALIZER is legacy.registry.DIST_GROUP_INITIALIZER
    assert ParallelMode is LegacyMode
    for name in ("Initializer_1D", "Initializer_2D", "Initializer_2p5D", "Initializer_3D"):
        assert registry.DIST_GROUP_INITIALIZER.has(name)
    members = {m.name for m in ParallelMode}
    assert {"GLOBAL", "DATA", "MODEL", "PIPELINE", "TENSOR", "SEQUENCE", "SEQUENCE_DP"} <= members
    assert {"PARALLEL_3D_INPUT_X_WEIGHT", "PARALLEL_2P5D_XZ", "PARALLEL_1D"} <= members
    assert {"MOE_MODEL", "MOE_DATA"} <= members
