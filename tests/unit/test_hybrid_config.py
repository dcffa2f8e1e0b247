"""HybridParallelPlugin: argument validation, mesh layout, norm arithmetic (no process group)."""

from __future__ import annotations

import inspect
import math
from typing import Any

import pytest
import torch

from kolossos.amp import LOSS_SCALE_KEYWORDS, LossScalePolicy
from kolossos.booster.plugin import PLUGINS, HybridParallelPlugin
from kolossos.booster.plugin.plugin_base import config_from_arguments
from kolossos.hybrid import HybridParallelConfig, check_world, mesh_layout
from kolossos.hybrid.grad_norm import tp_global_norm
from kolossos.hybrid.sharding import needs_sharding

# Colossal-AI's HybridParallelPlugin keywords (tp_size/pp_size first), in its order.
COLOSSAL_KEYWORDS = [
    "tp_size",
    "pp_size",
    "sp_size",
    "precision",
    "zero_stage",
    "enable_all_optimization",
    "enable_fused_normalization",
    "enable_flash_attention",
    "enable_jit_fused",
    "enable_sequence_parallelism",
    "sequence_parallelism_mode",
    "enable_sequence_overlap",
    "parallel_output",
    "num_microbatches",
    "microbatch_size",
    "initial_scale",
    "min_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "max_scale",
    "max_norm",
    "broadcast_buffers",
    "ddp_bucket_cap_mb",
    "find_unused_parameters",
    "check_reduction",
    "gradient_as_bucket_view",
    "static_graph",
    "zero_bucket_size_in_m",
    "cpu_offload",
    "communication_dtype",
    "overlap_communication",
    "custom_policy",
    "pp_style",
    "num_model_chunks",
    "num_layers_per_stage",
    "gradient_checkpoint_config",
    "enable_metadata_cache",
    "make_vocab_size_divisible_by",
    "dp_outside",
    "overlap_p2p",
    "overlap_allgather",
]


def test_signature_has_every_colossal_keyword_and_the_config_mirrors_it() -> None:
    params = inspect.signature(HybridParallelPlugin.__init__).parameters
    assert list(params)[1:] == COLOSSAL_KEYWORDS
    fields = inspect.signature(HybridParallelConfig).parameters
    policy = LossScalePolicy()  # the config's default loss-scale policy
    for name in COLOSSAL_KEYWORDS[1:]:
        default = getattr(policy, name) if name in LOSS_SCALE_KEYWORDS else fields[name].default
        assert params[name].default == default, name
    assert params["initial_scale"].default == 2**16
    assert params["sequence_parallelism_mode"].default == "split_gather"
    assert PLUGINS["hybrid_parallel"] is HybridParallelPlugin


