"""Pins the signatures and import paths of Colossal-AI's ZeRO and Gemini names (v0.3.4-v0.3.6)
that kolossos provides, in the notation of ``test_api_signatures.py``: ``name`` (required),
``name=<repr of default>``, ``*name`` (keyword-only), ``*args`` / ``**kwargs``.

Upstream's parameter names, order and defaults are what scripts written against it use; change a
pin only on purpose, with a comment saying how and why it differs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
from pin_notation import P, describe

from kolossos.utils import conditional_context
from kolossos.zero import GeminiDDP, LowLevelZeroOptimizer, get_static_torch_model
from kolossos.zero.gemini.chunk import (
    classify_params_by_dp_degree,
    init_chunk_manager,
    search_chunk_configuration,
)
from kolossos.zero.gemini.gemini_mgr import GeminiManager

PINS: dict[str, tuple[Callable[..., Any], list[str]]] = {
    # v0.3.6's order (v0.3.4 lacks moe_extra_dp_process_group; v0.3.1-0.3.3 had
    # tp_process_group before forced_dtype and no master_weights). kolossos appends
    # tp_process_group (rejected unless None) and norm_type (the norm of clip_grad_norm) as
    # keyword-only; moe_extra_dp_process_group is rejected unless None.
    "LowLevelZeroOptimizer.__init__": (
        LowLevelZeroOptimizer.__init__,
        P(
            "optimizer initial_scale=65536 min_scale=1 growth_factor=2.0 backoff_factor=0.5 "
            "growth_interval=2000 hysteresis=2 max_scale=16777216 clip_grad_norm=0.0 "
            "verbose=False reduce_bucket_size=1048576 communication_dtype=None "
            "overlap_communication=False partition_grad=False cpu_offload=False "
            "dp_process_group=None forced_dtype=None moe_extra_dp_process_group=None "
            "master_weights=True *tp_process_group=None *norm_type=2.0 *overlap_allgather=False"
        ),
    ),
    "LowLevelZeroOptimizer.state_dict": (LowLevelZeroOptimizer.state_dict, P("")),
    "LowLevelZeroOptimizer.load_state_dict": (
        LowLevelZeroOptimizer.load_state_dict,
        P("state_dict"),
    ),
    "conditional_context": (conditional_context, P("context_manager enable=True")),
    "GeminiDDP.state_dict": (
        GeminiDDP.state_dict,
        P("destination=None prefix='' keep_vars=False only_rank_0=True"),
    ),
    # assign: torch's Module.load_state_dict argument, appended (refused unless False).
    "GeminiDDP.load_state_dict": (
        GeminiDDP.load_state_dict,
        P("state_dict strict=True assign=False"),
    ),
    "search_chunk_configuration": (
        search_chunk_configuration,
        P(
            "model search_range_m search_interval min_chunk_size_m=32 "
            "filter_exlarge_params=True strict_ddp_flag=False process_group=None memstas=None"
        ),
    ),
    # process_group=None: upstream requires it; None is the default group, as everywhere else.
    "classify_params_by_dp_degree": (
        classify_params_by_dp_degree,
        P("param_order process_group=None"),
    ),
    "init_chunk_manager": (
        init_chunk_manager,
        P("model init_device=None hidden_dim=None verbose=False **kwargs"),
    ),
    "GeminiManager.__init__": (
        GeminiManager.__init__,
        P("placement_policy chunk_manager memstats=None **placement_kwargs"),
    ),
    "get_static_torch_model": (
        get_static_torch_model,
        P("zero_ddp_model device=device(type='cpu') dtype=torch.float32 only_rank_0=True"),
    ),
}


@pytest.mark.parametrize("name", sorted(PINS))
def test_signature_is_pinned(name: str) -> None:
    fn, expected = PINS[name]
    assert describe(fn) == expected


IMPORTS = {
    "kolossos.utils": "conditional_context",
    "kolossos.utils.context": "conditional_context",
    "kolossos.zero": (
        "GeminiDDP GeminiOptimizer GeminiAdamOptimizer zero_model_wrapper zero_optim_wrapper "
        "LowLevelZeroOptimizer get_static_torch_model"
    ),
    "kolossos.zero.low_level": "LowLevelZeroOptimizer",
    "kolossos.zero.low_level.low_level_optim": "LowLevelZeroOptimizer",
    "kolossos.zero.gemini": (
        "GeminiManager TensorInfo TensorState ChunkManager search_chunk_configuration GeminiDDP "
        "get_static_torch_model GeminiAdamOptimizer GeminiOptimizer"
    ),
    "kolossos.zero.gemini.chunk": (
        "Chunk ChunkFullError TensorInfo TensorState ChunkManager classify_params_by_dp_degree "
        "search_chunk_configuration init_chunk_manager"
    ),
    "kolossos.zero.gemini.chunk.chunk": "Chunk ChunkFullError TensorInfo TensorState",
    "kolossos.zero.gemini.chunk.manager": "ChunkManager",
    "kolossos.zero.gemini.chunk.search_utils": (
        "search_chunk_configuration classify_params_by_dp_degree"
    ),
    "kolossos.zero.gemini.chunk.utils": "init_chunk_manager",
    "kolossos.zero.gemini.gemini_mgr": "GeminiManager",
    "kolossos.zero.gemini.gemini_ddp": "GeminiDDP",
    "kolossos.zero.gemini.gemini_optimizer": "GeminiOptimizer GeminiAdamOptimizer",
    "kolossos.zero.gemini.utils": "get_static_torch_model",
}


@pytest.mark.parametrize("module", sorted(IMPORTS))
def test_upstream_import_paths(module: str) -> None:
    imported = importlib.import_module(module)
    for name in IMPORTS[module].split():
        assert hasattr(imported, name), f"{module}.{name}"


def test_one_object_behind_every_path() -> None:
    from kolossos.zero import gemini
    from kolossos.zero.gemini import chunk

    assert gemini.GeminiManager is GeminiManager
    assert gemini.search_chunk_configuration is chunk.search_utils.search_chunk_configuration
    assert chunk.chunk.TensorState is chunk.state.TensorState is gemini.TensorState
    assert chunk.ChunkManager is chunk.manager.ChunkManager is gemini.ChunkManager
