"""The configuration rules of HybridParallelPlugin's ``sp_size`` / ``sequence_parallelism_mode``
(no process group needed) and the mesh layout with a sequence-parallel axis."""

from __future__ import annotations

from typing import Any

import pytest

from kolossos.hybrid.config import HybridParallelConfig, check_world
from kolossos.hybrid.mesh import mesh_layout
from kolossos.shardformer import GradientCheckpointConfig


def config(**kwargs: Any) -> HybridParallelConfig:
    return HybridParallelConfig(**{"tp_size": 1, **kwargs})


@pytest.mark.parametrize("mode", ["all_to_all", "ring_attn"])
def test_attention_modes_take_a_separate_axis(mode: str) -> None:
    c = config(
        tp_size=2, sp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode=mode
    )
    assert c.sp_axis_size == 2
    assert check_world(c, 8) == 2  # dp = world / (tp * pp * sp)
    with pytest.raises(ValueError, match=r"tp_size \* pp_size \* sp_size = 2 \* 1 \* 2"):
        check_world(c, 6)
    # no tensor parallelism needed; sp_size None means 1 (Colossal-AI's default)
    assert (
        config(enable_sequence_parallelism=True, sequence_parallelism_mode=mode).sp_axis_size == 1
    )


@pytest.mark.parametrize("mode", ["all_to_all", "ring_attn"])
def test_gradient_checkpointing_composes_with_pipeline_and_sequence_parallelism(mode: str) -> None:
    ckpt = GradientCheckpointConfig(gradient_checkpointing_ratio=0.5)
    c = config(
        pp_size=2, sp_size=2, num_microbatches=2, enable_sequence_parallelism=True,
        sequence_parallelism_mode=mode, gradient_checkpoint_config=ckpt,
    )  # fmt: skip
    assert c.sp_axis_size == 2 and c.gradient_checkpoint_config is ckpt


def test_split_gather_composes_with_pipeline_parallelism() -> None:
    c = config(tp_size=2, pp_size=2, num_microbatches=2, enable_sequence_parallelism=True)
    assert c.sp_axis_size == 1 and check_world(c, 4) == 1  # the TP group: no separate axis


@pytest.mark.parametrize("mode", ["all_to_all", "ring_attn"])
def test_attention_modes_compose_with_pipeline_parallelism(mode: str) -> None:
    c = config(
        tp_size=2, pp_size=2, sp_size=2, num_microbatches=2, enable_sequence_parallelism=True,
        sequence_parallelism_mode=mode,
    )  # fmt: skip
    assert c.sp_axis_size == 2
    assert check_world(c, 16) == 2  # dp = world / (tp * pp * sp)
    with pytest.raises(ValueError, match=r"tp_size \* pp_size \* sp_size = 2 \* 2 \* 2"):
        check_world(c, 12)
    assert mesh_layout(1, 2, 2, sp_size=2, sp_inner=mode != "ring_attn")[0] == (1, 2, 2, 2)


def test_split_gather_keeps_the_tp_group() -> None:
    c = config(tp_size=2, enable_sequence_parallelism=True)
    assert c.sp_axis_size == 1 and check_world(c, 4) == 2
    for extra in ({"sequence_parallelism_mode": "ring"}, {"enable_sequence_overlap": True}):
        c = config(tp_size=2, enable_sequence_parallelism=True, **extra)  # same TP group
        assert c.sp_axis_size == 1 and check_world(c, 4) == 2
    with pytest.raises(ValueError, match="sp_size=2 with sequence_parallelism_mode='split_gather'"):
        config(tp_size=2, sp_size=2, enable_sequence_parallelism=True)
    with pytest.raises(ValueError, match="tp_size >= 2"):
        config(enable_sequence_parallelism=True, sequence_parallelism_mode="split_gather")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sp_size": 2}, ValueError, "enable_sequence_parallelism=False"),
        ({"sp_size": 0, "enable_sequence_parallelism": True}, ValueError, "sp_size=0"),
        (
            {
                "enable_sequence_parallelism": True,
                "sequence_parallelism_mode": "ring",
                "tp_size": 2,
                "sp_size": 2,
            },
            ValueError,
            "sp_size=2 with sequence_parallelism_mode='ring'.*'all_to_all' / 'ring_attn'",
        ),
        (
            {
                "enable_sequence_parallelism": True,
                "sequence_parallelism_mode": "ring",
                "tp_size": 2,
                "enable_sequence_overlap": True,
            },
            NotImplementedError,
            "enable_sequence_overlap=True with sequence_parallelism_mode='ring'.*'split_gather'",
        ),
        (
            {
                "enable_sequence_parallelism": True,
                "sequence_parallelism_mode": "all_to_all",
                "sp_size": 2,
                "enable_sequence_overlap": True,
            },
            NotImplementedError,
            "enable_sequence_overlap=True with sequence_parallelism_mode='all_to_all'",
        ),
        (
            {
                "enable_sequence_parallelism": True,
                "sequence_parallelism_mode": "ring_attn",
                "sp_size": 2,
                "enable_sequence_overlap": True,
            },
            NotImplementedError,
            "enable_sequence_overlap=True with sequence_parallelism_mode='ring_attn'",
        ),
        ({"sequence_parallelism_mode": "zigzag"}, ValueError, "must be one of"),
    ],
)
def test_bad_combinations_name_both_options(
    kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        config(**kwargs)


def test_mesh_layout_with_a_sequence_axis() -> None:
    # Colossal-AI v0.4: Ulysses puts SP innermost, ring attention puts TP innermost
    assert mesh_layout(2, 1, 2, sp_size=2) == ((2, 1, 2, 2), ("dp", "pp", "tp", "sp"))
    assert mesh_layout(2, 1, 2, sp_size=2, sp_inner=False) == (
        (2, 1, 2, 2),
        ("dp", "pp", "sp", "tp"),
    )
    assert mesh_layout(2, 3, 1, dp_outside=False, sp_size=2) == (
        (3, 2, 1, 2),
        ("pp", "dp", "tp", "sp"),
    )
    assert mesh_layout(2, 1, 2) == ((2, 1, 2), ("dp", "pp", "tp"))  # no SP axis: unchanged
