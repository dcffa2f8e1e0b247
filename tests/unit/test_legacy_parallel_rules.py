"""Every rule of the ``parallel`` config key (CHECKLIST §3.3) fails with a clear error before
any process group exists, and the group layouts match Colossal-AI's initializers."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import kolossos
from kolossos.legacy.context.parallel_rules import parse_parallel
from kolossos.legacy.context.process_group_initializer import layouts


def test_defaults_and_inferred_data_size() -> None:
    layout = parse_parallel(None, 8)
    assert (layout.data_size, layout.pipeline_size, layout.tensor_size) == (8, 1, 1)
    layout = parse_parallel(dict(pipeline=dict(size=2), tensor=dict(size=2, mode="1d")), 8)
    assert (layout.data_size, layout.pipeline_size, layout.tensor_size) == (2, 2, 2)
    assert parse_parallel(dict(pipeline=2), 4) == parse_parallel(dict(pipeline=dict(size=2)), 4)
    assert parse_parallel(dict(tensor=dict(size=4, mode="sequence")), 4).tensor_mode == "sequence"
    layout = parse_parallel(dict(tensor=dict(size=8, mode="2.5d", depth=2)), 8)
    assert layout.tensor_kwargs == {"depth": 2}
    assert parse_parallel(dict(tensor=dict(size=8, mode="3d")), 8).tensor_size == 8
    assert parse_parallel(dict(data=2, pipeline=2), 4).data_size == 2


@pytest.mark.parametrize(
    ("parallel", "world", "match"),
    [
        (dict(tensor=4), 4, r"tensor=4 has no mode.*dict\(size=4, mode=...\)"),
        (dict(tensor=dict(size=4)), 4, "has no mode; add mode="),
        (dict(tensor=dict(size=8, mode="2d")), 8, "2D tensor parallelism needs a square size"),
        (dict(tensor=dict(size=8, mode="2.5d", depth=4)), 8, r"size = q\*q\*depth; size=8"),
        (dict(tensor=dict(size=8, mode="2.5d")), 8, "needs depth=d"),
        (dict(tensor=dict(size=4, mode="3d")), 4, "3D tensor parallelism needs a cube size"),
        (dict(tensor=dict(size=4, mode="4d")), 4, r"tensor mode='4d' is unknown"),
        (dict(tensor=dict(size=4, mode="2d", depth=2)), 4, "depth is for mode='2.5d'"),
        (dict(pipeline=3), 4, r"pipeline \(3\) x tensor \(1\) = 3 does not divide"),
        (dict(pipeline=2, tensor=dict(size=2, mode="1d")), 6, "does not divide the world size 6"),
        (dict(pipeline=0), 4, "pipeline size 0 must be a positive int"),
        (dict(pipeline="2"), 4, "pipeline size '2' must be a positive int"),
        (dict(pipeline=dict(size=2, chunks=2)), 4, r"unknown keys \['chunks'\]"),
        (dict(data=4, pipeline=2), 4, "data size is inferred"),
        (dict(pipelines=2), 4, r"unknown keys \['pipelines'\]"),
        ([2], 4, "must be a dict"),
    ],
)
def test_broken_rules_are_clear_errors(parallel: object, world: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_parallel(parallel, world)


def test_moe_size_is_read_and_checked() -> None:
    assert parse_parallel(dict(moe=dict(size=2)), 4).moe_size == 2
    assert parse_parallel(None, 4).moe_size is None
    with pytest.raises(NotImplementedError, match=r"moe \(size 2\) with tensor size 2"):
        parse_parallel(dict(moe=dict(size=2), tensor=dict(size=2, mode="1d")), 4)
    with pytest.raises(ValueError, match=r"moe size 3 must divide the data-parallel size 4"):
        parse_parallel(dict(moe=dict(size=3)), 4)


# Expected layouts, computed by hand from Colossal-AI's v0.2.8 initializers.
def test_data_model_pipeline_tensor_layouts() -> None:
    # world 8 = data 2 x pipeline 2 x tensor 2
    assert layouts.data_groups(8, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layouts.model_groups(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layouts.pipeline_groups(8, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layouts.tensor_groups(8, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layouts.sequence_dp_groups(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_2d_2p5d_3d_layouts() -> None:
    rows, cols = layouts.groups_2d(4, 4)
    assert rows == [[0, 1], [2, 3]] and cols == [[0, 2], [1, 3]]
    cols, rows, deps, xz = layouts.groups_2p5d(8, 8, 2)
    assert cols == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert rows == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert deps == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert xz == [[0, 2, 4, 6], [1, 3, 5, 7]]
    inputs, weights, outputs, in_w, out_w = layouts.groups_3d(8, 8)
    assert inputs == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert weights == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert outputs == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert in_w == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert out_w == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_launch_refuses_a_broken_parallel_config_before_the_rendezvous() -> None:
    # no other process will ever join: reaching the rendezvous would hang, not raise
    with pytest.raises(ValueError, match=r"tensor=4 has no mode"):
        kolossos.launch(
            config=dict(parallel=dict(tensor=4)), rank=0, world_size=4, host="127.0.0.1",
            port=29999, verbose=False,
        )  # fmt: skip
    assert not dist.is_initialized()
