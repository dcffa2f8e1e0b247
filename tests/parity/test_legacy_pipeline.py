"""The legacy pipeline schedules through ``kolossos.initialize`` vs single-process training of the
whole model (CPU/gloo): ``PipelineSchedule`` on 2 and 4 ranks (also pipeline 2 x data 2),
``InterleavedPipelineSchedule`` on 2 and 4 ranks, with and without ``TENSOR_SHAPE``, fp16 NAIVE
AMP, and a weight tied across the first and the last stage with ``PipelineSharedModuleWrapper``.
The last stage's loss at every step, each stage's parameters at the end (against the matching
layers of the reference), and that training moved them far beyond the tolerance."""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.nn as nn

import kolossos
from kolossos.amp import AMP_TYPE, convert_to_amp
from kolossos.context import ParallelMode
from kolossos.core import global_context as gpc
from kolossos.engine.schedule import InterleavedPipelineSchedule, PipelineSchedule
from kolossos.legacy.nn import PipelineSharedModuleWrapper
from kolossos.pipeline import partition_uniform
from kolossos.testing import spawn
from kolossos.testing.parity import assert_moved, global_mean, make_classification_batches
from kolossos.testing.parity import snapshot as take_snapshot

D = 8  # features = hidden = classes
STEPS = 5
GLOBAL_BATCH = 16
MICRO = 4
LR = 0.5
FP32_TOL = 2e-5
CLIP = 0.05  # below the gradient norms here: clipping is active
AMP_TOL = 1e-3


