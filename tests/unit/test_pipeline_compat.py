"""Colossal-AI's pipeline names without a process group: the batch helpers of
``schedule._utils`` (upstream's own cases, plus named tuples, ``ModelOutput``-like mappings,
losses and non-tensor leaves), ``create_send_metadata``, the stage manager's chunk questions,
the ``interleaved_pp`` module path, and which schedules take an ``nn.ModuleList`` as one stage.
"""

from __future__ import annotations

import copy
from collections import OrderedDict, namedtuple
from types import MethodType
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kolossos.pipeline import PipelineStageManager, create_schedule
from kolossos.pipeline.p2p import P2PMetadata, TensorMetadata, create_send_metadata
from kolossos.pipeline.schedule._utils import (
    detach,
    get_batch_size,
    get_micro_batch,
    merge_batch,
    model_forward,
    to_device,
)

Pair = namedtuple("Pair", ["x", "y"])


class Output(OrderedDict):  # the shape of a Hugging Face ModelOutput
    def __init__(self, **fields: Any) -> None:
        super().__init__((k, v) for k, v in fields.items() if v is not None)

    def __getattr__(self, name: str) -> Any:
        return self.get(name)


# --- _utils ----------------------------------------------------------------------------------
def test_get_batch_size() -> None:
    t = torch.rand(2, 3)
    for batch in (t, [t], (1, t), {"t": t}, {"dummy": [1], "t": t}, {"t": [t]}):
        assert get_batch_size(batch) == 2
    assert get_batch_size([torch.tensor(1.0), torch.zeros(5)]) == 5  # 0-d has no batch dim
    with pytest.raises(RuntimeError, match="no tensor"):
        get_batch_size({"ids": [1, 2]})


def test_get_micro_batch() -> None:
    x, y = torch.rand(4, 1), torch.rand(4, 3)
    assert torch.equal(get_micro_batch(x, 1, 2), x[1:3])
    first, second = get_micro_batch([x, y], 2, 2)
    assert torch.equal(first, x[2:4]) and torch.equal(second, y[2:4])
    cut = get_micro_batch({"x": x, "y": y, "tag": "a", "scale": torch.tensor(2.0)}, 0, 1)
    assert torch.equal(cut["x"], x[:1]) and torch.equal(cut["y"], y[:1])
    assert cut["tag"] == "a" and cut["scale"].item() == 2.0
    pair = get_micro_batch(Pair(x, (y,)), 3, 1)
    assert isinstance(pair, Pair) and torch.equal(pair.y[0], y[3:])
    out = get_micro_batch(Output(logits=x, hidden=y), 0, 2)
    assert isinstance(out, Output) and torch.equal(out.logits, x[:2])


def test_merge_batch() -> None:
    x, y = torch.rand(2, 1), torch.rand(2, 3)
    assert torch.equal(merge_batch([x[0:1], x[1:2]]), x)
    merged = merge_batch([[x[0:1], y[0:1]], [x[1:2], y[1:2]]])
    assert torch.equal(merged[0], x) and torch.equal(merged[1], y)
    merged = merge_batch([{"x": x[0:1], "y": y[0:1]}, {"x": x[1:2], "y": y[1:2]}])
    assert torch.equal(merged["x"], x) and torch.equal(merged["y"], y)
    assert merge_batch([]) is None
    # losses (0-d) become None, other values a list, containers keep their type
    parts = [Output(loss=torch.tensor(float(i)), logits=x[i : i + 1], n=i) for i in range(2)]
    merged = merge_batch(parts)
    assert isinstance(merged, Output) and merged.loss is None and "loss" not in merged
    assert torch.equal(merged.logits, x) and merged.n == [0, 1]
    pair = merge_batch([Pair(x[:1], y[:1]), Pair(x[1:], y[1:])])
    assert isinstance(pair, Pair) and torch.equal(pair.y, y)
    assert merge_batch([x.T, x.T], batch_size_dim=1).shape == (1, 4)


def test_hugging_face_model_outputs() -> None:
    outputs = pytest.importorskip("transformers.modeling_outputs")
    parts = [
        outputs.CausalLMOutputWithPast(loss=torch.tensor(1.0), logits=torch.full((1, 3), i))
        for i in range(2)
    ]
    assert get_batch_size(parts[0]) == 1  # the 0-d loss has no batch dimension
    merged = merge_batch(parts)
    assert isinstance(merged, outputs.CausalLMOutputWithPast) and merged.loss is None
    assert merged.logits.tolist() == [[0.0] * 3, [1.0] * 3]
    cut = get_micro_batch(merged, 1, 1)
    assert isinstance(cut, outputs.CausalLMOutputWithPast) and cut.logits.tolist() == [[1.0] * 3]
    meta = create_send_metadata(parts[0])
    assert [m.shape for m in meta.tensor_metadata] == [torch.Size([]), torch.Size([1, 3])]


def test_small_helpers() -> None:
    model = nn.Linear(2, 2)
    x = torch.ones(1, 2)
    ref = model(x)
    for data, extra in (([x], None), ({"input": x}, None), (x, {})):
        torch.testing.assert_close(model_forward(model, data, extra), ref)
    assert not detach(ref).requires_grad and detach("s") == "s"
    assert to_device(x, torch.device("cpu")) is x and to_device(3) == 3


