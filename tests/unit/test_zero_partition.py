"""ZeRO-1/2 pure logic: flat layout and padding, ownership, bucket plans, partition states,
argument validation (no process group)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kolossos.amp import LossScalePolicy
from kolossos.zero.low_level.bucket import BufferPool, buckets_of_params, plan_buckets
from kolossos.zero.low_level.config import LowLevelZeroConfig
from kolossos.zero.low_level.flat_buffers import attach_grad_views, flatten_params, param_views
from kolossos.zero.low_level.options import ZeroOptions
from kolossos.zero.low_level.partition import FlatLayout, intersect
from kolossos.zero.low_level.state_io import PartitionStateBuilder, local_piece

SHAPES = [(3, 2), (5,), (1,), (4, 4), (0,), (7,)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 64])
def test_layout_is_contiguous_in_order_and_padded_at_the_end(world: int) -> None:
    layout = FlatLayout.of_shapes(SHAPES, world)
    offsets = [s.offset for s in layout.spans]
    assert offsets == [0, 6, 11, 12, 28, 28]  # parameter order, no gaps
    assert layout.numel == 35
    assert layout.padded_numel % world == 0
    assert 0 <= layout.padding < world
    assert layout.padded_numel == layout.numel + layout.padding
    ranges = [layout.partition_range(r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # equal, adjacent
    assert {stop - start for start, stop in ranges} == {layout.partition_numel}
    assert sum(layout.valid_numel(r) for r in range(world)) == layout.numel


def test_owners_and_spans_split_ranges() -> None:
    layout = FlatLayout.of_shapes([(3, 2), (5,)], world_size=4)  # T=11, S=3, padding 1
    assert layout.owners(0, 11) == [(0, 0, 3), (1, 3, 6), (2, 6, 9), (3, 9, 11)]
    assert layout.owners(4, 9) == [(1, 4, 6), (2, 6, 9)]
    assert [(s.index, a, b) for s, a, b in layout.spans_in(4, 9)] == [(0, 4, 6), (1, 6, 9)]
    assert layout.valid_numel(3) == 2
    assert intersect((0, 3), (3, 5)) is None
    with pytest.raises(IndexError):
        layout.partition_range(4)


@pytest.mark.parametrize(("world", "bucket"), [(1, 5), (2, 4), (3, 1), (4, 100), (8, 3)])
def test_buckets_cover_every_element_once_inside_one_partition(world: int, bucket: int) -> None:
    layouts = [FlatLayout.of_shapes(SHAPES, world), FlatLayout.of_shapes([(9,), (2, 2)], world)]
    buckets = plan_buckets(layouts, bucket)
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert [b.group for b in buckets] == sorted((b.group for b in buckets), reverse=True)
    for g, layout in enumerate(layouts):
        mine = [b for b in buckets if b.group == g]
        covered = sorted((b.start, b.stop) for b in mine)
        assert covered[0][0] == 0 and covered[-1][1] == layout.numel  # padding excluded
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))
        for b in mine:
            assert 0 < b.numel <= bucket
            start, stop = layout.partition_range(b.owner)
            assert start <= b.start and b.stop <= stop  # one owner per bucket
            assert sum(p.hi - p.lo for p in b.pieces) == b.numel
        assert [b.start for b in mine] == sorted((b.start for b in mine), reverse=True)
    table = buckets_of_params(buckets, [len(layout.spans) for layout in layouts])
    for g, layout in enumerate(layouts):
        for span in layout.spans:
            assert sum(p.hi - p.lo for _, p in table[g][span.index]) == span.numel


def test_flatten_makes_parameters_views_and_keeps_them() -> None:
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(3, 2), (5,)]]
    values = [p.detach().clone() for p in params]
    layout = FlatLayout.of_shapes([p.shape for p in params], world_size=4)
    flat = flatten_params(params, layout, torch.device("cpu"))
    assert flat.numel() == 12 and flat[11] == 0
    for p, v in zip(params, values, strict=True):
        assert torch.equal(p, v) and p.untyped_storage().data_ptr() == flat.data_ptr()
    grads = torch.zeros_like(flat)
    views = param_views(grads, layout)
    params[0].grad = torch.ones(3, 2)
    attach_grad_views(params, views)
    assert params[0].grad is views[0] and torch.equal(grads[:6], torch.ones(6))
    (params[0].sum() * 2 + params[1].sum()).backward()  # autograd accumulates in place
    assert torch.equal(grads[:11], torch.tensor([3.0] * 6 + [1.0] * 5))
    with pytest.raises(TypeError, match="mixes dtypes"):
        mixed = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2).half())]
        flatten_params(mixed, FlatLayout.of_shapes([(2,), (2,)], 1), torch.device("cpu"))


def test_partition_state_builder_cuts_each_rank_its_slice() -> None:
    layout = FlatLayout.of_shapes([(3, 2), (5,)], world_size=4)
    full = {0: torch.arange(6.0).view(3, 2), 1: torch.arange(6.0, 11.0)}
    parts = []
    for rank in range(4):
        builder = PartitionStateBuilder(layout, rank, torch.zeros(3))
        for index, value in full.items():
            builder.add(index, {"exp_avg": value, "step": torch.tensor(5.0)})
        parts.append(builder.state["exp_avg"])
        assert builder.state["step"] == 5.0
    assert torch.equal(torch.cat(parts), torch.tensor([*range(11), 0.0]))
    assert local_piece(layout, 1, layout.spans[0]) == (0, 3, 3)
    assert local_piece(layout, 3, layout.spans[0]) is None


def test_buffer_pool_reuses_buffers() -> None:
    pool = BufferPool(8, torch.float32, torch.device("cpu"))
    a = pool.acquire(5)
    pool.release(a)
    b = pool.acquire(8)
    assert b.data_ptr() == a.data_ptr() and b.numel() == 8
    assert pool.acquire(3).data_ptr() != b.data_ptr()


def test_plugin_config_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="GeminiPlugin or TorchFSDPPlugin"):
        LowLevelZeroConfig(stage=3)
    with pytest.raises(ValueError, match="TorchDDPPlugin"):
        LowLevelZeroConfig(stage=0)
    with pytest.raises(ValueError, match="precision='fp8'"):
        LowLevelZeroConfig(precision="fp8")
    with pytest.raises(ValueError, match="reduce_bucket_size_in_m"):
        LowLevelZeroConfig(reduce_bucket_size_in_m=0)
    with pytest.raises(ValueError, match="communication_dtype"):
        LowLevelZeroConfig(communication_dtype=torch.int8)
    with pytest.raises(ValueError, match="max_norm"):
        LowLevelZeroConfig(max_norm=-1.0)
    with pytest.raises(ValueError, match="norm_type"):
        LowLevelZeroConfig(norm_type=0)
    with pytest.raises(TypeError, match="cpu_offload"):
        LowLevelZeroConfig(cpu_offload="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="initial_scale"):
        LowLevelZeroConfig(loss_scale=LossScalePolicy(initial_scale=2**40))
    config = LowLevelZeroConfig(stage=2, precision="bf16", reduce_bucket_size_in_m=0.5)
    kwargs = config.optimizer_kwargs()
    assert kwargs["partition_grad"] and kwargs["reduce_bucket_size"] == 2**19
    assert config.dtype == torch.bfloat16


def test_optimizer_options_are_validated() -> None:
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        ZeroOptions(reduce_bucket_size=0)
    with pytest.raises(ValueError, match="clip_grad_norm=inf"):
        ZeroOptions(clip_grad_norm=float("inf"))
    with pytest.raises(ValueError, match="forced_dtype"):
        ZeroOptions(forced_dtype=torch.float64)
    assert ZeroOptions(norm_type=float("inf")).norm_type == float("inf")
