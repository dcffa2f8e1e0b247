"""The legacy pipeline schedules without a process group: config checks and schedule choice,
micro-batch slicing and the per-stage data rules (Colossal-AI's), chunk resolution, and the
errors each raises before any communication."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from kolossos.amp.fp16_module import FP16Module
from kolossos.booster.mixed_precision.mixed_precision_base import AutocastModel
from kolossos.legacy.core import global_context as gpc
from kolossos.legacy.engine.schedule import (
    InterleavedPipelineSchedule,
    NonPipelineSchedule,
    PipelineSchedule,
    build_schedule,
)
from kolossos.legacy.engine.schedule.pipeline_data import (
    call_stage,
    data_and_label,
    merge_micro,
    split_micro_batches,
)
from kolossos.legacy.engine.schedule.pipeline_executor import (
    activation_dtype,
    forward_only_table,
    stage_chunks,
)
from kolossos.legacy.engine.schedule.select import check_pipeline_config
from kolossos.pipeline.schedule.registry import build_table
from kolossos.pipeline.schedule.table import ActionKind


@pytest.fixture(autouse=True)
def _restore_virtual_pipeline() -> Any:
    """InterleavedPipelineSchedule sets gpc's virtual pipeline size, as upstream's does."""
    yield
    gpc.set_virtual_pipeline_parallel_size(None)
    gpc.set_virtual_pipeline_parallel_rank(None)


def test_missing_num_micro_batches_is_refused_under_pipeline_only() -> None:
    check_pipeline_config({}, 1)  # no pipeline: nothing to check
    with pytest.raises(ValueError, match="needs NUM_MICRO_BATCHES"):
        check_pipeline_config({"parallel": {"pipeline": 2}}, 2)
    with pytest.raises(ValueError, match="NUM_MICRO_BATCHES=0 must be an int >= 1"):
        build_schedule({"NUM_MICRO_BATCHES": 0}, 2)


def test_interleaved_needs_a_multiple_of_the_pipeline_size() -> None:
    config = {"NUM_MICRO_BATCHES": 6, "model": {"num_chunks": 2}}
    with pytest.raises(ValueError, match=r"multiple of the pipeline size \(4\).*e\.g\. 8"):
        check_pipeline_config(config, 4)
    check_pipeline_config(config, 3)  # 6 = 2 x 3
    with pytest.raises(ValueError, match=r"model\.num_chunks=0"):
        check_pipeline_config({"NUM_MICRO_BATCHES": 4, "model": {"num_chunks": 0}}, 2)


def test_bad_tensor_shape_and_accumulation_are_refused() -> None:
    with pytest.raises(TypeError, match="tensor_shape=4 must be"):
        check_pipeline_config({"NUM_MICRO_BATCHES": 4, "TENSOR_SHAPE": 4}, 2)
    with pytest.raises(ValueError, match="positive ints"):
        check_pipeline_config({"NUM_MICRO_BATCHES": 4, "TENSOR_SHAPE": (2, 0)}, 2)
    with pytest.raises(NotImplementedError, match="gradient_accumulation=2"):
        check_pipeline_config({"NUM_MICRO_BATCHES": 4, "gradient_accumulation": 2}, 2)


def test_build_schedule_picks_as_upstream() -> None:
    assert type(build_schedule({"NUM_MICRO_BATCHES": 4}, 1)) is NonPipelineSchedule
    plain = build_schedule({"NUM_MICRO_BATCHES": 4, "TENSOR_SHAPE": (2, 8)}, 2)
    assert type(plain) is PipelineSchedule
    assert plain.num_microbatches == 4 and plain.tensor_shape == torch.Size([2, 8])
    inter = build_schedule({"NUM_MICRO_BATCHES": 4, "model": {"num_chunks": 2}}, 2)
    assert isinstance(inter, InterleavedPipelineSchedule) and inter.num_model_chunks == 2
    assert gpc.virtual_pipeline_parallel_size == 2


def test_schedule_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="num_microbatches=0"):
        PipelineSchedule(0)
    with pytest.raises(ValueError, match="takes 1 parameters"):
        PipelineSchedule(2, data_process_func=lambda batch: batch)
    with pytest.raises(ValueError, match="num_model_chunks=0"):
        InterleavedPipelineSchedule(4, 0)
    schedule = PipelineSchedule(2, data_process_func=lambda out, mb: (mb[0], mb[1]))
    assert schedule.scatter_gather_tensors is False


def test_batch_not_divisible_by_the_micro_batch_count() -> None:
    with pytest.raises(ValueError, match="batch size 6 is not divisible by num_microbatches=4"):
        split_micro_batches((torch.zeros(6, 2), torch.zeros(6)), 6, 4)
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        split_micro_batches(("a", 1), None, 2)


def test_micro_batches_follow_upstreams_slicing() -> None:
    x, y = torch.arange(8.0).reshape(4, 2), torch.arange(4)
    pairs = split_micro_batches((x, y), 4, 2)
    assert torch.equal(pairs[1][0], x[2:]) and torch.equal(pairs[1][1], y[2:])
    nested = split_micro_batches(((x, x + 1), y), 4, 4)  # tuple data: each tensor sliced
    assert torch.equal(nested[3][0][1], x[3:] + 1)
    # (data_dict, label): one dict whose "label" is what follows the dict
    merged = split_micro_batches(({"input_ids": x, "mask": x > 2}, y), 4, 2)
    assert set(merged[0]) == {"input_ids", "mask", "label"}
    assert torch.equal(merged[0]["label"], y[:2])
    assert merge_micro([p[1] for p in pairs]).tolist() == y.tolist()
    assert merge_micro([{"a": y[:2]}, {"a": y[2:]}])["a"].tolist() == y.tolist()


def test_stage_data_and_calls() -> None:
    x, y, h = torch.ones(2, 3), torch.zeros(2), torch.full((2, 3), 5.0)
    assert data_and_label(None, (x, y), True, None) == (x, y)  # first stage: the data
    assert data_and_label(h, (x, y), False, None) == (h, y)  # later: the previous output
    data, label = data_and_label(h, {"mask": x, "label": y}, False, None)
    assert label is y and data["stage_output"] is h and data["mask"] is x
    with pytest.raises(TypeError, match=r"\(data, label\) pair, got 3 items"):
        data_and_label(None, (x, y, y), True, None)
    assert data_and_label(h, (x, y), False, lambda out, mb: (mb, out)) == ((x, y), h)

    def stage(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        return args, kwargs

    assert call_stage(stage, x) == ((x,), {})
    assert call_stage(stage, (x, h)) == ((x, h), {})
    assert call_stage(stage, {"stage_output": None, "mask": x}) == ((), {"mask": x})
    assert call_stage(stage, {"stage_output": (h, x), "mask": y}) == ((h, x), {"mask": y})
    with pytest.raises(TypeError, match="got int"):
        call_stage(stage, 3)


def test_wrong_chunk_count_is_refused() -> None:
    two = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    assert len(stage_chunks(two, 2, "InterleavedPipelineSchedule")) == 2
    with pytest.raises(ValueError, match=r"runs 3 model chunk\(s\).*holds 2 chunk\(s\)"):
        stage_chunks(two, 3, "InterleavedPipelineSchedule")
    with pytest.raises(ValueError, match="holds one module"):
        stage_chunks(nn.Linear(2, 2), 2, "InterleavedPipelineSchedule")
    assert stage_chunks(nn.Linear(2, 2), 1, "PipelineSchedule")[0].in_features == 2


def test_chunks_inside_an_amp_wrapper_keep_its_casts() -> None:
    wrapped = FP16Module(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 3)]))
    views = stage_chunks(wrapped, 2, "InterleavedPipelineSchedule")
    out = views[1](torch.ones(4, 2))  # fp32 in, fp16 weights, fp32 out: the wrapper's casts
    assert out.shape == (4, 3) and out.dtype == torch.float32
    assert views[1].module is wrapped.module[1] and wrapped.module is not views[0].module
    assert activation_dtype(views[0]) == torch.float32
    assert activation_dtype(AutocastModel(nn.Linear(2, 2), torch.float16)) == torch.float16
    assert activation_dtype(nn.Linear(2, 2).double()) == torch.float64


def test_forward_only_table_keeps_the_forward_order() -> None:
    table = build_table("interleaved", 2, 4, 2)
    fwd = forward_only_table(table)
    for full, only in zip(table.ranks, fwd.ranks, strict=True):
        assert list(only) == [a for a in full if a.kind is ActionKind.F]
    assert all(a.kind is ActionKind.F for acts in fwd.ranks for a in acts)