class Block(nn.Module):
    """One pipeline layer: ``tanh(linear(x))``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


# name -> (world size, parallel config, layers, chunks, extra config keys)
CASES: dict[str, tuple[int, dict[str, Any], int, int, dict[str, Any]]] = {
    "pp2": (2, dict(pipeline=2), 4, 1, {}),
    "pp2_tensor_shape": (2, dict(pipeline=2), 4, 1, {"TENSOR_SHAPE": "micro"}),
    "pp2_naive_amp": (2, dict(pipeline=2), 4, 1,
                      {"fp16": dict(mode=AMP_TYPE.NAIVE, initial_scale=2**10)}),
    "pp2_torch_amp_tensor_shape": (2, dict(pipeline=2), 4, 1,
                                   {"fp16": dict(mode=AMP_TYPE.TORCH), "TENSOR_SHAPE": "micro"}),
    "pp2_tied_clip": (2, dict(pipeline=2), 4, 1, {"clip_grad_norm": CLIP}),
    "interleaved2": (2, dict(pipeline=2), 4, 2, {}),
    "pp4": (4, dict(pipeline=4), 4, 1, {}),
    "pp2_dp2": (4, dict(pipeline=2), 4, 1, {}),
    "interleaved4_tensor_shape": (4, dict(pipeline=4), 8, 2, {"TENSOR_SHAPE": "micro"}),
}  # fmt: skip


def _config(case: str, dp_size: int) -> dict[str, Any]:
    _, parallel, _, chunks, extra = CASES[case]
    config: dict[str, Any] = dict(parallel=parallel, NUM_MICRO_BATCHES=MICRO, **extra)
    if config.get("TENSOR_SHAPE") == "micro":
        config["TENSOR_SHAPE"] = (GLOBAL_BATCH // dp_size // MICRO, D)
    if chunks > 1:
        config["model"] = dict(num_chunks=chunks)
    return config


def _reference(model: nn.Module, batches: list[Any], case: str) -> list[float]:
    """Single-process training of the whole model on the global batches."""
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    criterion: Any = nn.CrossEntropyLoss()
    optim: Any = sgd
    fp16 = CASES[case][4].get("fp16")
    if fp16 is not None:
        model, optim, criterion = convert_to_amp(model, sgd, criterion, fp16["mode"], fp16)
    losses = []
    for x, y in batches:
        optim.zero_grad()
        loss = criterion(model(x), y)
        optim.backward(loss) if fp16 is not None else loss.backward()
        if "clip_grad_norm" in CASES[case][4]:  # the tied weight counts once
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            assert norm > 2 * CLIP, "clipping must be active"
        optim.step()
        losses.append(float(loss.item()))
    return losses


def _stage(layers: list[Block], bounds: list[tuple[int, int]]) -> nn.Module:
    """This rank's chunks, keeping the whole model's layer indices as names."""
    chunks = [
        nn.Sequential(OrderedDict((str(k), layers[k]) for k in range(a, b))) for a, b in bounds
    ]
    return chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)


def _named(stage: nn.Module) -> dict[str, torch.Tensor]:
    """The stage's parameters under the whole model's names."""
    chunks = stage if isinstance(stage, nn.ModuleList) else [stage]
    return {n: p for c in chunks for n, p in c.named_parameters()}


def _train(rank: int, world_size: int, port: int, case: str) -> None:
    _, parallel, num_layers, chunks, extra = CASES[case]
    config = _config(case, world_size // parallel["pipeline"])
    kolossos.launch(config, rank, world_size, "localhost", port, verbose=False)
    pp_size, pp_rank = gpc.pipeline_parallel_size, gpc.get_local_rank(ParallelMode.PIPELINE)
    dp_size, dp_rank = gpc.data_parallel_size, gpc.get_local_rank(ParallelMode.DATA)
    last = pp_rank == pp_size - 1
    torch.manual_seed(0)
    layers = [Block() for _ in range(num_layers)]
    reference = nn.Sequential(*copy.deepcopy(layers))
    tied = case == "pp2_tied_clip"
    if tied:  # the first layer's weight is the last layer's: one parameter in the reference
        reference[-1].lin.weight = reference[0].lin.weight
    stage = _stage(layers, partition_uniform(num_layers, pp_size, chunks)[pp_rank])
    if tied:
        wrapper = PipelineSharedModuleWrapper([0, pp_size - 1])
        wrapper.register_parameter(layers[0].lin.weight if pp_rank == 0 else layers[-1].lin.weight)
    initial = take_snapshot(_named(stage))
    batches = make_classification_batches(STEPS, GLOBAL_BATCH, d_in=D, classes=D)
    size = GLOBAL_BATCH // dp_size
    loader = [(x[dp_rank * size : (dp_rank + 1) * size], y[dp_rank * size : (dp_rank + 1) * size])
              for x, y in batches]  # fmt: skip
    sgd = torch.optim.SGD(stage.parameters(), lr=LR, momentum=0.9)
    engine, loader, _, _ = kolossos.initialize(
        stage, sgd, nn.CrossEntropyLoss(), loader, verbose=False
    )
    assert engine.uses_pipeline
    expected_type = InterleavedPipelineSchedule if chunks > 1 else PipelineSchedule
    assert type(engine.schedule) is expected_type
    handlers = [type(h).__name__ for h in engine.gradient_handlers]
    assert ("PipelineSharedModuleGradientHandler" in handlers) == tied
    assert ("DataParallelGradientHandler" in handlers) == (dp_size > 1)

    engine.train()
    losses = []
    data = iter(loader)
    for _ in range(STEPS):
        engine.zero_grad()
        output, label, loss = engine.execute_schedule(data)
        engine.step()
        if last:
            assert output.shape == (size, D) and torch.equal(label, loader[len(losses)][1])
            losses.append(global_mean(loss, gpc.get_group(ParallelMode.DATA)))
        else:
            assert (output, label, loss) == (None, None, None)
    ref_losses = _reference(reference, batches, case)
    tol = AMP_TOL if "fp16" in extra else FP32_TOL
    if last:
        torch.testing.assert_close(losses, ref_losses, rtol=tol, atol=tol)
    expected = dict(reference.named_parameters())
    if tied:
        expected[f"{num_layers - 1}.lin.weight"] = reference[0].lin.weight
    named = _named(stage)
    for name, value in named.items():
        want = expected[name].detach().float()
        torch.testing.assert_close(value.detach().float(), want, rtol=tol, atol=tol,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip
    assert_moved(initial, named, tol)
    if case == "pp2":
        _check_eval_and_errors(engine, reference, batches[0], last)


def _check_eval_and_errors(
    engine: Any, reference: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], last: bool
) -> None:
    """Forward-only evaluation matches the reference; a batch that does not split into the
    micro-batches raises the same error on every rank before any communication."""
    x, y = batch
    engine.eval()
    output, label, loss = engine.execute_schedule(iter([(x, y)]), forward_only=True)
    if last:
        with torch.no_grad():
            want = reference(x)
        torch.testing.assert_close(output, want, rtol=FP32_TOL, atol=FP32_TOL)
        torch.testing.assert_close(loss, nn.functional.cross_entropy(want, y).reshape(1),
                                   rtol=FP32_TOL, atol=FP32_TOL)  # fmt: skip
        assert torch.equal(label, y)
    # a smaller batch (shapes are exchanged again) without loss
    output, _, no_loss = engine.execute_schedule(
        iter([(x[:8], y[:8])]), forward_only=True, return_loss=False
    )
    assert no_loss is None
    if last:
        torch.testing.assert_close(output, want[:8], rtol=FP32_TOL, atol=FP32_TOL)
    with pytest.raises(ValueError, match="not divisible by num_microbatches=4"):
        engine.execute_schedule(iter([(x[:6], y[:6])]))


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_legacy_pipeline_matches_single_process(case: str) -> None:
    spawn(_train, CASES[case][0], case=case)
