"""ViT training parity under 2D, 2.5D and 3D tensor parallelism and their compositions with data
and pipeline parallelism (issue #22, acceptance item 2), through ``kolossos.launch`` and
``kolossos.initialize`` → Engine, against single-process training of the dense ViT on the whole
global batch.

Cases (one spawn each): 2D on 4 ranks (without and with ``clip_grad_norm``), 3D on 8, 2.5D
(q=2, depth 2) on 8, 2D x data 2 on 8 (the Engine's default torch DDP over DATA, and
``DataParallelGradientHandler``), 1D x pipeline 2 on 4 and 2D x pipeline 2 on 8
(``PipelineSchedule``, 2 micro-batches, also with ``TENSOR_SHAPE``; activations are batch
blocks, sent between the same tensor ranks of adjacent stages). Clipping is active in the 2D,
3D, 2.5D, 2D x DP and 2D x PP cases: it fails unless the Engine's norm counts the 2D / 2.5D / 3D
shards.

Every case builds the dense :class:`~kolossos.legacy.models.vit_nd.VisionTransformerND` from one
seed on every rank, builds the parallel one in the launch's tensor mode (its pipeline stage's
blocks under pipeline parallelism) and copies the dense weights into it
(``load_full_state_dict``; gathering them back must give the dense tensors bit for bit). It then
trains ``STEPS`` SGD steps (momentum) on this rank's share of the global batches, and checks the
loss of every step (the global mean: the tensor-parallel losses already are the mean of the whole
tensor group's batch; averaged over DATA), the gathered full parameters at the end against the
dense reference, that training moved every parameter far beyond the tolerance, and (without
pipeline) the evaluation loss and ``kolossos.nn.metric.Accuracy`` after training.

Tolerance: fp32 on CPU, 1e-5 (absolute and relative). The parallel model computes the same
function; only the order of partial sums differs (SUMMA / Tesseract / 3D block products, the
LayerNorm statistics all-reduced over the feature blocks, gradient sums over replicas and data
ranks, the micro-batch split), a few ulps per op. Over the 4 steps the largest deviations seen
are 5e-7 on the losses (~2.4) and 1.2e-7 on the parameters (|p| <= 2.2): 1e-5 leaves a 20x
margin, while the smallest parameter move (1.1e-3) is 100x the tolerance (``assert_moved`` asks
10x). A wrong head layout, a norm not summed over the shards or a missing data-parallel reduction
is off by 1e-3 or more.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

import kolossos
from kolossos.legacy.context import ParallelMode
from kolossos.legacy.core import global_context as gpc
from kolossos.legacy.engine.schedule import NonPipelineSchedule, PipelineSchedule
from kolossos.legacy.models.vit_nd import (
    VisionTransformerND,
    ViTConfig,
    full_state_dict,
    load_full_state_dict,
    vit_criterion,
)
from kolossos.nn.metric import Accuracy
from kolossos.testing import spawn
from kolossos.testing.parity import assert_moved, assert_same_on_all_ranks, global_mean, snapshot

pytestmark = pytest.mark.dist

VIT = ViTConfig(img_size=8, patch_size=4, in_chans=3, hidden=16, depth=2, num_heads=2,
                mlp_ratio=2, num_classes=10)  # fmt: skip
STEPS = 4
GLOBAL_BATCH = 8  # divisible by every mode's batch blocks x data ranks x micro-batches
LR = 0.1
TOL = 1e-5
CLIP = 0.5  # below the gradient norms of these steps (asserted): clipping is active
CLIP_CFG = {"clip_grad_norm": CLIP}
PIPE_CFG = {"NUM_MICRO_BATCHES": 2}

# name -> (world size, parallel config, further config keys)
CASES: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {
    "2d": (4, dict(tensor=dict(size=4, mode="2d")), {}),
    "2d_clip": (4, dict(tensor=dict(size=4, mode="2d")), CLIP_CFG),
    "3d_clip": (8, dict(tensor=dict(size=8, mode="3d")), CLIP_CFG),
    "2.5d_clip": (8, dict(tensor=dict(size=8, mode="2.5d", depth=2)), CLIP_CFG),
    "2d_dp2_ddp": (8, dict(data=2, tensor=dict(size=4, mode="2d")), CLIP_CFG),
    "2d_dp2_handler": (8, dict(data=2, tensor=dict(size=4, mode="2d")),
                       {"gradient_handler": [dict(type="DataParallelGradientHandler")]}),
    "1d_pp2": (4, dict(pipeline=2, tensor=dict(size=2, mode="1d")), PIPE_CFG),
    "2d_pp2_clip": (8, dict(pipeline=2, tensor=dict(size=4, mode="2d")), PIPE_CFG | CLIP_CFG),
    # one micro-batch's activation on a rank: its 2D block [4/q, tokens, hidden/q]
    "2d_pp2_tensor_shape": (8, dict(pipeline=2, tensor=dict(size=4, mode="2d")),
                            PIPE_CFG | {"TENSOR_SHAPE": (2, 5, 8)}),
}  # fmt: skip


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches, the same on every rank."""
    gen = torch.Generator().manual_seed(1)
    shape = (GLOBAL_BATCH, VIT.in_chans, VIT.img_size, VIT.img_size)
    batches = []
    for _ in range(STEPS):
        images = torch.randn(shape, generator=gen)
        batches.append((images, torch.randint(0, VIT.num_classes, (GLOBAL_BATCH,), generator=gen)))
    return batches


