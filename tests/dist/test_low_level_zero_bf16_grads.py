"""ZeRO-1/2 in bf16 with HybridAdam: the bf16 gradient partitions go to the update as they are.

Before, the step copied each partition to fp32 first (4 bytes per parameter of the rank's share
at the step's peak). Now HybridAdam widens them inside the update (``kolossos.zero.narrow_grads``)
and training must be bit-identical to the fp32 copies, which ``narrow_grads = False`` (the class
switch, what ``HybridZeroOptimizer`` uses) brings back: with clipping by norm that bites (the
factor deferred to the update) and by value after it (the factor applied first). The step's peak
falls by the fp32 copies less the update's one fp32 piece of scratch (``CHUNK_NUMEL`` elements).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.accelerator import TensorMemoryTracker
from kolossos.nn.optimizer import HybridAdam
from kolossos.nn.optimizer._adam_kernels import CHUNK_NUMEL
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import assert_moved, shard
from kolossos.zero.low_level import LowLevelZeroOptimizer

WIDTH, BATCH, STEPS = 1024, 8, 3  # partitions of ~525k elements, two pieces of the update
MAX_NORM = 0.05


class WideZero(LowLevelZeroOptimizer):
    narrow_grads = False


def _train(cls: type, stage: int) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 4)).bfloat16()
    opt = cls(HybridAdam(model.parameters(), lr=1e-2), partition_grad=stage == 2)
    before = [m.detach().clone() for m in opt.master_params()]
    gen = torch.Generator().manual_seed(1)
    peaks = []
    for step in range(STEPS):
        x = shard(torch.randn(BATCH, WIDTH, generator=gen), rank, world).bfloat16()
        opt.backward(model(x).float().pow(2).mean())
        with TensorMemoryTracker("cpu") as tracker:
            norm = opt.clip_grad_by_norm(MAX_NORM)
            assert float(norm) > 2 * MAX_NORM, float(norm)  # the clipping bites
            if step == STEPS - 1:
                opt.clip_grad_by_value(1e-3)
            opt.step()
        peaks.append(tracker.peak_bytes)
        opt.zero_grad()
    # the last step widens the gradients for the value clip: the peak of the steps before it
    return before, [m.detach().clone() for m in opt.master_params()], max(peaks[:-1])


@distributed(2)
def test_bf16_gradient_partitions_train_bit_identically() -> None:
    @parameterize("stage", [1, 2])
    def case(stage: int) -> None:
        before, narrow, narrow_peak = _train(LowLevelZeroOptimizer, stage)
        _, wide, wide_peak = _train(WideZero, stage)
        for got, want in zip(narrow, wide, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert_moved({str(i): t for i, t in enumerate(before)},
                     {str(i): t for i, t in enumerate(narrow)}, atol=1e-3)  # fmt: skip
        partition = sum(m.numel() for m in narrow)
        saved = 4 * (partition - CHUNK_NUMEL)
        assert wide_peak - narrow_peak >= 0.9 * saved, (stage, wide_peak, narrow_peak, saved)

    case()