def test_defaults_and_derived_kwargs() -> None:
    config = HybridParallelConfig(tp_size=2, zero_stage=2, max_norm=1.0, precision="bf16")
    assert config.dtype == torch.bfloat16
    zero = config.zero_kwargs()
    assert zero["partition_grad"] and zero["clip_grad_norm"] == 1.0
    assert zero["reduce_bucket_size"] == 12 * 2**20 and zero["initial_scale"] == 2**16
    ddp = HybridParallelConfig(tp_size=1, ddp_bucket_cap_mb=5).ddp_config()
    assert ddp.bucket_cap_mb == 5 and ddp.broadcast_buffers is True
    assert check_world(config, 8) == 4


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tp_size": 0}, ValueError, "tp_size=0"),
        ({"precision": "fp8"}, ValueError, "precision='fp8'"),
        ({"zero_stage": 3}, ValueError, "GeminiPlugin"),
        ({"zero_stage": True}, ValueError, "zero_stage=True"),
        ({"max_norm": -1.0}, ValueError, "max_norm=-1.0"),
        ({"max_norm": math.inf}, ValueError, "finite"),
        ({"initial_scale": 0}, ValueError, "initial_scale"),
        ({"static_graph": 1}, TypeError, "static_graph=1"),
        ({"ddp_bucket_cap_mb": 0}, ValueError, "ddp_bucket_cap_mb"),
        ({"cpu_offload": True}, ValueError, "cpu_offload is a ZeRO option"),
        ({"communication_dtype": torch.float16}, ValueError, "zero_stage=0 uses DDP"),
        ({"zero_stage": 1, "communication_dtype": torch.int8}, ValueError, "communication_dtype"),
        ({"overlap_allgather": True}, ValueError, "overlap_allgather=True with zero_stage=0"),
        ({"sp_size": 2}, ValueError, "sp_size=2 with enable_sequence_parallelism=False"),
        ({"sequence_parallelism_mode": "zigzag"}, ValueError, "sequence_parallelism_mode"),
        (
            {
                "tp_size": 1,
                "enable_sequence_parallelism": True,
                "sequence_parallelism_mode": "ring",
            },
            ValueError,
            "tp_size=1: ring sequence parallelism shards along the TP group",
        ),
        (
            {
                "enable_sequence_parallelism": True,
                "enable_sequence_overlap": True,
                "sequence_parallelism_mode": "ring",
            },
            NotImplementedError,
            "already overlaps every exchange",
        ),
        ({"enable_sequence_overlap": True}, ValueError, "enable_sequence_parallelism=False"),
        ({"tp_size": 1, "enable_sequence_parallelism": True}, ValueError, "tp_size >= 2"),
        ({"pp_style": "zigzag"}, ValueError, "pp_style='zigzag' is not a pipeline schedule"),
        ({"pp_style": "1f1b", "num_model_chunks": 2}, ValueError, "'interleaved'"),
        ({"num_model_chunks": 2}, ValueError, "interleaved"),
        ({"num_layers_per_stage": [2, 0]}, ValueError, "num_layers_per_stage"),
        ({"num_microbatches": 0}, ValueError, "num_microbatches=0"),
        ({"pp_size": 2}, ValueError, "num_microbatches or microbatch_size"),
        ({"pp_style": "zbv", "num_model_chunks": 3}, ValueError, "num_model_chunks=2"),
        (
            {"pp_size": 2, "num_microbatches": 4, "num_layers_per_stage": [1, 1, 2]},
            ValueError,
            "one count per virtual stage",
        ),
        (
            {"pp_size": 2, "num_microbatches": 4, "overlap_p2p": False},
            NotImplementedError,
            "overlap_p2p=False",
        ),
    ],
)
def test_bad_arguments_fail_with_the_fix(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        config_from_arguments(HybridParallelConfig, {"tp_size": 2} | kwargs)


def test_sequence_parallelism_and_pipeline_options_that_are_valid() -> None:
    HybridParallelConfig(tp_size=2, enable_sequence_parallelism=True)
    HybridParallelConfig(
        tp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode=None
    )
    # pipeline-only options are validated and inert at pp_size=1 (Colossal-AI scripts pass them)
    HybridParallelConfig(tp_size=2, microbatch_size=1, num_layers_per_stage=[1, 1])
    # the pipeline schedules and their chunk counts
    HybridParallelConfig(tp_size=1, pp_size=2, num_microbatches=4)
    HybridParallelConfig(
        tp_size=2, pp_size=2, microbatch_size=1, pp_style="interleaved", num_model_chunks=2
    )
    HybridParallelConfig(tp_size=1, pp_size=4, num_microbatches=4, pp_style="zbv",
                         num_model_chunks=2, zero_stage=1)  # fmt: skip
    # split-gather sequence parallelism inside pipeline stages (the stages exchange shards)
    HybridParallelConfig(tp_size=2, pp_size=2, num_microbatches=4, enable_sequence_parallelism=True)


def test_zero2_with_a_pipeline_is_allowed_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="zero_stage=1 is usually faster"):
        HybridParallelConfig(tp_size=1, pp_size=2, num_microbatches=4, zero_stage=2)


def test_world_size_must_be_a_multiple_of_the_model_parallel_size() -> None:
    with pytest.raises(ValueError, match="world size 6 is not divisible by tp_size"):
        check_world(HybridParallelConfig(tp_size=4), 6)


def test_mesh_layout_puts_tp_last() -> None:
    assert mesh_layout(2, 1, 2) == ((2, 1, 2), ("dp", "pp", "tp"))
    assert mesh_layout(2, 3, 4, dp_outside=False) == ((3, 2, 4), ("pp", "dp", "tp"))


def test_needs_sharding() -> None:
    assert not needs_sharding(HybridParallelConfig(tp_size=1))
    assert needs_sharding(HybridParallelConfig(tp_size=2))
    assert needs_sharding(HybridParallelConfig(tp_size=1, custom_policy=object()))


def test_norm_counts_sharded_and_replicated_pieces_locally() -> None:
    sharded, replicated = torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])
    total = tp_global_norm([(sharded, True), (replicated, False)], 2.0, None)
    torch.testing.assert_close(total, torch.tensor(5.0))
    inf = tp_global_norm([(sharded, True), (-2 * replicated, False)], math.inf, None)
    torch.testing.assert_close(inf, torch.tensor(8.0))
    assert tp_global_norm([], 2.0, None).item() == 0.0


def test_sequence_options_are_forwarded_to_shardformer() -> None:
    from kolossos.hybrid.sharding import _shard_config, check_shard_options

    check_shard_options(HybridParallelConfig(tp_size=2, parallel_output=False))  # forwarded
    sp = {"tp_size": 2, "enable_sequence_parallelism": True}
    for kwargs in ({"sequence_parallelism_mode": "ring"}, {"enable_sequence_overlap": True}):
        check_shard_options(HybridParallelConfig(**sp, **kwargs))
        shard = _shard_config(HybridParallelConfig(**sp, **kwargs), None)
        for name, value in kwargs.items():
            assert getattr(shard, name) == value