# --- metadata --------------------------------------------------------------------------------
def test_create_send_metadata() -> None:
    h = torch.ones(2, 3, requires_grad=True)
    meta = create_send_metadata({"h": h, "mask": [torch.zeros(4, dtype=torch.bool)]})
    assert isinstance(meta, P2PMetadata) and meta.non_tensor_obj_idx == []
    assert meta.tensor_metadata == [
        TensorMetadata(torch.Size([2, 3]), torch.float32, True),
        TensorMetadata(torch.Size([4]), torch.bool, False),
    ]
    with pytest.raises(ValueError, match="strict=False"):
        create_send_metadata(["tag", h])
    meta, tensors = create_send_metadata(["tag", h, 3], strict=False, return_tensor=True)
    assert meta.non_tensor_obj_idx == [0, 2] and meta.non_tensor_objs == ["tag", 3]
    assert len(tensors) == 1 and tensors[0] is h


# --- stage manager ---------------------------------------------------------------------------
def test_stage_manager_chunk_questions() -> None:
    sm = PipelineStageManager.default(num_model_chunks=2)
    assert sm.is_interleave and sm.model_chunk_id is None and sm.num_stages == 1
    assert sm.get_rank() == 0 and sm.get_prev_rank() == sm.get_next_rank() == 0
    assert sm.is_first_stage() and sm.is_last_stage()  # no chunk: the position
    assert sm.is_first_stage(0) and not sm.is_first_stage(1)
    assert sm.is_last_stage(ignore_chunk=True) and sm.is_last_stage(True)  # upstream positional
    with sm.switch_model_chunk_id(1):
        assert not sm.is_first_stage() and sm.is_last_stage()
        assert sm.is_first_stage(ignore_chunk=True)
        with sm.switch_model_chunk_id(0):
            assert sm.is_first_stage() and not sm.is_last_stage()
        assert sm.model_chunk_id == 1
    assert sm.model_chunk_id is None
    assert sm.distribute_layers(8, num_stages=2, num_model_chunks=2) == [2, 2, 2, 2]
    assert sm.get_stage_index([1, 2, 3, 4], stage=1, num_model_chunks=2, num_stages=2) == [
        (1, 3),
        (6, 10),
    ]
    with pytest.raises(ValueError, match="no point-to-point group"):
        sm.get_p2p_process_group(0, 1)
    with pytest.raises(ValueError, match="distinct pipeline positions"):
        sm.init_process_group_by_stages([0, 1])


# --- module paths and the ModuleList rule ----------------------------------------------------
def test_upstream_module_paths() -> None:
    from kolossos.pipeline.schedule import InterleavedSchedule, OneForwardOneBackwardSchedule
    from kolossos.pipeline.schedule.interleaved_pp import InterleavedSchedule as Alias
    from kolossos.pipeline.schedule.one_f_one_b import OneForwardOneBackwardSchedule as OneF

    assert Alias is InterleavedSchedule and OneF is OneForwardOneBackwardSchedule


def layers() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList([nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)])


def run_step(name: str, stage: Any, chunks: int = 1) -> torch.Tensor:
    sm = PipelineStageManager.default(num_model_chunks=chunks)
    torch.manual_seed(1)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    out = create_schedule(name, sm, num_microbatches=2).forward_backward_step(
        stage, iter([(x, y)]), F.mse_loss
    )
    return out["loss"]


def test_a_module_list_with_a_forward_is_one_stage_for_single_chunk_schedules() -> None:
    """Upstream's 1F1B test sets ``forward`` on a plain ``nn.ModuleList`` instance; a subclass
    defining ``forward`` counts too. GPipe, 1F1B and ZB-H1 run it as the stage."""

    class Stack(nn.ModuleList):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self:
                x = layer(x)
            return x

    def run_all(self: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x)
        return x

    ref = nn.Sequential(*copy.deepcopy(layers()))
    torch.manual_seed(1)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    expected = F.mse_loss(ref(x), y)
    for name in ("gpipe", "1f1b", "zbh1"):
        patched = layers()
        patched.forward = MethodType(run_all, patched)
        torch.testing.assert_close(run_step(name, patched), expected)
        torch.testing.assert_close(run_step(name, Stack(layers())), expected)
        assert patched[0].weight.grad is not None


def test_a_module_list_is_the_chunk_list_otherwise() -> None:
    """The interleaved schedule (and ZB-V) take an ``nn.ModuleList`` as the chunks, forward or
    not; a single-chunk schedule takes a plain one (no forward, it cannot be the stage) as a
    list of one chunk."""
    ref = nn.Sequential(*copy.deepcopy(layers()))
    torch.manual_seed(1)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    expected = F.mse_loss(ref(x), y)
    chunks = nn.ModuleList([nn.Sequential(*list(layers())[:2]), nn.Sequential(layers()[2])])
    chunks.forward = lambda x: x  # ignored: these are chunks
    torch.testing.assert_close(run_step("interleaved", chunks, chunks=2), expected)
    one = nn.ModuleList([nn.Sequential(*layers())])
    torch.testing.assert_close(run_step("1f1b", one), expected)
    with pytest.raises(ValueError, match="1 model chunk"):
        run_step("1f1b", layers())  # three layers are not one chunk