def _reference(dense: nn.Module, batches: list[Any], clip: float | None) -> list[float]:
    """Single-process training of the dense ViT on the whole global batches."""
    sgd = torch.optim.SGD(dense.parameters(), lr=LR, momentum=0.9)
    losses = []
    for x, y in batches:
        sgd.zero_grad()
        loss = nn.functional.cross_entropy(dense(x), y)
        loss.backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), clip)
            assert norm > 1.5 * clip, f"clipping must be active (norm {float(norm):.3f})"
        sgd.step()
        losses.append(float(loss.item()))
    return losses


def _train(rank: int, world_size: int, port: int, case: str) -> None:
    _, parallel, extra = CASES[case]
    config = dict(parallel=copy.deepcopy(parallel), **copy.deepcopy(extra))
    kolossos.launch(config, rank, world_size, "localhost", port, verbose=False)
    mode = parallel["tensor"]["mode"]
    pp_size = gpc.pipeline_parallel_size
    pp_rank = gpc.get_local_rank(ParallelMode.PIPELINE) if pp_size > 1 else 0
    dp_size, dp_rank = gpc.data_parallel_size, gpc.get_local_rank(ParallelMode.DATA)
    last = pp_rank == pp_size - 1

    if case == "2d":  # 1 head cannot be split over the q = 2 feature blocks
        with pytest.raises(ValueError, match="whole heads"):
            VisionTransformerND(ViTConfig(num_heads=1), mode)
    torch.manual_seed(0)
    dense = VisionTransformerND(VIT)
    with torch.no_grad():  # (zeros by default) a class token of unit scale: its LayerNorms are
        dense.patch_embed.cls_token.normal_()  # well conditioned and training stays smooth
        dense.patch_embed.pos_embed.normal_(std=0.5)
    model = VisionTransformerND(VIT, mode, stage=pp_rank, num_stages=pp_size)
    load_full_state_dict(model, dense.state_dict())
    initial = full_state_dict(model)
    dense_state = dense.state_dict()
    for name, value in initial.items():  # the copy both ways is exact
        assert torch.equal(value, dense_state[name]), name
    if pp_size == 1:
        assert initial.keys() == dense_state.keys()
    initial = snapshot(initial)

    batches = _batches()
    size = GLOBAL_BATCH // dp_size
    loader = [(x[dp_rank * size : (dp_rank + 1) * size], y[dp_rank * size : (dp_rank + 1) * size])
              for x, y in batches]  # fmt: skip
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    engine, loader, _, _ = kolossos.initialize(
        model, sgd, vit_criterion(mode), loader, verbose=False
    )
    schedule = PipelineSchedule if pp_size > 1 else NonPipelineSchedule
    assert type(engine.schedule) is schedule
    if "gradient_handler" in extra or (dp_size > 1 and pp_size > 1):
        assert "DataParallelGradientHandler" in [type(h).__name__ for h in engine.gradient_handlers]
    elif dp_size > 1:
        assert isinstance(engine.model, nn.parallel.DistributedDataParallel)

    engine.train()
    losses = []
    data = iter(loader)
    for _ in range(STEPS):
        engine.zero_grad()
        if pp_size > 1:
            _, _, loss = engine.execute_schedule(data)
        else:
            x, y = next(data)
            loss = engine.criterion(engine(x), y)
            engine.backward(loss)
        engine.step()
        if last:
            losses.append(global_mean(loss, gpc.get_group(ParallelMode.DATA)))

    ref_losses = _reference(dense, batches, extra.get("clip_grad_norm"))
    if last:
        torch.testing.assert_close(losses, ref_losses, rtol=TOL, atol=TOL)
    final = full_state_dict(model)
    expected = dict(dense.named_parameters())
    for name, value in final.items():
        torch.testing.assert_close(value, expected[name].detach(), rtol=TOL, atol=TOL,
                                   msg=lambda m, n=name: f"{case} {n}: {m}")  # fmt: skip
    assert_moved(initial, final, TOL)
    if pp_size == 1:
        _check_eval(engine, dense, loader[0], mode)
    if dp_size > 1:  # the data-parallel replicas stayed identical
        assert_same_on_all_ranks(model, gpc.get_group(ParallelMode.DATA))


def _check_eval(engine: Any, dense: nn.Module, batch: Any, mode: str) -> None:
    """After training, evaluation on this data rank's batch: the mode's loss and
    ``kolossos.nn.metric.Accuracy`` (dispatching on the tensor mode) equal the dense ones."""
    x, y = batch
    engine.eval()
    with torch.no_grad():
        logits, want = engine(x), dense(x)
        loss = engine.criterion(logits, y)
    torch.testing.assert_close(loss, nn.functional.cross_entropy(want, y), rtol=TOL, atol=TOL)
    correct = Accuracy()(logits, y)
    assert int(correct) == int((want.argmax(-1) == y).sum()), mode


@pytest.mark.parametrize("case", list(CASES))
def test_tp_nd_vit_matches_single_process(case: str) -> None:
    spawn(_train, CASES[case][0], case=case)
