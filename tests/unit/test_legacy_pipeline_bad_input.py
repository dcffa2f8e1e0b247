"""Bad input to the legacy pipeline builders and schedules, refused with an error naming the
value, the rule and the fix, before any communication: an ``exec_seq`` naming a missing module,
more stages than layers, micro-batch counts the docs do not allow, a non-last stage returning a
tuple (checked before its output is sent)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from kolossos.legacy.builder import build_pipeline_model
from kolossos.legacy.builder.pipeline import partition_balanced, partition_uniform
from kolossos.legacy.core import global_context as gpc
from kolossos.legacy.engine.schedule import (
    InterleavedPipelineSchedule,
    PipelineSchedule,
    build_schedule,
)
from kolossos.legacy.engine.schedule.pipeline_data import (
    check_stage_inputs,
    check_stage_output,
    split_micro_batches,
)
from kolossos.legacy.engine.schedule.pipeline_executor import LegacyStepExecutor, StepOptions
from kolossos.legacy.engine.schedule.select import check_pipeline_config
from kolossos.pipeline.pipelinable import PipelinableContext
from kolossos.pipeline.schedule.registry import build_table


@pytest.fixture(autouse=True)
def _restore_virtual_pipeline() -> Any:
    """InterleavedPipelineSchedule sets gpc's virtual pipeline size, as upstream's does."""
    yield
    gpc.set_virtual_pipeline_parallel_size(None)
    gpc.set_virtual_pipeline_parallel_rank(None)


def _context() -> PipelinableContext:
    ctx = PipelinableContext()
    with ctx:
        nn.Sequential()  # a temporary built first: the model is the last outermost module
        net = nn.Module()
        net.conv1 = nn.Linear(2, 2)
        net.layer1 = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
        net.fc = nn.Linear(2, 2)
    assert ctx.model is net
    return ctx


def test_exec_seq_naming_a_missing_module() -> None:
    ctx = _context()
    with pytest.raises(ValueError, match=r"exec_seq\[1\] names module 'layr1'.*did you mean "
                                         r"'layer1'.*top level: conv1, layer1, fc"):  # fmt: skip
        ctx.to_layer_list(["conv1", "layr1", "fc"])
    with pytest.raises(ValueError, match=r"exec_seq\[0\] runs a function 'behind'"):
        ctx.to_layer_list([(torch.tanh, "behind"), "conv1"])
    with pytest.raises(ValueError, match=r"ends with .*'front'"):
        ctx.to_layer_list(["conv1", (torch.tanh, "front")])
    with pytest.raises(ValueError, match="places a function 'after'"):
        ctx.to_layer_list(["conv1", (torch.tanh, "after")])
    with pytest.raises(TypeError, match=r"exec_seq\[1\]=3 is neither"):
        ctx.to_layer_list(["conv1", 3])
    with pytest.raises(ValueError, match="names no module"):
        ctx.to_layer_list([])
    with pytest.raises(RuntimeError, match=r"call pipelinable\.to_layer_list"):
        ctx.partition(1, 2, 0)
    with pytest.raises(RuntimeError, match="no model was built inside"):
        PipelinableContext().to_layer_list(["fc"])
    with pytest.raises(ValueError, match="policy='greedy' is unknown"):
        PipelinableContext(policy="greedy")


def test_more_stages_than_layers() -> None:
    rule = r"3 layers cannot fill 4 stages \(2 ranks x 2 chunks\)"
    with pytest.raises(ValueError, match=rule):
        partition_uniform(3, 2, 2)
    with pytest.raises(ValueError, match=rule):
        partition_balanced([1, 1, 1], 2, 2)
    with pytest.raises(ValueError, match=r"2 layers cannot fill 3 stages"):
        build_pipeline_model(nn.Sequential(nn.Linear(2, 2), nn.Tanh()), num_chunks=3)
    ctx = _context()
    ctx.to_layer_list(["conv1", "layer1", "fc"])
    with pytest.raises(ValueError, match=r"3 layers cannot fill 4 stages"):
        ctx.partition(1, 4, 0)
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, 2\)"):
        ctx.partition(1, 2, 2)
    ctx.policy = "customized"
    ctx.to_layer_list(["conv1", "SPLIT_NODE", "layer1", "fc"])
    with pytest.raises(ValueError, match="into 2 parts, but 2 ranks x 2 chunks need 4"):
        ctx.partition(2, 2, 0)


def test_micro_batches_the_docs_do_not_allow() -> None:
    # interleaved (NUM_CHUNKS or model.num_chunks): NUM_MICRO_BATCHES a multiple of the pipeline
    with pytest.raises(
        ValueError,
        match=r"num_microbatches \(3\) to be a multiple of the "
        r"pipeline size \(2\); set NUM_MICRO_BATCHES to e.g. 4",
    ):
        check_pipeline_config({"NUM_MICRO_BATCHES": 3, "NUM_CHUNKS": 2}, 2)
    check_pipeline_config({"NUM_MICRO_BATCHES": 3, "NUM_CHUNKS": 1}, 2)  # not interleaved
    with pytest.raises(ValueError, match=r"NUM_CHUNKS=2 and model\.num_chunks=3 disagree"):
        check_pipeline_config({"NUM_MICRO_BATCHES": 6, "NUM_CHUNKS": 2,
                               "model": {"num_chunks": 3}}, 2)  # fmt: skip
    with pytest.raises(ValueError, match="NUM_CHUNKS=0 must be an int >= 1"):
        check_pipeline_config({"NUM_MICRO_BATCHES": 4, "NUM_CHUNKS": 0}, 2)
    # the batch must cut into equal micro-batches
    with pytest.raises(ValueError, match="batch size 10 is not divisible by num_microbatches=4"):
        split_micro_batches((torch.zeros(10, 2), torch.zeros(10)), 10, 4)


def test_config_keys_pick_the_schedule() -> None:
    inter = build_schedule({"NUM_MICRO_BATCHES": 4, "NUM_CHUNKS": 2}, 2)
    assert isinstance(inter, InterleavedPipelineSchedule) and inter.num_model_chunks == 2
    plain = build_schedule({"NUM_MICRO_BATCHES": 4, "NUM_CHUNKS": 1, "TENSOR_SHAPE": (2, 4)}, 2)
    assert type(plain) is PipelineSchedule and plain.tensor_shape == torch.Size([2, 4])
    # 1D tensor parallelism asks for scatter/gather; without a PARALLEL_1D group it stays off
    tp = build_schedule(
        {"NUM_MICRO_BATCHES": 4, "parallel": {"pipeline": 2, "tensor": {"mode": "1d", "size": 2}}},
        2,
    )
    assert tp.scatter_gather_tensors is False


def test_a_stage_returning_a_tuple() -> None:
    h = torch.ones(2, 3)
    check_stage_output(h, 0, 2, 0)
    check_stage_output((h, h), 1, 2, 1)  # the last stage may return anything
    with pytest.raises(
        TypeError,
        match=r"pipeline stage 2 of 4 \(pipeline rank 0\) returned a "
        r"tuple of 2 items; every stage but the last must",
    ):
        check_stage_output((h, h), 2, 4, 0)
    with pytest.raises(TypeError, match="returned dict"):
        check_stage_output({"h": h}, 0, 2, 0)


def test_a_stage_that_does_not_take_the_dict_batchs_keys() -> None:
    def good(hidden_states=None, input_ids=None, attention_mask=None):
        return hidden_states

    def loose(x, **kwargs):
        return x

    def bad(x):
        return x

    batch = {"stage_output": torch.ones(1), "input_ids": torch.ones(1), "attention_mask": None}
    check_stage_inputs(good, batch, 1, 1)
    check_stage_inputs(loose, batch, 1, 1)
    check_stage_inputs(bad, torch.ones(1), 0, 0)  # a tensor batch: nothing to name
    with pytest.raises(
        TypeError,
        match=r"pipeline stage 1 \(pipeline rank 1\) gets the dict "
        r"batch's entries \['input_ids', 'attention_mask'\]",
    ):
        check_stage_inputs(bad, batch, 1, 1)


class _NoSend:
    """A point-to-point layer that fails the test if anything is sent or received."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"communication ({name}) before the stage output was checked")


class _Engine:
    criterion = nn.MSELoss()


def test_the_executor_checks_the_output_before_sending() -> None:
    class TupleStage(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    table = build_table("1f1b", 2, 2, 1)
    options = StepOptions(num_microbatches=2, forward_only=False, return_loss=True,
                          keep_outputs=False, data_func=None, on_chunk=lambda c: None)  # fmt: skip
    micro = split_micro_batches((torch.ones(4, 3), torch.ones(4, 3)), 4, 2)
    executor = LegacyStepExecutor(table, 0, [0, 1], _NoSend(), [TupleStage()],  # type: ignore[arg-type]
                                  _Engine(), micro, options)  # type: ignore[arg-type]  # fmt: skip
    with pytest.raises(TypeError, match=r"pipeline stage 0 of 2 \(pipeline rank 0\) returned"):
        executor.run(keep_outputs=False)
