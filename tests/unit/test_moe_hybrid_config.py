"""MoeHybridParallelConfig validation and the world-size arithmetic (no process group)."""

from __future__ import annotations

import pytest

from kolossos.moe.hybrid_config import MoeHybridParallelConfig, check_moe_world


def test_expert_data_parallel_size() -> None:
    assert check_moe_world(MoeHybridParallelConfig(ep_size=2, precision="fp32"), 8) == 4
    assert check_moe_world(MoeHybridParallelConfig(ep_size=4, precision="fp32"), 4) == 1


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match=r"world size 4 is not divisible by ep_size \* pp_size"):
        check_moe_world(MoeHybridParallelConfig(ep_size=3, precision="fp32"), 4)
    with pytest.raises(ValueError, match=r"ep_size=0 must be an int >= 1"):
        MoeHybridParallelConfig(ep_size=0)
    with pytest.raises(NotImplementedError, match=r"tp_size=2 with ep_size=2.*set tp_size=1"):
        MoeHybridParallelConfig(tp_size=2, ep_size=2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"zero_stage": 1, "precision": "fp16"}, r"precision='fp16' with zero_stage=1"),
        ({"zero_stage": 1, "precision": "bf16", "overlap_allgather": True}, "overlap_allgather"),
    ],
)
def test_unsupported_compositions_are_named(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(NotImplementedError, match=match):
        MoeHybridParallelConfig(ep_size=2, **kwargs)  # type: ignore[arg-type]
