"""Pins the signature of ``MoeHybridParallelPlugin`` (Colossal-AI v0.4's
``colossalai.booster.plugin.MoeHybridParallelPlugin``), in the notation of
``test_api_signatures.py``.

Differences from upstream, on purpose: ``tp_size``, ``pp_size`` and ``ep_size`` keep upstream's
positional order but default to 1 (upstream: required), so ``MoeHybridParallelPlugin(ep_size=2)``
works; ``overlap_communication=True`` (upstream False, which our hybrid config refuses with
``zero_stage=0``; upstream forces it off anyway). ``moe_dp_outside=False``, ``fp8_communication``
and ``use_fp8`` are accepted by name and raise ``NotImplementedError`` when changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pin_notation import P, describe

from kolossos.booster.plugin import MoeHybridParallelPlugin

PINS: dict[str, tuple[Callable[..., Any], list[str]]] = {
    "MoeHybridParallelPlugin.__init__": (
        MoeHybridParallelPlugin.__init__,
        P(
            "tp_size=1 pp_size=1 ep_size=1 sp_size=None precision='fp16' zero_stage=0 "
            "enable_all_optimization=False enable_fused_normalization=False "
            "enable_flash_attention=False enable_jit_fused=False "
            "enable_sequence_parallelism=False sequence_parallelism_mode=None "
            "parallel_output=True num_microbatches=None microbatch_size=None "
            "initial_scale=65536 min_scale=1 growth_factor=2 backoff_factor=0.5 "
            "growth_interval=1000 hysteresis=2 max_scale=4294967296 max_norm=0 "
            "broadcast_buffers=True ddp_bucket_cap_mb=25 find_unused_parameters=False "
            "check_reduction=False gradient_as_bucket_view=False static_graph=False "
            "zero_bucket_size_in_m=12 cpu_offload=False communication_dtype=None "
            "overlap_communication=True custom_policy=None pp_style='1f1b' num_model_chunks=1 "
            "num_layers_per_stage=None gradient_checkpoint_config=None "
            "enable_metadata_cache=True make_vocab_size_divisible_by=64 moe_dp_outside=True "
            "overlap_p2p=True overlap_allgather=False fp8_communication=False use_fp8=False"
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(PINS))
def test_signature_is_pinned(name: str) -> None:
    fn, expected = PINS[name]
    assert describe(fn) == expected
